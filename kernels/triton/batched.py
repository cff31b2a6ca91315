"""Triton MoE experts over the batched format: x [E, max_tokens, K] plus the valid rows per expert.

Grid (m-block x n-block, expert): a program computes one BLOCK_M x BLOCK_N tile of one expert. The
counts stay on the device (no host sync, CUDA-graph safe): a program whose first row is at or past
its expert's count returns at once, and row masks keep padding rows (undefined contents, NaN
included) out of every load, store and amax.

GEMM1 computes act(gate) * up with the scales, bias and activation device functions of
fused_moe.py. When the scheme re-quantises the intermediate with a dynamic scale, it also folds the
absolute max of the values it stores (after the rounding to in_dtype, as the reference quantises
them) into an amax buffer with atomic max: per tensor, per row, or per row and 1x128 group. The
re-quantisation is then one elementwise pass over the valid rows (a Triton kernel on CUDA, torch
elsewhere): it never reads padding, and a per-tensor scale spans exactly the valid rows of all experts.
GEMM2 adds the bias but no router weight: the batched finalize applies it while it un-batches.

Scale codes are fused_moe.py's (A_SCALE / W_SCALE); AMAX / SCALE use the A_SCALE numbering
(1 tensor, 2 row, 3 group). Batched layouts (interfaces.PreparedInput): per-row scales [E, M] and
group scales [E, M, cdiv(K, 128)], contiguous.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moerules.activation import Activation, SwigluParams

from ..activations import is_interleaved
from ..qrange import qmax, scale_from_amax
from ..quantize import cast_saturated
from ..scheme import QUANT_BLOCK
from ..weights import MoEWeights
from .config import GemmConfig, MoEConfig, batched_config, check_batched_config
from .device import ptx_math
from .fused_moe import (SCALE_BLOCK, _acc_rows_first, _acc_zeros, _epilogue_scale, _gated_activation, _k_step,
                        _real_rows, _tile_coords)
from .launch import _A_SCALE, ACTIVATION_CODE, _launch_kwargs, _scale_strides, _scheme_flags, _weight_blocks
from .quant import _finite_abs


@triton.jit
def _expert_tile(counts_ptr, max_tokens, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(expert, m-block, n-block, the expert's valid rows) of this program."""
    e = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(max_tokens, BLOCK_M), N, BLOCK_M, BLOCK_N, GROUP_M)
    return e, pid_m, pid_n, tl.load(counts_ptr + e)


@triton.jit
def _tile_dot(a_ptr, rows, row_ok, stride_am, a_scale_ptr, stride_asm, w_ptr, w_scale_ptr, n1, n2, col_ok, K,
              stride_wn, stride_wsn, A_SCALE: tl.constexpr, W_SCALE: tl.constexpr, UPCAST_W: tl.constexpr,
              TWO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SWAP_AB: tl.constexpr, W_BLOCKS: tl.constexpr):
    """x[rows] . w[n1] (and . w[n2] when TWO: gate and up share each A load), scaled, fp32 [BLOCK_M, BLOCK_N].

    a_ptr / a_scale_ptr / w_ptr / w_scale_ptr already point at this expert. W_BLOCKS 1 (block scaling): n1's rows lie
    in one 128-row scale block, and so do n2's (fused_moe._k_step's one weight scale per step).
    """
    acc1 = _acc_zeros(BLOCK_M, BLOCK_N, tl.float32, SWAP_AB)
    acc2 = _acc_zeros(BLOCK_M, BLOCK_N, tl.float32, SWAP_AB)
    w1, w2 = _real_rows(n1, col_ok), _real_rows(n2, col_ok)
    first1, first2 = tl.min(n1, axis=0), tl.min(n2, axis=0)  # the rows ascend from the tile's first
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc1 = _k_step(acc1, a, a_scale_ptr, rows, row_ok, stride_asm, w_ptr, w_scale_ptr, w1, col_ok, w1,
                       stride_wn, stride_wsn, k0, ks, k_ok, K, A_SCALE, W_SCALE, UPCAST_W, 0, False, BLOCK_N, BLOCK_K,
                       SWAP_AB, block_rows=first1, W_BLOCKS=W_BLOCKS)
        if TWO:
            acc2 = _k_step(acc2, a, a_scale_ptr, rows, row_ok, stride_asm, w_ptr, w_scale_ptr, w2, col_ok, w2,
                           stride_wn, stride_wsn, k0, ks, k_ok, K, A_SCALE, W_SCALE, UPCAST_W, 0, False,
                           BLOCK_N, BLOCK_K, SWAP_AB, block_rows=first2, W_BLOCKS=W_BLOCKS)
    acc1 = _epilogue_scale(_acc_rows_first(acc1, SWAP_AB), a_scale_ptr, rows, row_ok, w_scale_ptr, n1, col_ok,
                           stride_wsn, A_SCALE, W_SCALE)
    if TWO:
        acc2 = _epilogue_scale(_acc_rows_first(acc2, SWAP_AB), a_scale_ptr, rows, row_ok, w_scale_ptr, n2, col_ok,
                               stride_wsn, A_SCALE, W_SCALE)
    return acc1, acc2


