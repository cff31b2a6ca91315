"""Expert activations in torch, as every backend must compute them.

Gated activations take the GEMM1 output [T, 2I] and return [T, I]; which rows are gate and
which are up depends on the layout: [gate | up] halves, or interleaved (g0, u0, g1, u1, ...)
for gpt-oss's `swigluoai`. The non-gated `*_no_mul` activations take [T, I] (w13 holds I rows)
and apply the function elementwise; relu2 is relu(x)^2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moerules.activation import Activation, SwigluParams


GATED_ACTIVATIONS = frozenset({Activation.silu, Activation.gelu, Activation.gelu_tanh, Activation.swigluoai,
                               Activation.swigluoai_uninterleave})
NON_GATED_ACTIVATIONS = frozenset({Activation.silu_no_mul, Activation.gelu_no_mul, Activation.relu2_no_mul})
ACTIVATIONS = GATED_ACTIVATIONS | NON_GATED_ACTIVATIONS


def is_interleaved(activation: Activation) -> bool:
    return activation == Activation.swigluoai


def split_gate_up(h: torch.Tensor, activation: Activation) -> tuple[torch.Tensor, torch.Tensor]:
    if is_interleaved(activation):
        return h[..., 0::2], h[..., 1::2]
    return h.chunk(2, dim=-1)


def apply_activation(h: torch.Tensor, activation: Activation, swiglu: SwigluParams = SwigluParams()) -> torch.Tensor:
    """GEMM1 output -> GEMM2 input, in h's dtype: [T, 2I] -> [T, I] gated, [T, I] -> [T, I] non-gated.
    `swiglu`: the clamp limit and sigmoid gain of swigluoai (the model's, from its config)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation.value!r} is not implemented by moerules.kernels")
    if activation == Activation.silu_no_mul:
        return F.silu(h)
    if activation == Activation.gelu_no_mul:
        return F.gelu(h)
    if activation == Activation.relu2_no_mul:
        return torch.square(F.relu(h))
    gate, up = split_gate_up(h, activation)
    if activation == Activation.silu:
        return F.silu(gate) * up
    if activation == Activation.gelu:
        return F.gelu(gate) * up
    if activation == Activation.gelu_tanh:
        return F.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=swiglu.limit)
    up = up.clamp(-swiglu.limit, swiglu.limit)
    return gate * torch.sigmoid(swiglu.alpha * gate) * (up + 1)
