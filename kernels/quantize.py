"""Quantisation utilities: dynamic activation quant, static weight quant, and their inverses.

Conventions shared by every backend: dequantised value = q * scale; scales are fp32;
fp8 is e4m3fn (max 448) saturated, int8 is symmetric (max 127) rounded half away from
zero (the Triton quant kernel rounds the same way, so both paths give identical q).

Scale layouts, by granularity:
  activations [T, K]: tensor -> [1]; token -> [T]; group128 -> [T, cdiv(K, 128)];
                      group32 (MX) -> uint8 e8m0 [T, cdiv(K, 32)]
  weights [E, N, K]:  tensor -> [E]; channel -> [E, N]; block128 -> [E, cdiv(N,128), cdiv(K,128)];
                      group32 (MX) -> uint8 e8m0 [E, N, cdiv(K, 32)]
  batched activations [E, M, K] (rows >= count[e] are padding): tensor -> [1]; token -> [E, M];
    group128 -> [E, M, cdiv(K, 128)]
MX scales are powers of two and MX rounding is its own (see mx.py); MX weights whose dtype is
uint8 are packed e2m1 pairs [E, N, K/2], otherwise float8_e4m3fn.
"""

from __future__ import annotations

from typing import Optional

import torch

from moerules.quant import Granularity

from .mx import FP4_STORAGE, dequantize_mx, quantize_mx
from .qrange import qmax, scale_from_amax
from .scheme import QUANT_BLOCK

G = Granularity


