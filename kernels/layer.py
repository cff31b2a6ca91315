"""`MoELayer`: prepare -> experts -> finalize, with routing in front."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .activations import is_interleaved
from moerules.errors import KernelInputError

from .errors import KernelBuildError
from .interfaces import BatchedExperts, Experts, PrepareFinalize
from .lora import LoRAWeights, lora_refusal
from .registry import experts_spec
from .scheme import TORCH_DTYPE
from .routing import check_topk_dtypes, fused_topk, grouped_topk, validate_topk
from .weights import MoEWeights, pad_lora


@dataclass(frozen=True)
class RoutingConfig:
    """How router logits become top-k. Softmax without groups, bias or scaling is the fused softmax top-k;
    anything else (sigmoid scores, `num_expert_group` groups, a correction bias, a scaling factor) runs
    `grouped_topk` (one group is plain top-k)."""

    top_k: int
    renormalize: bool = True
    num_expert_group: Optional[int] = None
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0
    e_score_correction_bias: Optional[torch.Tensor] = None
    scoring: str = "softmax"

    @property
    def plain_softmax(self) -> bool:
        return (self.scoring == "softmax" and self.num_expert_group is None and self.e_score_correction_bias is None
                and self.routed_scaling_factor == 1.0)


class MoELayer:
    def __init__(self, *, prepare_finalize: PrepareFinalize, experts: Experts, weights: MoEWeights,
                 hidden_size: int, routing: Optional[RoutingConfig] = None, num_experts: Optional[int] = None,
                 shared_experts: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.weights = weights
        self.hidden_size = hidden_size      # logical (unpadded) hidden size of inputs and outputs
        self.routing = routing
        # Global experts, which router logits and topk ids refer to; under EP `weights` hold only this rank's.
        self.num_experts = num_experts if num_experts is not None else weights.num_experts
        self.shared_experts = shared_experts  # added to the routed output, on every token
        # Why no RoutingConfig could be made (e.g. the correction bias is missing): route()'s error says it.
        self.routing_refusal: Optional[str] = None
        experts.bind(prepare_finalize)

    @property
    def kernel_id(self) -> str:
        return self.experts.kernel_id

    def set_lora(self, lora: Optional[LoRAWeights]) -> None:
        """Attach LoRA adapters of the logical (unpadded) sizes, or remove them with None.

        For adapters that arrive after the build: they are padded as the weights were, and
        refused (KernelBuildError) where these experts cannot apply them.
        """
        if lora is not None and self.weights.padding:
            hidden_pad, intermediate_pad = self.weights.padding
            lora = pad_lora(lora, hidden_pad=hidden_pad, intermediate_pad=intermediate_pad, gated=self.weights.gated,
                            interleaved=is_interleaved(self.experts.activation))
        reason = self._lora_refusal(lora)
        if reason:
            raise KernelBuildError(self.kernel_id, reason)
        self.weights.lora = lora

    def _lora_refusal(self, lora: Optional[LoRAWeights]) -> Optional[str]:
        if lora is None:
            return None
        reason = lora_refusal(supports_lora=experts_spec(self.kernel_id).supports_lora, scheme=self.experts.scheme)
        if reason:
            return reason
        try:
            self.weights.check_lora(lora)
        except ValueError as exc:
            return str(exc)
        return None

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        if r is None:
            reason = self.routing_refusal or "this layer was built without a RoutingConfig"
            raise KernelInputError(f"{reason}; or pass topk_ids= and topk_weights=")
        if r.plain_softmax:
            return fused_topk(router_logits, top_k=r.top_k, renormalize=r.renormalize)
        return grouped_topk(router_logits, top_k=r.top_k, num_expert_group=r.num_expert_group or 1,
                            topk_group=r.topk_group or 1, e_score_correction_bias=r.e_score_correction_bias,
                            renormalize=r.renormalize, routed_scaling_factor=r.routed_scaling_factor,
                            scoring=r.scoring)

    def forward(self, x: torch.Tensor, *, router_logits: Optional[torch.Tensor] = None,
                topk_ids: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [M, hidden] -> [M, hidden]. Give either router_logits or both topk_ids and topk_weights.

        The input contract, checked here before any kernel runs (each breach a KernelInputError naming the
        argument): x is a [M, hidden] tensor of the layer's in_dtype on the weights' device, in any layout
        (a non-contiguous view, e.g. a column slice of a wider buffer or a transpose, is copied once to a
        contiguous [M, hidden], which every kernel then reads); router_logits is a floating [M, num_experts]
        tensor on the same device; topk_ids / topk_weights are validated by `validate_topk`.
        """
        x = self._checked_input(x)
        if router_logits is not None:
            if topk_ids is not None or topk_weights is not None:
                raise KernelInputError("give router_logits or topk_ids/topk_weights, not both")
            _check_tensor("router_logits", router_logits, shape=(x.shape[0], self.num_experts), device=x.device)
            if not router_logits.is_floating_point():
                raise KernelInputError(f"router_logits must be a floating tensor, got {router_logits.dtype}")
            topk_ids, topk_weights = self.route(router_logits)
        elif topk_ids is None or topk_weights is None:
            raise KernelInputError("forward needs router_logits, or both topk_ids and topk_weights")
        else:
            for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
                _check_tensor(name, tensor, shape=None, device=x.device)
            topk_ids, topk_weights = validate_topk(topk_ids=topk_ids, topk_weights=topk_weights,
                                                   num_tokens=x.shape[0], num_experts=self.num_experts)
        # Adapters assigned to weights.lora directly, bypassing set_lora, must never be dropped silently.
        reason = self._lora_refusal(self.weights.lora)
        if reason:
            raise ValueError(f"{self.kernel_id}: {reason}")
        prepared = self.prepare_finalize.prepare(x, topk_ids=topk_ids, topk_weights=topk_weights,
                                                 defer_input_quant=self.experts.expects_unquantized_inputs,
                                                 a13_scale=self.weights.a13_scale)
        # The prepare/finalize boundary is where a dispatcher returning its tuple in another order
        # swaps ids and weights (a seed regression); the dtype check costs no sync.
        check_topk_dtypes(topk_ids=prepared.topk_ids, topk_weights=prepared.topk_weights)
        batched = {}
        if isinstance(self.experts, BatchedExperts):  # only batched experts take the per-expert counts
            if prepared.expert_num_tokens is None:
                raise ValueError(f"{type(self.prepare_finalize).__name__} returned no expert_num_tokens for the "
                                 f"batched experts {self.kernel_id}")
            batched["expert_num_tokens"] = prepared.expert_num_tokens
        out = self.experts.apply(prepared.hidden_q, weights=self.weights, topk_ids=prepared.topk_ids,
                                 topk_weights=prepared.topk_weights, a_scale=prepared.a_scale, **batched)
        out = self.prepare_finalize.finalize(out, prepared=prepared, hidden_size=self.hidden_size)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    __call__ = forward

    def _checked_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the kernels read it: [M, hidden], in_dtype, on the weights' device, contiguous."""
        _check_tensor("x", x, shape=None, device=self.weights.device)
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise KernelInputError(f"x must be [tokens, {self.hidden_size}], got {tuple(x.shape)}")
        if x.dtype != TORCH_DTYPE[self.weights.in_dtype]:
            raise KernelInputError(f"x is {x.dtype}, this layer computes in {self.weights.in_dtype.value}; "
                                   f"convert it with x.to({TORCH_DTYPE[self.weights.in_dtype]})")
        # Kernels index rows and columns with the shape's strides: a strided view is copied, never misread.
        return x if x.is_contiguous() else x.contiguous()


def _check_tensor(name: str, t, *, shape: Optional[tuple[int, ...]], device: torch.device) -> None:
    """KernelInputError unless `t` is a tensor of `shape` (None: any) on `device`."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != shape:
        raise KernelInputError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if t.device.type != device.type or (device.index is not None and t.device.index not in (None, device.index)):
        raise KernelInputError(f"{name} is on {t.device}, the layer's weights are on {device}; move it with .to()")
