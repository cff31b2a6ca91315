"""Dynamic (and static per-tensor) activation quantisation in Triton: few launches, one HBM read per element.

Per tensor: the amax is a reduction over the whole tensor, so it cannot come from the program that
quantises an element. Tensors of at most `_SINGLE_TILE` elements (decode-sized inputs and
intermediates) are one program: it reduces its tile and quantises the same tile, still in L1, in one
launch. Larger ones take two: a grid-stride pass writes one partial amax per program (a few hundred
floats, no atomics, so nothing to zero between calls and nothing shared across streams), then every
program of the grid-stride quantise pass reduces those partials to the scale itself. The torch
expression it replaces (abs, where, amax, divide, clamp, then the quantise kernel) was five or six
launches, and torch's reduction runs on few CTAs at small sizes.

Per 1x128 group and per MX 1x32 group: one program holds GROUPS whole groups of one row as a
[GROUPS, GROUP] tile and reduces each group in registers, so the amax and the quantisation read the
data once (one program per 128-element group, in two loops, cost DeepSeek-V3 360 us more per forward at
M=4096 on the H100: bench/results/quant).

Per token: one program per row, the amax and the quantisation as two loops over the row (the second
read hits L1/L2).

MX activations also go back to their values (`dequantize_mx`, exact in bf16): the MXFP8 GEMMs read their inputs
dequantised once rather than once per column tile (fused_moe.py).

GEMM2's input (GEMM1's output) needs no amax pass: GEMM1's programs each write the finite amax of the tile they
store (fused_moe.gemm1_gated_kernel, AMAX), `scale_of_partials` reduces those in one small program, and the
quantise pass runs on that scale as on a static one: one read of the intermediate instead of two. Below
`_SINGLE_TILE` elements the single program is one launch already, and GEMM1 writes no partials.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moerules.quant import Granularity

from ..mx import E4M3_EMAX, E8M0_BIAS, E8M0_MAX, E8M0_MIN, MX_GROUP
from ..qrange import MIN_SCALE, qmax
from ..scheme import QUANT_BLOCK
from .device import sm_count
from .pdl import dependent_launch_entry, pdl_kwargs

G = Granularity
FP32_MAX = tl.constexpr(3.4028234663852886e38)  # NaN and Inf compare False against it
# Per tensor: the largest tensor one program quantises alone, and the elements per grid-stride step.
_SINGLE_TILE = 16384
_TENSOR_BLOCK = 4096
# Per tensor: programs per SM of the grid-stride passes (enough loads in flight to stream HBM).
_PROGRAMS_PER_SM = 4
# Partial amaxes reduced per step by `scale_of_partials` (GEMM1 writes one per program: thousands at large M).
_PARTIALS_BLOCK = 1024
# Groups per program of the group kernel, by group size: 16 x 128 and 32 x 32 elements.
_GROUPS_PER_PROGRAM = {QUANT_BLOCK: 16, MX_GROUP: 32}


@triton.jit
def _finite_abs(x):
    """|x|, with NaN and Inf counted as 0: the per-tensor NaN policy of quantize.finite_amax."""
    a = tl.abs(x)
    return tl.where(a <= FP32_MAX, a, 0.0)


@triton.jit
def _dynamic_scale(amax, q_max, min_scale):
    """The scale that maps amax to the largest quantised value (qrange.scale_from_amax)."""
    return tl.maximum(amax / q_max, min_scale)


@triton.jit
def _saturate(x, scale, q_max, TO_INT8: tl.constexpr):
    """x / scale clamped to the quantised range; int8 rounds half away from zero, as the torch path."""
    y = tl.minimum(tl.maximum(x / scale, -q_max), q_max)
    if TO_INT8:
        y = tl.where(y >= 0, y + 0.5, y - 0.5)
    return y


@triton.jit
def _tensor_amax_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """partial[p] = the finite amax of the BLOCK-wide chunks p, p + P, p + 2P, ... of x (P programs)."""
    dependent_launch_entry(PDL)
    pid = tl.program_id(0)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, _finite_abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)))
    tl.store(partial_ptr + pid, tl.max(amax, axis=0))


@triton.jit
def _tensor_quant_kernel(x_ptr, q_ptr, scale_ptr, partial_ptr, n, num_partials, q_max, min_scale,
                         STATIC: tl.constexpr, PARTIALS: tl.constexpr, TO_INT8: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """q = saturate(x / scale) over a grid-stride loop; a non-finite x gives NaN (fp8).

    The scale: loaded (STATIC); else the amax of the num_partials partials (PARTIALS, a power of two, covers
    them); else (PARTIALS == 0) the amax of x itself, which this single program holds in one BLOCK tile.
    """
    dependent_launch_entry(PDL)
    pid = tl.program_id(0)
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        if PARTIALS == 0:
            offs = tl.arange(0, BLOCK)
            amax = tl.max(_finite_abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)), axis=0)
        else:
            parts = tl.arange(0, PARTIALS)
            amax = tl.max(tl.load(partial_ptr + parts, mask=parts < num_partials, other=0.0), axis=0)
        scale = _dynamic_scale(amax, q_max, min_scale)
        if pid == 0:
            tl.store(scale_ptr, scale)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _saturate(x, scale, q_max, TO_INT8)
        if not TO_INT8:  # the per-tensor NaN policy (quantize.py): non-finite x -> NaN
            y = tl.where(tl.abs(x) <= FP32_MAX, y, x * 0.0)
        tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_quant_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, q_max, min_scale,
                        TO_INT8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program: scale = amax(row) / q_max, then q = saturate(row / scale)."""
    dependent_launch_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
    scale = _dynamic_scale(tl.max(amax, axis=0), q_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + offs, _saturate(x, scale, q_max, TO_INT8).to(q_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _e8m0_of(amax, EMAX: tl.constexpr, BIAS: tl.constexpr, S_MIN: tl.constexpr, S_MAX: tl.constexpr):
    """(e8m0 byte, 1 / scale) of group amaxes, with the rounding rule of mx.py."""
    # floor(log2(amax)) + 127 is the fp32 exponent field (0 for zero and subnormal amax: clamped to S_MIN).
    biased = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - EMAX
    s = tl.where(amax > 0, tl.minimum(tl.maximum(biased, S_MIN), S_MAX), BIAS)
    return s, ((2 * BIAS - s) << 23).to(tl.float32, bitcast=True)  # 2^(127 - s): exact, no division


@triton.jit
def _e8m0(s):
    """e8m0 bytes -> 2^(s - 127) in fp32, written straight into the exponent bits (exact for 1 <= s <= 254)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_dequant_kernel(q_ptr, scale_ptr, out_ptr, K, stride_qm, stride_sm, stride_om, GROUPS: tl.constexpr,
                       GROUP: tl.constexpr, PDL: tl.constexpr):
    """GROUPS consecutive MX groups of one row: each element times its group's e8m0 scale, in out's dtype."""
    dependent_launch_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = k < K
    q = tl.load(q_ptr + row * stride_qm + k, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + row * stride_sm + g, mask=g * GROUP < K, other=0)
    tl.store(out_ptr + row * stride_om + k, (q * _e8m0(s)[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, stride_sm, q_max, min_scale,
                        MX: tl.constexpr, TO_INT8: tl.constexpr, EMAX: tl.constexpr, BIAS: tl.constexpr,
                        S_MIN: tl.constexpr, S_MAX: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                        PDL: tl.constexpr):
    """GROUPS consecutive groups of GROUP elements of one row: a scale per group, then the elements.

    MX: e8m0 (uint8) power-of-two scales (mx.py's rule); else fp32 scales amax / q_max.
    """
    dependent_launch_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = k < K
    x = tl.load(x_ptr + row * stride_xm + k, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if MX:
        s, inv = _e8m0_of(amax, EMAX, BIAS, S_MIN, S_MAX)
        y = tl.minimum(tl.maximum(x * inv[:, None], -q_max), q_max)
        stored = s.to(tl.uint8)
    else:
        stored = _dynamic_scale(amax, q_max, min_scale)
        y = _saturate(x, stored[:, None], q_max, TO_INT8)
    tl.store(q_ptr + row * stride_qm + k, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_sm + g, stored, mask=g * GROUP < K)


@triton.jit
def _partials_scale_kernel(partial_ptr, scale_ptr, n, q_max, min_scale, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """The dynamic scale of max(partial), in one program (the partials are already finite amaxes)."""
    dependent_launch_entry(PDL)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.load(partial_ptr + offs, mask=offs < n, other=0.0))
    tl.store(scale_ptr, _dynamic_scale(tl.max(amax, axis=0), q_max, min_scale))


def needs_amax_pass(numel: int) -> bool:
    """Whether a dynamic per-tensor quantisation of numel elements reads them twice (an amax pass first)."""
    return numel > _SINGLE_TILE


def scale_of_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dynamic per-tensor scale [1] (fp32) to `dtype` of a tensor whose finite amax is max(partials)."""
    scale = torch.empty(1, dtype=torch.float32, device=partials.device)
    _partials_scale_kernel[(1,)](partials, scale, partials.numel(), qmax(dtype), MIN_SCALE, BLOCK=_PARTIALS_BLOCK,
                                 **pdl_kwargs(partials.device))
    return scale


def _quantize_tensor(x: torch.Tensor, q: torch.Tensor, static_scale: Optional[torch.Tensor]) -> torch.Tensor:
    n = x.numel()
    single = n <= _SINGLE_TILE
    block = max(16, triton.next_power_of_2(n)) if single else _TENSOR_BLOCK
    programs = 1 if single else min(triton.cdiv(n, block), _PROGRAMS_PER_SM * sm_count(x.device))
    scale, partials, num_partials = torch.empty(1, dtype=torch.float32, device=x.device), x, 0
    if static_scale is not None:
        scale = static_scale.float().reshape(1).contiguous()
    elif not single:
        partials = torch.empty(programs, dtype=torch.float32, device=x.device)
        _tensor_amax_kernel[(programs,)](x, partials, n, BLOCK=block, **pdl_kwargs(x.device))
        num_partials = programs
    _tensor_quant_kernel[(programs,)](
        x, q, scale, partials, n, num_partials, qmax(q.dtype), MIN_SCALE, STATIC=static_scale is not None,
        PARTIALS=triton.next_power_of_2(num_partials) if num_partials else 0, TO_INT8=q.dtype == torch.int8,
        BLOCK=block, num_warps=max(4, min(16, block // 1024)), **pdl_kwargs(x.device))
    return scale


def _quantize_tokens(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    T, K = x.shape
    scale = torch.empty(T, dtype=torch.float32, device=x.device)
    _token_quant_kernel[(T,)](x, q, scale, K, x.stride(0), q.stride(0), qmax(q.dtype), MIN_SCALE,
                              TO_INT8=q.dtype == torch.int8, BLOCK=min(1024, triton.next_power_of_2(K)),
                              **pdl_kwargs(x.device))
    return scale


def _quantize_groups(x: torch.Tensor, q: torch.Tensor, group: int) -> torch.Tensor:
    T, K = x.shape
    mx = group == MX_GROUP
    groups = triton.cdiv(K, group)
    scale = torch.empty(T, groups, dtype=torch.uint8 if mx else torch.float32, device=x.device)
    per_program = min(_GROUPS_PER_PROGRAM[group], triton.next_power_of_2(groups))
    _group_quant_kernel[(T, triton.cdiv(groups, per_program))](
        x, q, scale, K, x.stride(0), q.stride(0), scale.stride(0), qmax(q.dtype), MIN_SCALE, MX=mx,
        TO_INT8=q.dtype == torch.int8, EMAX=E4M3_EMAX, BIAS=E8M0_BIAS, S_MIN=E8M0_MIN, S_MAX=E8M0_MAX,
        GROUPS=per_program, GROUP=group, **pdl_kwargs(x.device))
    return scale


def dequantize_mx(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MX activations [T, K] with their e8m0 scales [T, K/32] -> their values in dtype (exact in bf16; in fp16 while
    they stay in its range, as the fp16 model's own tensors do)."""
    T, K = q.shape
    out = torch.empty(T, K, dtype=dtype, device=q.device)
    groups = triton.cdiv(K, MX_GROUP)
    per_program = min(_GROUPS_PER_PROGRAM[MX_GROUP], triton.next_power_of_2(groups))
    _mx_dequant_kernel[(T, triton.cdiv(groups, per_program))](
        q, scale, out, K, q.stride(0), scale.stride(0), out.stride(0), GROUPS=per_program, GROUP=MX_GROUP,
        **pdl_kwargs(q.device))
    return out


def quantize_activation_triton(x: torch.Tensor, *, dtype: torch.dtype, granularity: Granularity,
                               static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize.quantize_activation on the GPU (same arguments, checked there; same layouts and rounding)."""
    x = x.contiguous()
    q = torch.empty_like(x, dtype=dtype)
    if granularity == G.tensor:
        return q, _quantize_tensor(x, q, static_scale)
    if granularity == G.token:
        return q, _quantize_tokens(x, q)
    return q, _quantize_groups(x, q, MX_GROUP if granularity == G.group32 else QUANT_BLOCK)