def cast_saturated(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x already divided by its scale -> dtype, clamped to the representable range."""
    m = qmax(dtype)
    x = x.clamp(-m, m)
    if dtype == torch.int8:
        x = torch.trunc(x + 0.5 * torch.sign(x))
    return x.to(dtype)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite elements of x (0 when there are none): the amax of a dynamic per-tensor scale.

    The numerical policy (README, "Non-finite inputs"): one scale serves every token, so a NaN or Inf in
    one token would make it NaN or Inf and every token's output NaN. Non-finite values are left out of the
    amax instead, and quantise to NaN (`_nan_where_not_finite`), so the damage stays in the rows that hold
    them. A huge finite value is a value: it sets the scale and coarsens every token's quantisation.
    """
    if not x.numel():
        return torch.zeros((), device=x.device)
    absval = x.float().abs()
    return torch.where(absval < float("inf"), absval, 0.0).amax()


def _nan_where_not_finite(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-tensor fp8: a non-finite input element quantises to NaN, not to the saturated maximum.

    Saturated, an Inf would enter GEMM1 as the largest finite value and could raise the intermediate's
    per-tensor amax for every token; as NaN its row stays NaN, as in an unquantised layer, and the
    intermediate's finite amax leaves it out. int8 has no NaN: its per-tensor cells do not exist here.
    """
    if q.dtype == torch.int8:
        return q
    return torch.where(torch.isfinite(x), q, torch.tensor(float("nan"), dtype=q.dtype, device=q.device))


def tensor_scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [1] dynamic per-tensor scale for an amax found elsewhere (e.g. agreed over EP ranks)."""
    return scale_from_amax(amax, dtype).reshape(1)


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _group_view(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., cdiv(K,128), 128], zero padded (zeros never raise a group's amax)."""
    x = _pad_last(x, QUANT_BLOCK)
    return x.reshape(*x.shape[:-1], x.shape[-1] // QUANT_BLOCK, QUANT_BLOCK)


def quantize_activation(x: torch.Tensor, *, dtype: torch.dtype, granularity: Granularity,
                        static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations [T, K]; returns (q [T, K], scale in the layout of the module doc).

    A static scale is only meaningful per tensor; passing one skips the amax pass.
    On CUDA every granularity runs in Triton (triton/quant.py: one or two launches; this is on the hot
    path of every W8A8 forward, twice); elsewhere torch computes the same values.
    """
    if x.dim() != 2:
        raise ValueError(f"activations must be [tokens, hidden], got shape {tuple(x.shape)}")
    if static_scale is not None and granularity != G.tensor:
        raise ValueError(f"a static activation scale needs granularity 'tensor', not {granularity.value!r}")
    if granularity not in (G.tensor, G.token, G.group128, G.group32):
        raise ValueError(f"activation granularity {granularity.value!r} is not implemented")
    if granularity == G.group32 and dtype != torch.float8_e4m3fn:
        raise ValueError(f"MX activations are implemented for fp8 e4m3 only, not {dtype}")
    if x.is_cuda and x.shape[0] > 0:
        from .triton.quant import quantize_activation_triton
        return quantize_activation_triton(x, dtype=dtype, granularity=granularity, static_scale=static_scale)
    if granularity == G.group32:
        return quantize_mx(x, fp4=False)
    xf = x.float()
    if granularity == G.tensor:
        if static_scale is not None:
            scale = static_scale.float().reshape(1)
        else:
            scale = scale_from_amax(finite_amax(xf), dtype).reshape(1)
        return _nan_where_not_finite(cast_saturated(xf / scale, dtype), xf), scale
    if granularity == G.token:
        scale = scale_from_amax(xf.abs().amax(dim=1), dtype) if x.shape[1] else torch.ones(x.shape[0])
        return cast_saturated(xf / scale[:, None], dtype), scale
    groups = _group_view(xf)
    scale = scale_from_amax(groups.abs().amax(dim=-1), dtype)
    q = cast_saturated(groups / scale[..., None], dtype).flatten(-2)[:, :x.shape[1]]
    return q.contiguous(), scale


def quantize_activation_batched(x: torch.Tensor, *, expert_num_tokens: torch.Tensor, dtype: torch.dtype,
                                granularity: Granularity, static_scale: Optional[torch.Tensor] = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise batched activations [E, M, K] whose rows r >= expert_num_tokens[e] are padding.

    A dynamic per-tensor scale spans the valid rows only (padding may hold garbage or NaN); per-token
    and group scales are row-local, so padding rows get scales of their own that nobody reads. The
    padding is still read here: this is the deferred-quantisation path, not the experts' hot path
    (the Triton batched experts fold the intermediate's amax into GEMM1 instead).
    """
    if x.dim() != 3:
        raise ValueError(f"batched activations must be [experts, max_tokens, hidden], got shape {tuple(x.shape)}")
    E, M, K = x.shape
    if granularity == G.tensor and static_scale is None:
        valid = torch.arange(M, device=x.device)[None, :] < expert_num_tokens.to(x.device)[:, None]
        static_scale = scale_from_amax(finite_amax(torch.where(valid[..., None], x.float(), 0.0)), dtype).reshape(1)
    q, scale = quantize_activation(x.reshape(E * M, K), dtype=dtype, granularity=granularity,
                                   static_scale=static_scale)
    return q.view(E, M, K), (scale if granularity == G.tensor else scale.view(E, M, *scale.shape[1:]))


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, *, granularity: Granularity) -> torch.Tensor:
    qf = q.double()
    if granularity == G.tensor:
        return qf * scale.double().reshape(())
    if granularity == G.token:
        return qf * scale.double()[:, None]
    if granularity == G.group32:
        return dequantize_mx(q, scale)
    return (_group_view(qf) * scale.double()[..., None]).flatten(-2)[:, :q.shape[1]]


def quantize_weight(w: torch.Tensor, *, dtype: torch.dtype,
                    granularity: Granularity) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise expert weights [E, N, K] with a static scale per expert, channel, 128x128 block or MX group.

    For group32 (MX), dtype FP4_STORAGE (uint8) means packed e2m1, float8_e4m3fn means MXFP8.
    """
    if granularity == G.group32:
        return quantize_mx(w, fp4=dtype == FP4_STORAGE)
    wf = w.float()
    if granularity == G.tensor:
        scale = scale_from_amax(wf.abs().amax(dim=(1, 2)), dtype)
        return cast_saturated(wf / scale[:, None, None], dtype), scale
    if granularity == G.channel:
        scale = scale_from_amax(wf.abs().amax(dim=2), dtype)
        return cast_saturated(wf / scale[:, :, None], dtype), scale
    if granularity == G.block128:
        blocks = _block_view(wf)
        scale = scale_from_amax(blocks.abs().amax(dim=(2, 4)), dtype)
        q = cast_saturated(blocks / scale[:, :, None, :, None], dtype)
        return _unblock(q, w.shape), scale
    raise ValueError(f"weight granularity {granularity.value!r} is not implemented")


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, *, granularity: Granularity) -> torch.Tensor:
    if granularity == G.group32:
        return dequantize_mx(q, scale)
    qf = q.double()
    if granularity == G.tensor:
        return qf * scale.double()[:, None, None]
    if granularity == G.channel:
        return qf * scale.double()[:, :, None]
    return _unblock(_block_view(qf) * scale.double()[:, :, None, :, None], q.shape)


def _block_view(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E, N/128, 128, K/128, 128], zero padded on N and K."""
    E, N, K = w.shape
    w = torch.nn.functional.pad(w, (0, (-K) % QUANT_BLOCK, 0, (-N) % QUANT_BLOCK))
    return w.reshape(E, w.shape[1] // QUANT_BLOCK, QUANT_BLOCK, w.shape[2] // QUANT_BLOCK, QUANT_BLOCK)


def _unblock(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    E, nb, _, kb, _ = blocks.shape
    return blocks.reshape(E, nb * QUANT_BLOCK, kb * QUANT_BLOCK)[:, :shape[1], :shape[2]].contiguous()
