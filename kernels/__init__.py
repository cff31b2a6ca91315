"""Real MoE kernels, prepare/finalize, and the runnable layer.

Public API: `build_layer`, `KernelBuildError`, `MoEWeights`, `make_random_weights`,
`quantize_weights`, `LoRAWeights`, `make_random_lora`, `RoutingConfig`, `MoELayer`,
`supported_cells`. Triton is imported only when a Triton kernel is built or used.
"""

from .build import build_layer
from .errors import KernelBuildError
from .layer import MoELayer, RoutingConfig
from .lora import LoRAWeights, make_random_lora
from .registry import supported_cells
from .weights import MoEWeights, make_random_weights, quantize_weights

__all__ = ["build_layer", "KernelBuildError", "MoELayer", "RoutingConfig", "MoEWeights", "make_random_weights",
           "quantize_weights", "LoRAWeights", "make_random_lora", "supported_cells"]