@triton.jit
def _fold_amax(amax_ptr, row_index, row_ok, absval, group, num_groups, AMAX: tl.constexpr):
    """Atomic-max a tile's |values| into the amax of the tensor (1), of each row (2) or of each row's group (3)."""
    if AMAX == 1:  # per tensor: non-finite values stay out of the amax (quantize.finite_amax, the NaN policy)
        tl.atomic_max(amax_ptr, tl.max(tl.max(_finite_abs(absval), axis=1), axis=0))
    elif AMAX == 2:
        tl.atomic_max(amax_ptr + row_index, tl.max(absval, axis=1), mask=row_ok)
    else:
        tl.atomic_max(amax_ptr + row_index * num_groups + group, tl.max(absval, axis=1), mask=row_ok)


@triton.jit
def batched_gemm1_kernel(
        a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, amax_ptr, counts_ptr,
        max_tokens, N, K, gate_row_step, up_row_offset, num_groups,
        stride_ae, stride_am, stride_ase, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be,
        stride_oe, stride_om,
        A_SCALE: tl.constexpr, W_SCALE: tl.constexpr, UPCAST_W: tl.constexpr, HAS_BIAS: tl.constexpr,
        ACTIVATION: tl.constexpr, AMAX: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SWAP_AB: tl.constexpr, swiglu_limit, swiglu_alpha, PTX_MATH: tl.constexpr,
        EIGHT_BIT_OUT: tl.constexpr, W_BLOCKS: tl.constexpr):
    """out[e, r, n] = act(x[e, r] . w[e, gate(n)] + b, x[e, r] . w[e, up(n)] + b) for r < count[e], n < N = I."""
    e, pid_m, pid_n, count = _expert_tile(counts_ptr, max_tokens, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= count:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    gate_rows = cols * gate_row_step
    up_rows = gate_rows + up_row_offset
    gate, up = _tile_dot(a_ptr + e * stride_ae, rows, row_ok, stride_am, a_scale_ptr + e * stride_ase, stride_asm,
                         w_ptr + e * stride_we, w_scale_ptr + e * stride_wse, gate_rows, up_rows, col_ok, K,
                         stride_wn, stride_wsn, A_SCALE, W_SCALE, UPCAST_W, True, BLOCK_M, BLOCK_N, BLOCK_K,
                         SWAP_AB, W_BLOCKS)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + e * stride_be + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + e * stride_be + up_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = _gated_activation(gate, up, swiglu_limit, swiglu_alpha, ACTIVATION, PTX_MATH, EIGHT_BIT_OUT)
    out = out.to(out_ptr.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + e * stride_oe + rows[:, None] * stride_om + cols[None, :], out, mask=mask)
    if AMAX != 0:
        # BLOCK_N divides 128 (check_batched_config), so the tile lies in one group.
        _fold_amax(amax_ptr, e * max_tokens + rows, row_ok, tl.where(mask, tl.abs(out.to(tl.float32)), 0.0),
                   pid_n * BLOCK_N // SCALE_BLOCK, num_groups, AMAX)


@triton.jit
def batched_quant_kernel(x_ptr, q_ptr, scale_ptr, counts_ptr, max_tokens, K, num_groups,
                         stride_xe, stride_xm, stride_qe, stride_qm, q_max,
                         SCALE: tl.constexpr, BLOCK_M: tl.constexpr):
    """q[e, r, :] = saturate(x[e, r, :] / scale) for r < count[e]; one program per BLOCK_M rows x one 128-group."""
    e, pid_m, group, count = _expert_tile(counts_ptr, max_tokens, K, BLOCK_M, SCALE_BLOCK, 1)
    if pid_m * BLOCK_M >= count:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    ks = group * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    mask = row_ok[:, None] & (ks < K)[None, :]
    x = tl.load(x_ptr + e * stride_xe + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
    if SCALE == 1:
        scale = tl.load(scale_ptr)
    elif SCALE == 2:
        scale = tl.load(scale_ptr + e * max_tokens + rows, mask=row_ok, other=1.0)[:, None]
    else:
        scale = tl.load(scale_ptr + (e * max_tokens + rows) * num_groups + group, mask=row_ok, other=1.0)[:, None]
    y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -q_max), q_max)
    tl.store(q_ptr + e * stride_qe + rows[:, None] * stride_qm + ks[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def batched_gemm2_kernel(
        a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, counts_ptr,
        max_tokens, N, K,
        stride_ae, stride_am, stride_ase, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be,
        stride_oe, stride_om,
        A_SCALE: tl.constexpr, W_SCALE: tl.constexpr, UPCAST_W: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SWAP_AB: tl.constexpr, W_BLOCKS: tl.constexpr):
    """out[e, r, n] = inter[e, r] . w[e, n] + bias[e, n] for r < count[e], n < N = H (no router weight)."""
    e, pid_m, pid_n, count = _expert_tile(counts_ptr, max_tokens, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= count:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    out, _ = _tile_dot(a_ptr + e * stride_ae, rows, row_ok, stride_am, a_scale_ptr + e * stride_ase, stride_asm,
                       w_ptr + e * stride_we, w_scale_ptr + e * stride_wse, cols, cols, col_ok, K, stride_wn,
                       stride_wsn, A_SCALE, W_SCALE, UPCAST_W, False, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, W_BLOCKS)
    if HAS_BIAS:
        out += tl.load(bias_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + e * stride_oe + rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _accumulator_blocks(weights: MoEWeights, g: GemmConfig, *, gemm: int, interleaved: bool) -> int:
    """The batched kernels' W_BLOCKS: 1 where each accumulator's weight rows (gate, up, or GEMM2's) lie in one
    128-row scale block, which is where a fused tile's rows, or each of its halves, do (launch._weight_blocks)."""
    return 1 if _weight_blocks(weights, g, gemm=gemm, interleaved=interleaved) else 0


def _kernel_flags(weights: MoEWeights) -> dict:
    flags = _scheme_flags(weights)
    flags.pop("ACC_INT")  # no INT8 here (refused at build): accumulators are fp32
    flags.pop("W_FP4")    # no MX here (refused at build); compiled Triton rejects unknown keywords
    return flags


def _row_scale_strides(scale: Optional[torch.Tensor], per_tensor: bool) -> tuple[int, int]:
    """(per-expert, per-row) strides of an activation scale in the batched layouts; 0 for one scale."""
    if scale is None or per_tensor:
        return 0, 0
    return scale.stride(0), (scale.stride(1) if scale.dim() == 3 else 1)


def _amax_buffer(shape_em: tuple[int, int], num_groups: int, code: int, device) -> torch.Tensor:
    shape = {1: (1,), 2: shape_em, 3: (*shape_em, num_groups)}[code]
    return torch.zeros(shape, dtype=torch.float32, device=device)


def _quantize_rows(inter: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor, code: int, dtype: torch.dtype,
                   block_m: int) -> torch.Tensor:
    """inter [E, M, I] / scale, saturated to dtype: the Triton pass on CUDA, torch elsewhere (as quantize.py
    does; the interpreter's fp32 -> fp8 cast also drops the carry of a round-up: 127 -> 64)."""
    E, M, I = inter.shape
    if not inter.is_cuda:
        s = {1: scale, 2: scale[..., None], 3: scale.repeat_interleave(QUANT_BLOCK, dim=-1)[..., :I]}[code]
        return cast_saturated(inter.float() / s, dtype)
    q = torch.empty(E, M, I, dtype=dtype, device=inter.device)
    num_groups = triton.cdiv(I, QUANT_BLOCK)
    batched_quant_kernel[(triton.cdiv(M, block_m) * num_groups, E)](
        inter, q, scale, counts, M, I, num_groups, inter.stride(0), inter.stride(1), q.stride(0), q.stride(1),
        qmax(dtype), SCALE=code, BLOCK_M=block_m)
    return q


def batched_moe(x_q: torch.Tensor, *, a_scale: Optional[torch.Tensor], expert_num_tokens: torch.Tensor,
                weights: MoEWeights, activation: Activation, out_dtype: torch.dtype, num_tokens: int, top_k: int,
                config: Optional[MoEConfig] = None, swiglu: SwigluParams = SwigluParams()) -> torch.Tensor:
    """x_q [E, M, H] (quantised per weights.scheme, a_scale in the batched layouts) -> [E, M, H] in out_dtype.

    Row r of expert e is expert e's output for x_q[e, r] when r < expert_num_tokens[e], unweighted;
    other rows are not written. num_tokens / top_k (this rank's routing) pick the tile config;
    `config` overrides it.
    """
    scheme = weights.scheme
    E, M, H = x_q.shape
    I = weights.intermediate
    if (E, H) != (weights.num_experts, weights.hidden) or expert_num_tokens.shape != (E,) or x_q.stride(2) != 1:
        raise ValueError(f"batched input {tuple(x_q.shape)} (strides {x_q.stride()}) with counts "
                         f"{tuple(expert_num_tokens.shape)} does not match weights of {weights.num_experts} experts x "
                         f"hidden {weights.hidden} with a contiguous hidden dimension")
    out = torch.empty(E, M, H, dtype=out_dtype, device=x_q.device)
    if E == 0 or M == 0:
        return out
    cfg = config or batched_config(num_tokens=num_tokens, num_experts=E, top_k=top_k, max_tokens=M, scheme=scheme)
    check_batched_config(cfg, scheme)  # an override too: the group amax needs GEMM1 tiles inside one group
    counts = expert_num_tokens.to(torch.int32).contiguous()
    flags = _kernel_flags(weights)
    dummy = weights.w13
    bias13 = weights.w13_bias if weights.has_bias else dummy
    bias2 = weights.w2_bias if weights.has_bias else dummy
    per_tensor = flags["A_SCALE"] == 1  # one activation scale, input and intermediate alike
    if a_scale is not None:
        a_scale = a_scale.contiguous()

    # GEMM1, folding the intermediate's amax when it is re-quantised with a dynamic scale.
    requant = scheme.quantizes_activations
    static = weights.a2_scale is not None
    scale_code = _A_SCALE[scheme.act_granularity]
    fold = scale_code if requant and not static else 0  # which amax GEMM1 folds (0: none)
    num_groups = triton.cdiv(I, QUANT_BLOCK)
    amax = _amax_buffer((E, M), num_groups, fold, x_q.device) if fold else dummy
    inter = torch.empty(E, M, I, dtype=out_dtype, device=x_q.device)
    interleaved = is_interleaved(activation)
    a_se, a_sm = _row_scale_strides(a_scale, per_tensor)
    g1 = cfg.gemm1
    batched_gemm1_kernel[(triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(I, g1.BLOCK_N), E)](
        x_q, a_scale if a_scale is not None else dummy, weights.w13,
        weights.w13_scale if weights.w13_scale is not None else dummy, bias13, inter, amax, counts,
        M, I, H, 2 if interleaved else 1, 1 if interleaved else I, num_groups,
        x_q.stride(0), x_q.stride(1), a_se, a_sm, weights.w13.stride(0), weights.w13.stride(1),
        *_scale_strides(weights.w13_scale), bias13.stride(0), inter.stride(0), inter.stride(1),
        HAS_BIAS=weights.has_bias, ACTIVATION=ACTIVATION_CODE[activation],
        AMAX=fold, BLOCK_M=cfg.BLOCK_M, **flags, **_launch_kwargs(g1), swiglu_limit=swiglu.limit,
        swiglu_alpha=swiglu.alpha, **ptx_math(x_q.device), EIGHT_BIT_OUT=requant,
        W_BLOCKS=_accumulator_blocks(weights, g1, gemm=1, interleaved=interleaved))

    inter_q, inter_scale = inter, None
    if requant:
        inter_scale = weights.a2_scale.float().reshape(1) if static else scale_from_amax(amax, scheme.act_torch_dtype)
        inter_q = _quantize_rows(inter, inter_scale, counts, scale_code, scheme.act_torch_dtype, cfg.BLOCK_M)

    i_se, i_sm = _row_scale_strides(inter_scale, per_tensor)
    g2 = cfg.gemm2
    batched_gemm2_kernel[(triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(H, g2.BLOCK_N), E)](
        inter_q, inter_scale if inter_scale is not None else dummy, weights.w2,
        weights.w2_scale if weights.w2_scale is not None else dummy, bias2, out, counts,
        M, H, I,
        inter_q.stride(0), inter_q.stride(1), i_se, i_sm, weights.w2.stride(0), weights.w2.stride(1),
        *_scale_strides(weights.w2_scale), bias2.stride(0), out.stride(0), out.stride(1),
        HAS_BIAS=weights.has_bias, BLOCK_M=cfg.BLOCK_M, **flags, **_launch_kwargs(g2),
        W_BLOCKS=_accumulator_blocks(weights, g2, gemm=2, interleaved=False))
    return out
