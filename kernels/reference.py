"""`torch.reference`: every scheme by dequantise-then-matmul. The numerical reference and the CPU backend.

It follows the data path of the fused kernels step by step, in a wider dtype:
dequantise the (already quantised) input, GEMM1 per expert, bias, activation, round the
intermediate to in_dtype (the kernels keep it in in_dtype), quantise it over *all* slots
at once (a dynamic per-tensor scale spans every slot), GEMM2 per expert, bias, routed
weight, sum over k. LoRA deltas join both GEMMs, computed from the unquantised GEMM inputs
(see lora.py). With compute_dtype=float64 it is the yardstick of the tests.
"""

from __future__ import annotations

from typing import Optional

import torch

from moerules.activation import SwigluParams

from .activations import apply_activation
from .interfaces import Experts
from .quantize import dequantize_activation, dequantize_weight, quantize_activation
from .scheme import TORCH_DTYPE, Scheme
from .weights import MoEWeights


def _expert_weight(w: torch.Tensor, scale: Optional[torch.Tensor], e: int, scheme: Scheme,
                   dtype: torch.dtype) -> torch.Tensor:
    if scheme.weight_dtype is None:
        return w[e].to(dtype)
    return dequantize_weight(w[e:e + 1], scale[e:e + 1], granularity=scheme.weight_granularity)[0].to(dtype)


def _lora_delta(a: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, e: int, scaling: float) -> torch.Tensor:
    """scaling * (a A[e]^T) B[e]^T in a's dtype."""
    return scaling * ((a @ lora_a[e].to(a.dtype).T) @ lora_b[e].to(a.dtype).T)


def moe_reference(hidden_q: torch.Tensor, *, weights: MoEWeights, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, a_scale: Optional[torch.Tensor], activation,
                  compute_dtype: torch.dtype = torch.float32, swiglu: SwigluParams = SwigluParams()) -> torch.Tensor:
    """-> [T, H] in compute_dtype. hidden_q/a_scale as prepared (quantised iff the scheme quantises)."""
    scheme = weights.scheme
    in_dtype = TORCH_DTYPE[weights.in_dtype]
    lora = weights.lora
    if lora is not None and scheme.quantizes_activations:
        raise ValueError(f"LoRA deltas need unquantised activations; scheme {scheme.cell} quantises them")
    T, k = topk_ids.shape
    if scheme.quantizes_activations:
        x = dequantize_activation(hidden_q, a_scale, granularity=scheme.act_granularity).to(compute_dtype)
    else:
        x = hidden_q.to(compute_dtype)
    flat_ids = topk_ids.reshape(-1).long()
    slot_token = torch.arange(T * k, device=x.device) // k
    # Id -1 marks a slot whose expert is on another rank (or a padding row): it contributes nothing.
    experts = [e for e in flat_ids.unique().tolist() if e >= 0]
    slots_of = {e: (flat_ids == e).nonzero().squeeze(1) for e in experts}

    w13, w2, s13, s2 = (weights.in_checkpoint_order(n) for n in ("w13", "w2", "w13_scale", "w2_scale"))
    # Zeros, so -1 slots are neutral for the intermediate's activation scales.
    inter = torch.zeros(T * k, weights.intermediate, dtype=in_dtype, device=x.device)
    for e in experts:
        slots = slots_of[e]
        xe = x[slot_token[slots]]
        h = xe @ _expert_weight(w13, s13, e, scheme, compute_dtype).T
        if lora is not None:
            h = h + _lora_delta(xe, lora.w13_lora_a, lora.w13_lora_b, e, lora.scaling)
        if weights.has_bias:
            h = h + weights.w13_bias[e].to(compute_dtype)
        inter[slots] = apply_activation(h, activation, swiglu).to(in_dtype)

    if scheme.quantizes_activations:
        q, s = quantize_activation(inter, dtype=scheme.act_torch_dtype, granularity=scheme.act_granularity,
                                   static_scale=weights.a2_scale)
        inter_c = dequantize_activation(q, s, granularity=scheme.act_granularity).to(compute_dtype)
    else:
        inter_c = inter.to(compute_dtype)

    out = torch.zeros(T, weights.hidden, dtype=compute_dtype, device=x.device)
    flat_w = topk_weights.reshape(-1).to(compute_dtype)
    for e in experts:
        slots = slots_of[e]
        y = inter_c[slots] @ _expert_weight(w2, s2, e, scheme, compute_dtype).T
        if lora is not None:  # inter_c is the unquantised intermediate here (LoRA needs unquantised activations)
            y = y + _lora_delta(inter_c[slots], lora.w2_lora_a, lora.w2_lora_b, e, lora.scaling)
        if weights.has_bias:
            y = y + weights.w2_bias[e].to(compute_dtype)
        out.index_add_(0, slot_token[slots], y * flat_w[slots, None])
    return out


class TorchReferenceExperts(Experts):

    def apply(self, hidden_q: torch.Tensor, *, weights: MoEWeights, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, a_scale: Optional[torch.Tensor]) -> torch.Tensor:
        x, a_scale = self.gemm1_input(hidden_q, a_scale=a_scale, weights=weights)
        out = moe_reference(x, weights=weights, topk_ids=topk_ids, topk_weights=topk_weights, a_scale=a_scale,
                            activation=self.activation, compute_dtype=torch.float32, swiglu=self.swiglu)
        return out.to(TORCH_DTYPE[weights.in_dtype])
