"""Expert activation functions and the dtypes a layer computes in."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Activation(str, Enum):
    """The MoE activation. Gated ones apply `act(gate) * up` on a [gate | up] GEMM1 output."""

    silu = "silu"
    gelu = "gelu"
    gelu_tanh = "gelu_tanh"
    swigluoai = "swigluoai"                    # gpt-oss: clamp, sigmoid gain alpha, (up + 1); interleaved gate/up
    swigluoai_uninterleave = "swigluoai_uninterleave"
    silu_no_mul = "silu_no_mul"
    gelu_no_mul = "gelu_no_mul"
    relu2_no_mul = "relu2_no_mul"

    @property
    def gated(self) -> bool:
        return not self.value.endswith("_no_mul")


@dataclass(frozen=True)
class SwigluParams:
    """gpt-oss's clamped SwiGLU (`swigluoai`): gate <= limit, -limit <= up <= limit, then
    gate * sigmoid(alpha * gate) * (up + 1). The defaults are gpt-oss's (transformers GptOssConfig)."""

    limit: float = 7.0
    alpha: float = 1.702


class Dtype(str, Enum):
    """Unquantised activation/compute dtype."""

    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"
