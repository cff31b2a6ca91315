"""Dynamic activation quantisation in one Triton pass per (row, group).

Per-token and 1x128-group scales need the amax of a row slice before any element can be
quantised. One program owns one slice, so the amax and the quantisation are two loops
over data that is still in L1/L2: one HBM read and one write per element, against the
four or five full passes of the torch expression.

MX (1x32 groups, e8m0 scales) has its own kernel: a group is only 32 elements, so one program
takes a [GROUPS, 32] tile of a row and reduces each group in registers.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moerules.quant import Granularity

from ..mx import E4M3_EMAX, E8M0_BIAS, E8M0_MAX, E8M0_MIN, MX_GROUP
from ..quantize import _MIN_SCALE, finite_amax, qmax, tensor_scale_from_amax
from ..scheme import QUANT_BLOCK

FP32_MAX = tl.constexpr(3.4028234663852886e38)  # NaN and Inf compare False against it


@triton.jit
def _slice_amax(x_row, start, end, BLOCK: tl.constexpr):
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(start, end, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.max(amax, axis=0)


@triton.jit
def _quantize_slice_kernel(x_ptr, q_ptr, scale_ptr, K, slice_len, stride_xm, stride_qm, stride_sm, q_max, min_scale,
                           FIXED_SCALE: tl.constexpr, TO_INT8: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * slice_len
    end = tl.minimum(start + slice_len, K)
    x_row = x_ptr + row * stride_xm
    if FIXED_SCALE:
        scale = tl.load(scale_ptr)
    else:
        scale = tl.maximum(_slice_amax(x_row, start, end, BLOCK) / q_max, min_scale)
        tl.store(scale_ptr + row * stride_sm + part, scale)
    for k in range(start, end, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < end
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x / scale, -q_max), q_max)
        if FIXED_SCALE and not TO_INT8:  # the per-tensor NaN policy (quantize.py): non-finite x -> NaN
            y = tl.where(tl.abs(x) <= FP32_MAX, y, x * 0.0)
        if TO_INT8:
            y = tl.where(y >= 0, y + 0.5, y - 0.5)  # round half away from zero, as the torch path
        tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_mx_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, stride_sm, q_max,
                        EMAX: tl.constexpr, BIAS: tl.constexpr, S_MIN: tl.constexpr, S_MAX: tl.constexpr,
                        GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """e8m0 scales per 1x32 group and the fp8 elements, with the rounding rule of mx.py."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = k < K
    x = tl.load(x_ptr + row * stride_xm + k, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    # floor(log2(amax)) + 127 is the fp32 exponent field (0 for zero and subnormal amax: clamped to S_MIN).
    biased = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - EMAX
    s = tl.where(amax > 0, tl.minimum(tl.maximum(biased, S_MIN), S_MAX), BIAS)
    inv = ((2 * BIAS - s) << 23).to(tl.float32, bitcast=True)  # 2^(127 - s): exact, no division
    y = tl.minimum(tl.maximum(x * inv[:, None], -q_max), q_max)
    tl.store(q_ptr + row * stride_qm + k, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_sm + g, s.to(tl.uint8), mask=g * GROUP < K)


def _quantize_mx(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    T, K = x.shape
    groups = triton.cdiv(K, MX_GROUP)
    scale = torch.empty(T, groups, dtype=torch.uint8, device=x.device)
    per_program = min(32, triton.next_power_of_2(groups))
    _quantize_mx_kernel[(T, triton.cdiv(groups, per_program))](
        x, q, scale, K, x.stride(0), q.stride(0), scale.stride(0), qmax(q.dtype), EMAX=E4M3_EMAX, BIAS=E8M0_BIAS,
        S_MIN=E8M0_MIN, S_MAX=E8M0_MAX, GROUPS=per_program, GROUP=MX_GROUP)
    return scale


def quantize_activation_triton(x: torch.Tensor, *, dtype: torch.dtype, granularity: Granularity,
                               static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = x.shape
    x = x.contiguous()
    q = torch.empty_like(x, dtype=dtype)
    if granularity == Granularity.group32:
        return q, _quantize_mx(x, q)
    if granularity == Granularity.tensor:
        if static_scale is not None:
            scale = static_scale.float().reshape(1).contiguous()
        else:
            scale = tensor_scale_from_amax(finite_amax(x), dtype)
        slice_len, parts, fixed = K, 1, True
    elif granularity == Granularity.token:
        slice_len, parts, fixed = K, 1, False
        scale = torch.empty(T, dtype=torch.float32, device=x.device)
    else:
        slice_len, parts, fixed = QUANT_BLOCK, triton.cdiv(K, QUANT_BLOCK), False
        scale = torch.empty(T, parts, dtype=torch.float32, device=x.device)
    block = min(1024, triton.next_power_of_2(slice_len))
    _quantize_slice_kernel[(T, parts)](x, q, scale, K, slice_len, x.stride(0), q.stride(0),
                                      scale.stride(0) if scale.dim() == 2 else 1, qmax(dtype), _MIN_SCALE,
                                      FIXED_SCALE=fixed, TO_INT8=dtype == torch.int8, BLOCK=block)
    return q, scale
