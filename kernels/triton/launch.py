"""Host side of the Triton fused MoE: align, GEMM1(+activation), re-quantise, GEMM2(+router weight), top-k sum.

At decode sizes the naive assignment launches nothing (align.py), and a chained config (MoEConfig.CHAIN) runs both
GEMMs and the sum as one launch (chain.py); on sm_90 each kernel is launched while the one before it finishes
(pdl.py).

With LoRA adapters, a shrink kernel runs before each GEMM over the same sorted blocks, on the
unquantised GEMM input (x, and GEMM1's output before any re-quantisation); the GEMM epilogues
add the expand.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import replace
from typing import Callable, Iterator, Optional

import torch
import triton
from triton.runtime.errors import PTXASError
from triton.tools.tensor_descriptor import TensorDescriptor

from moerules.activation import Activation, SwigluParams
from moerules.errors import KernelInputError
from moerules.quant import Granularity

from .. import fp4_fragments
from ..activations import is_interleaved
from ..lora import LoRAWeights
from ..mx import MX_GROUP
from ..scheme import QUANT_BLOCK, Scheme
from ..weights import MoEWeights
from . import chain
from .align import Alignment, moe_align
from .config import GemmConfig, MoEConfig, check_config, get_config
from .device import device_name, ptx_math, sm_count
from .fused_moe import (ACT_GELU, ACT_GELU_TANH, ACT_RELU2, ACT_SILU, ACT_SWIGLUOAI, gemm1_gated_kernel,
                        gemm2_weighted_kernel, lora_shrink_kernel)
from .pdl import pdl_kwargs
from .quant import dequantize_mx, needs_amax_pass
from .topk_sum import topk_sum

G = Granularity
_A_SCALE = {None: 0, G.tensor: 1, G.token: 2, G.group128: 3, G.group32: 4}
_W_SCALE = {None: 0, G.tensor: 1, G.channel: 2, G.block128: 3, G.group32: 4}
ACTIVATION_CODE = {Activation.silu: ACT_SILU, Activation.gelu: ACT_GELU, Activation.gelu_tanh: ACT_GELU_TANH,
                   Activation.swigluoai: ACT_SWIGLUOAI, Activation.swigluoai_uninterleave: ACT_SWIGLUOAI,
                   Activation.silu_no_mul: ACT_SILU, Activation.gelu_no_mul: ACT_GELU,
                   Activation.relu2_no_mul: ACT_RELU2}
# K step of the LoRA shrink: its N is the rank, so the K loop is all its work and its latency at small M
# (H200, Qwen3-30B shapes, rank 16: 128 beat 64 by 6 us at M=1; 512 exceeds shared memory at BLOCK_M=128).
_SHRINK_BLOCK_K = 128
_GEMV_FRAGMENT_K, _GEMV_FRAGMENT_WARPS = 128, 4  # `fragment_tiles`


def _scheme_flags(weights: MoEWeights) -> dict:
    scheme = weights.scheme
    return dict(A_SCALE=_A_SCALE[scheme.act_granularity], W_SCALE=_W_SCALE[scheme.weight_granularity],
                UPCAST_W=scheme.weight_dtype is not None and scheme.act_dtype is None,
                W_FP4=_fp4_code(weights) if scheme.k_pack == 2 else 0,
                ACC_INT=scheme.act_torch_dtype == torch.int8)


def _fp4_code(weights: MoEWeights) -> int:
    """fused_moe.py's W_FP4 for MXFP4 weights: 1, or 2 with folded scales."""
    if not weights.fp4_fragment_order:
        raise KernelInputError("the Triton GEMMs read MXFP4 weights in fp4_fragments' order and these are in the "
                               "checkpoint's: call weights.use_fragment_order(interleaved=...) once first (the "
                               "build of a triton.fused_moe layer does)")
    return 1 + weights.fp4_scales_fold


def fragment_tiles(cfg: MoEConfig, scheme: Scheme) -> MoEConfig:
    """cfg as the GEMMs run it on MXFP4 weights, which are in fragment order (other schemes run cfg as it is; the
    tuner records what runs):

    - swapped (SWAP_AB): the layout is the A operand's; as the B operand the tiles tuned for checkpoint order ran
      2-3x slower on it (H200, bench/results/s28 b.);
    - weight tiles of whole slabs: BLOCK_N >= 16 (a paired GEMM1 tile's 2 * BLOCK_N rows are slabs of 32);
    - GEMV rows (BLOCK_M 1) on 4 warps with K steps of at least 128: other GEMV tiles computed wrong results on the
      H200 (4 warps at BLOCK_K 32/64 with GEMM1 BLOCK_N 16, bf16 on 1 warp at 128; right under the interpreter,
      cause not isolated: bench/fp4_gemv_probe.py, bench/results/s28 d.).
    """
    if scheme.k_pack != 2:
        return cfg
    gemv = cfg.BLOCK_M == 1

    def tile(g: GemmConfig) -> GemmConfig:
        return replace(g, BLOCK_N=max(g.BLOCK_N, fp4_fragments.SLAB), SWAP_AB=True,
                       BLOCK_K=max(g.BLOCK_K, _GEMV_FRAGMENT_K) if gemv else g.BLOCK_K,
                       num_warps=_GEMV_FRAGMENT_WARPS if gemv else g.num_warps)
    return replace(cfg, gemm1=tile(cfg.gemm1), gemm2=tile(cfg.gemm2))


def _gemm_input(a: torch.Tensor, a_scale: Optional[torch.Tensor], weights: MoEWeights,
                dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:
    """(the GEMM's input, its scale, its scheme flags). MXFP8 GEMMs read their input dequantised into dtype, once
    here, rather than once per column tile in their K loops (fused_moe.py)."""
    flags = _scheme_flags(weights)
    scheme = weights.scheme
    if scheme.is_mx and scheme.k_pack == 1:
        return dequantize_mx(a, a_scale, dtype), None, flags | dict(A_SCALE=0)
    return a, a_scale, flags


def _scale_strides(scale: Optional[torch.Tensor]) -> tuple[int, int]:
    """(per-expert or per-row stride, per-N-row stride) of a scale tensor in the layouts of quantize.py.

    Weight scales [E, N/128, K/128] (block) and [E, N, K/32] (MX) share the second form.
    """
    if scale is None or scale.dim() == 1:
        return 1, 0
    return scale.stride(0), (scale.stride(1) if scale.dim() == 3 else 1)


# TMA boxes: each dimension at most 256 elements, the innermost at least 16 bytes, rows 16-byte aligned.
_TMA_MAX_BOX, _TMA_ALIGN = 256, 16


def _weight_descriptors(weights: MoEWeights, g: GemmConfig, *, gemm: int, rows: int, halves: bool) -> dict:
    """w_desc, s_desc and W_TMA of a GEMM launch whose weight tiles hold `rows` rows: with g.TMA, TMA boxes of a view
    of the weights (fused_moe._tma_tile), GEMM1's gate and up halves as two planes (`halves`: [2E, I, ..]).
    Dense and MXFP8 weights [E, N, K]: boxes of rows. MXFP4 in fragment order: boxes of whole slabs x K/32 groups x
    their byte runs, and of the scales likewise (s_desc; fused_moe._fp4_tma_runs). A config that asks for TMA gets
    it, or KernelInputError."""
    if not g.TMA:
        return dict(w_desc=None, s_desc=None, W_TMA=0)
    w, scale = (weights.w13, weights.w13_scale) if gemm == 1 else (weights.w2, weights.w2_scale)
    planes = 2 if halves else 1
    E, N = w.shape[0] * planes, w.shape[1] // planes
    if not w.is_contiguous() or (scale is not None and not scale.is_contiguous()):
        raise KernelInputError(f"gemm{gemm}: the config asks for TMA weight copies, which read contiguous weights "
                               "and scales only; set \"TMA\": false in that config")
    if weights.scheme.k_pack == 2:
        pairs = gemm == 1 and weights.fp4_fragment_order == fp4_fragments.PAIRS
        slab, run = fp4_fragments.SLAB * (2 if pairs else 1), [2, 256] if pairs else [256]
        groups = w.shape[2] * 2 // MX_GROUP
        boxes = {"w_desc": (w.view(E, N // slab, groups, *run), [planes, rows // planes // slab, g.BLOCK_K // MX_GROUP,
                                                                  *run]),
                 "s_desc": (scale.view(E, N // slab, groups, slab), [planes, rows // planes // slab,
                                                                     g.BLOCK_K // MX_GROUP, slab])}
    else:
        # HALF_MMA copies each half of the tile (a plane of GEMM1's halves, or half of GEMM2's rows) as its own box
        boxes = {"w_desc": (w.view(E, N, w.shape[2]), [1 if g.HALF_MMA else planes, rows // planes, g.BLOCK_K])}
    descriptors = dict(s_desc=None, W_TMA=1 if halves else 2)
    for name, (view, box) in boxes.items():
        problem = _tma_problem(view, box)
        if problem:
            raise KernelInputError(f"gemm{gemm}: the config asks for TMA weight copies, which cannot read these "
                                   f"weights ({problem}); set \"TMA\": false in that config")
        descriptors[name] = TensorDescriptor.from_tensor(view, box)
    return descriptors


def _tma_problem(view: torch.Tensor, box: list[int]) -> Optional[str]:
    """Why the copy engine cannot read boxes `box` of a view of contiguous weights, or None."""
    size = view.element_size()
    if view.data_ptr() % _TMA_ALIGN or (view.shape[-1] * size) % _TMA_ALIGN:
        return f"rows of {view.shape[-1]} x {size} bytes, {_TMA_ALIGN}-byte aligned, are needed"
    if max(box) > _TMA_MAX_BOX or box[-1] * size < _TMA_ALIGN:
        return f"box {box}: each dimension at most {_TMA_MAX_BOX}, the innermost at least {_TMA_ALIGN} bytes"
    return None


@contextlib.contextmanager
def _register_cap_honoured(g: GemmConfig, *, gemm: int) -> Iterator[None]:
    """A config's MAXNREG too low for its tile stops ptxas (it names the registers it needs): raised as a
    KernelInputError naming the GEMM, the cap and the fix, not as Triton's compile error."""
    try:
        yield
    except PTXASError as exc:
        if g.MAXNREG is None:
            raise
        needed = re.search(r"register target of (\d+)", str(exc))
        need = f"ptxas needs at least {needed.group(1)}" if needed else "ptxas cannot compile the tile under it"
        raise KernelInputError(f"gemm{gemm}: MAXNREG={g.MAXNREG} is too few registers for this tile ({need}); raise "
                               "the cap or remove it from the tuned config") from None


def _weight_blocks(weights: MoEWeights, g: GemmConfig, *, gemm: int, interleaved: bool) -> int:
    """fused_moe's W_BLOCKS of a GEMM launch: under 128x128 block scaling, 1 where each tile's weight rows lie in one
    block of 128 rows (tiles start at multiples of their power-of-two row count, so any count up to 128), 2 where
    each half of a GEMM1 tile (gate rows, up rows I further) does, else 0: a scale per row. DeepSeek-V3 FP8 block-128
    on the H200 at M=4096 / 16384: GEMM1 1.16x / 1.13x, GEMM2 1.18x / 1.22x; level at M <= 256 (bench/results/s40)."""
    if weights.scheme.weight_granularity != G.block128:
        return 0
    pairs = gemm == 1 and weights.gated and interleaved
    if g.BLOCK_N * (2 if pairs else 1) > QUANT_BLOCK:
        return 0
    if gemm == 2 or not weights.gated or pairs:
        return 1
    return 2 if weights.intermediate % g.BLOCK_N == 0 else 0


def _gemm1_weight_blocks(weights: MoEWeights, g: GemmConfig, *, interleaved: bool) -> int:
    """GEMM1's W_BLOCKS (`_weight_blocks`); a HALF_MMA config needs 2 (the gate rows and the up rows of each tile in
    one block of 128 rows each), else KernelInputError."""
    blocks = _weight_blocks(weights, g, gemm=1, interleaved=interleaved)
    if g.HALF_MMA and blocks != 2:
        raise KernelInputError(f"gemm1: HALF_MMA needs the gate and up rows of each tile in one block of 128 rows "
                               f"each (gated weights as halves, BLOCK_N={g.BLOCK_N} at most {QUANT_BLOCK} and "
                               f"dividing I={weights.intermediate}); remove HALF_MMA from gemm1 or change BLOCK_N")
    return blocks


def _row_tiles(align: Alignment) -> dict:
    """The GEMM kernels' row tiles, as the alignment made them: BLOCK_M rows, and tail tiles of TAIL_M rows from the
    tile table (align.py) where it has one."""
    return dict(BLOCK_M=align.block_m, TAIL_M=align.tail_m, tiles_ptr=align.tiles)


def _gemm2_row_tiles(align: Alignment, cfg: MoEConfig) -> dict:
    """GEMM2's row tiles: the alignment's (`_row_tiles`), or with cfg.GEMM2_BLOCK_M each of its BLOCK_M tiles split
    into SPLIT tiles of that many rows (a tail tile runs whole); num_m_blocks counts them."""
    if not cfg.GEMM2_BLOCK_M:
        return dict(**_row_tiles(align), num_m_blocks=align.num_tiles)
    if align.naive:
        raise KernelInputError("gemm2: GEMM2_BLOCK_M splits the blocks of the sorted assignment, and this batch takes "
                               "the naive one (one slot per block, 4 * slots <= experts): give it a config without "
                               "GEMM2_BLOCK_M")
    split = align.block_m // cfg.GEMM2_BLOCK_M
    return _row_tiles(align) | dict(BLOCK_M=cfg.GEMM2_BLOCK_M, num_m_blocks=align.num_tiles * split, SPLIT=split)


def _programs(g: GemmConfig, align: Alignment, *, tiles: int, device: torch.device, gemm: int) -> int:
    """The grid of a GEMM launch of at most `tiles` tiles: one program per tile, or with g.PERSISTENT that many per SM
    (no more than the tiles), each looping over tiles (fused_moe's PERSISTENT)."""
    if not g.PERSISTENT:
        return tiles
    if align.naive:
        raise KernelInputError(f"gemm{gemm}: PERSISTENT runs the blocks of the sorted assignment, and this batch takes "
                               "the naive one (one slot per block, 4 * slots <= experts): give it a config without "
                               "PERSISTENT")
    return min(tiles, g.PERSISTENT * sm_count(device))


def _launch_kwargs(g: GemmConfig) -> dict:
    return dict(BLOCK_N=g.BLOCK_N, BLOCK_K=g.BLOCK_K, GROUP_M=g.GROUP_M, SWAP_AB=g.SWAP_AB, num_warps=g.num_warps,
                num_stages=g.num_stages, **({"maxnreg": g.MAXNREG} if g.MAXNREG is not None else {}))


def _lora_shrink(a: torch.Tensor, lora_a: torch.Tensor, *, scaling: float, slots_per_row: int, num_slots: int,
                 align, rank_pad: int) -> torch.Tensor:
    """[num_slots, rank_pad] = scaling * a[slot // slots_per_row] . lora_a[expert of slot]^T, in a's dtype."""
    out = torch.empty(num_slots, rank_pad, dtype=a.dtype, device=a.device)
    lora_shrink_kernel[(align.num_blocks,)](
        a, lora_a, out, *align.kernel_args(),
        num_slots, lora_a.shape[0], a.shape[1], lora_a.shape[1], slots_per_row, scaling,
        a.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        LORA_R=rank_pad, BLOCK_M=align.block_rows, BLOCK_K=_SHRINK_BLOCK_K, NAIVE=align.naive)
    return out


def _no_lora(dummy: torch.Tensor) -> dict:
    return dict(lora_shrink_ptr=dummy, lora_b_ptr=dummy, lora_rank=0, stride_lsm=0, stride_lbe=0, stride_lbn=0,
                HAS_LORA=False, LORA_R=16)


def _lora_epilogue_kwargs(a: torch.Tensor, lora: Optional[LoRAWeights], *, gemm: int, slots_per_row: int,
                          num_slots: int, align, dummy: torch.Tensor) -> dict:
    """LoRA keyword arguments of GEMM `gemm` (1 or 2); with adapters, first runs the shrink on its input `a`.

    The rank is padded to a power of two >= 16 for tl.dot; the kernels read the adapters masked,
    so no zero-padded copy is made. By keyword: these follow the constexprs in the signatures.
    """
    if lora is None:
        return _no_lora(dummy)
    rank_pad = max(16, triton.next_power_of_2(lora.rank))
    lora_a, lora_b = (lora.w13_lora_a, lora.w13_lora_b) if gemm == 1 else (lora.w2_lora_a, lora.w2_lora_b)
    lora_b = lora_b.contiguous()
    shrunk = _lora_shrink(a, lora_a.contiguous(), scaling=lora.scaling, slots_per_row=slots_per_row,
                          num_slots=num_slots, align=align, rank_pad=rank_pad)
    return dict(lora_shrink_ptr=shrunk, lora_b_ptr=lora_b, lora_rank=lora.rank, stride_lsm=shrunk.stride(0),
                stride_lbe=lora_b.stride(0), stride_lbn=lora_b.stride(1), HAS_LORA=True, LORA_R=rank_pad)


def fused_moe(x_q: torch.Tensor, *, a_scale: Optional[torch.Tensor], weights: MoEWeights, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, activation: Activation,
              quantize_intermediate: Callable[[torch.Tensor, Optional[torch.Tensor]],
                                              tuple[torch.Tensor, Optional[torch.Tensor]]],
              out_dtype: torch.dtype, config: Optional[MoEConfig] = None,
              remote_slots: bool = False, swiglu: SwigluParams = SwigluParams()) -> torch.Tensor:
    """x_q [T, H] (quantised per weights.scheme, with a_scale) -> [T, H] in out_dtype.

    `quantize_intermediate(inter, amaxes)` quantises GEMM1's output for GEMM2 (identity unless W8A8 or MXFP8), with
    `amaxes` the partial amaxes GEMM1 computed of it, or None (see `gemm1`).
    `config` overrides the file/heuristic lookup (the tuner uses it).
    `remote_slots`: topk_ids may hold -1 (expert on another rank under EP). moe_align drops
    those slots, so the kernels never write their rows; the buffers then start zeroed so the
    rows are neutral for the intermediate's scales and the top-k sum. Off EP they stay empty.
    `weights.lora`, when set, adds its deltas; x_q is then unquantised (build refuses LoRA otherwise).
    """
    alloc = torch.zeros if remote_slots else torch.empty
    # The kernels step through rows by stride(0) and read each row, and the router weights, as contiguous:
    # a strided view (a transposed x, a column slice) would be read wrongly, so it is copied (no-op otherwise).
    x_q, topk_weights = x_q.contiguous(), topk_weights.contiguous()
    if a_scale is not None:
        a_scale = a_scale.contiguous()
    T, k = topk_ids.shape
    E, H, I = weights.num_experts, weights.hidden, weights.intermediate
    if T == 0:
        return torch.empty(0, H, dtype=out_dtype, device=x_q.device)
    if config is not None:  # a config handed in skips the lookup's check; a bad one must fail here, not on the GPU
        check_config(config, weights.scheme)
    cfg = config or config_for(weights, num_tokens=T, top_k=k, device=x_q.device)
    align = moe_align(topk_ids, num_experts=E, block_m=cfg.BLOCK_M, tail_m=cfg.TAIL_M)
    if cfg.CHAIN:
        return chained_moe(x_q, weights=weights, align=align, cfg=cfg, activation=activation,
                           topk_weights=topk_weights, top_k=k, out_dtype=out_dtype, alloc=alloc, swiglu=swiglu)
    lora1 = _lora_epilogue_kwargs(x_q, weights.lora, gemm=1, slots_per_row=k, num_slots=T * k, align=align,
                                  dummy=weights.w13)
    cfg = sorted_intermediate_in_use(cfg, align, weights)
    inter = intermediate_buffer(weights, align, cfg, num_slots=T * k, dtype=out_dtype, alloc=alloc)
    amaxes = gemm1(x_q, a_scale, weights=weights, align=align, cfg=cfg, activation=activation, out=inter, top_k=k,
                   swiglu=swiglu, lora=lora1)
    # LoRA's GEMM2 shrink reads the intermediate as GEMM1 wrote it, before any re-quantisation.
    lora2 = _lora_epilogue_kwargs(inter, weights.lora, gemm=2, slots_per_row=1, num_slots=T * k, align=align,
                                  dummy=weights.w13)
    inter_q, inter_scale = quantize_intermediate(inter, amaxes)
    out = alloc(T * k, H, dtype=out_dtype, device=x_q.device)
    gemm2(inter_q, inter_scale, weights=weights, topk_weights=topk_weights, align=align, cfg=cfg, out=out,
          lora=lora2)
    return topk_sum(out, k) if k > 1 else out


def sorted_intermediate_in_use(cfg: MoEConfig, align: Alignment, weights: MoEWeights) -> MoEConfig:
    """cfg, without SORTED_INTER where this batch cannot lay the intermediate out by aligned row: under the naive
    assignment (no sorted order; the lookup gives such batches no sorted entry, `config._entries_for`) or with LoRA,
    whose shrink reads the intermediate by slot. The layout changes no value, only where GEMM1 stores them."""
    return replace(cfg, SORTED_INTER=False) if align.naive or weights.lora is not None else cfg


def intermediate_buffer(weights: MoEWeights, align: Alignment, cfg: MoEConfig, *, num_slots: int,
                        dtype: torch.dtype, alloc: Callable = torch.empty) -> torch.Tensor:
    """GEMM1's output: a row per slot, or with SORTED_INTER a row per aligned row (a row of sorted_ids; the blocks past
    the last real one are never written). A quantiser that takes its own amax of it (no partial amaxes
    from GEMM1, no static scale) reads every row, so the unwritten ones then start zeroed."""
    rows = _intermediate_rows(align, cfg, num_slots=num_slots)
    own_amax = (cfg.SORTED_INTER and weights.scheme.quantizes_activations and weights.a2_scale is None
                and not _epilogue_amax(weights, rows * weights.intermediate))
    return (torch.zeros if own_amax else alloc)(rows, weights.intermediate, dtype=dtype, device=weights.w13.device)


def _intermediate_rows(align: Alignment, cfg: MoEConfig, *, num_slots: int) -> int:
    return align.num_blocks * align.block_rows if cfg.SORTED_INTER else num_slots


def chained_moe(x_q: torch.Tensor, *, weights: MoEWeights, align: Alignment, cfg: MoEConfig, activation: Activation,
                topk_weights: torch.Tensor, top_k: int, out_dtype: torch.dtype, alloc: Callable,
                swiglu: SwigluParams) -> torch.Tensor:
    """`fused_moe` as one launch (chain.py) for a chained config: x_q [T, H] unquantised activations, topk_weights
    contiguous; `alloc` makes the slot rows (zeroed under EP, where remote slots leave theirs unwritten)."""
    _check_chained_batch(weights, align, slots=x_q.shape[0] * top_k)
    cfg = fragment_tiles(cfg, weights.scheme)
    g1, g2 = cfg.gemm1, cfg.gemm2
    E, H, I = weights.num_experts, weights.hidden, weights.intermediate
    T, slots = x_q.shape[0], align.num_blocks
    inter = alloc(slots, I, dtype=out_dtype, device=x_q.device)
    slot_rows = alloc(slots, H, dtype=out_dtype, device=x_q.device)
    out = torch.empty(T, H, dtype=out_dtype, device=x_q.device)
    interleaved = is_interleaved(activation)
    dummy = weights.w13
    b13, b2 = (weights.w13_bias, weights.w2_bias) if weights.has_bias else (dummy, dummy)
    s13, s2 = weights.w13_scale, weights.w2_scale
    column_blocks = triton.cdiv(H, g2.BLOCK_N)
    sync = chain_sync_buffer(x_q.device, chain.SLOT_DONE.value + slots + T * column_blocks)
    flags = _scheme_flags(weights)

    def stages(g: GemmConfig) -> Optional[int]:  # each MMA loop its own depth; GEMV rows the launch's (gemm1_tile)
        return None if cfg.BLOCK_M == 1 else g.num_stages
    chain.chained_moe_kernel[(slots * (triton.cdiv(I, g1.BLOCK_N) + column_blocks),)](
        x_q, weights.w13, s13 if s13 is not None else dummy, b13, inter, weights.w2, s2 if s2 is not None else dummy,
        b2, topk_weights, slot_rows, out, align.expert_ids, sync, dummy,
        slots, E, H, I, 2 if interleaved else 1, 1 if interleaved else I, swiglu.limit, swiglu.alpha,
        x_q.stride(0), weights.w13.stride(0), weights.w13.stride(1), *_scale_strides(s13), b13.stride(0),
        weights.w2.stride(0), weights.w2.stride(1), *_scale_strides(s2), b2.stride(0),
        W_SCALE=flags["W_SCALE"], UPCAST_W=flags["UPCAST_W"], W_FP4=flags["W_FP4"], HAS_BIAS=weights.has_bias,
        ACTIVATION=ACTIVATION_CODE[activation], GATED=weights.gated,
        PAIRED=weights.fp4_fragment_order == fp4_fragments.PAIRS, TOP_K=top_k, BLOCK_M=cfg.BLOCK_M,
        BLOCK_N1=g1.BLOCK_N, BLOCK_K1=g1.BLOCK_K, SWAP_AB1=g1.SWAP_AB, STAGES1=stages(g1),
        BLOCK_N2=g2.BLOCK_N, BLOCK_K2=g2.BLOCK_K, SWAP_AB2=g2.SWAP_AB, STAGES2=stages(g2),
        num_warps=g1.num_warps, **({"maxnreg": g1.MAXNREG} if g1.MAXNREG is not None else {}),
        **ptx_math(x_q.device), **pdl_kwargs(x_q.device))
    return out


def _check_chained_batch(weights: MoEWeights, align: Alignment, *, slots: int) -> None:
    """What a chained launch needs of the batch, beyond its config (config._check_chain)."""
    if not align.naive or weights.lora is not None:
        raise KernelInputError(f"CHAIN runs decode batches under the naive assignment (4 * slots <= experts) and "
                               f"without LoRA; this one has {slots} slots for {weights.num_experts} experts"
                               f"{' and LoRA adapters' if weights.lora is not None else ''}: give it a config without "
                               "CHAIN")


# One zeroed int32 counter buffer per (device, stream): each chained launch leaves it zeroed, so launches in one
# stream, which run one after another, can share it, and no launch pays for a memset. A buffer outgrown is kept
# alive: CUDA graphs captured with it still use it.
_CHAIN_SYNC: dict[tuple, list[torch.Tensor]] = {}
_CHAIN_SYNC_MIN = 1 << 12


def chain_sync_buffer(device: torch.device, size: int) -> torch.Tensor:
    """At least `size` zeroed counters for a chained launch on the current stream of `device`."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buffers = _CHAIN_SYNC.setdefault((device, stream), [])
    if not buffers or buffers[-1].numel() < size:
        buffers.append(torch.zeros(max(size, _CHAIN_SYNC_MIN), dtype=torch.int32, device=device))
    return buffers[-1]


def config_lookup(weights: MoEWeights, *, num_tokens: int, top_k: int, device: torch.device) -> dict:
    """`get_config`'s keyword arguments for this launch."""
    return dict(num_tokens=num_tokens, num_experts=weights.num_experts, intermediate=weights.intermediate,
                top_k=top_k, scheme=weights.scheme, in_dtype_name=weights.in_dtype.value,
                device_name=device_name(device))


def config_for(weights: MoEWeights, *, num_tokens: int, top_k: int, device: torch.device) -> MoEConfig:
    """The config `fused_moe` runs with when given none: the tuned file's nearest M, else the heuristic."""
    return get_config(**config_lookup(weights, num_tokens=num_tokens, top_k=top_k, device=device))


def gemm1(x_q: torch.Tensor, a_scale: Optional[torch.Tensor], *, weights: MoEWeights, align: Alignment,
          cfg: MoEConfig, activation: Activation, out: torch.Tensor, top_k: int, swiglu: SwigluParams = SwigluParams(),
          lora: Optional[dict] = None) -> Optional[torch.Tensor]:
    """One launch: act(x_q . w13[e]^T + bias) of every aligned slot into out [slots, I].

    x_q [T, H] contiguous, slot s reads row s // top_k; `lora`: the GEMM1 epilogue keyword
    arguments of `_lora_epilogue_kwargs` (None: no adapters).
    Returns one finite amax per program of the values it stored when GEMM2's input is quantised dynamically per
    tensor and out is large enough for that quantisation to need an amax pass (`_epilogue_amax`; the quantiser
    then reduces these, quant.scale_of_partials, instead of reading out twice). Else None.
    """
    dummy = weights.w13
    bias = weights.w13_bias if weights.has_bias else dummy
    s_e, s_n = _scale_strides(weights.w13_scale)
    cfg = fragment_tiles(cfg, weights.scheme)
    I, H = weights.intermediate, weights.hidden
    interleaved = is_interleaved(activation)
    g = cfg.gemm1
    _check_intermediate_rows(out, align, cfg, num_slots=x_q.shape[0] * top_k, gemm=1)
    x_q, a_scale, flags = _gemm_input(x_q, a_scale, weights, out.dtype)
    programs = _programs(g, align, tiles=align.num_tiles * triton.cdiv(I, g.BLOCK_N), device=out.device, gemm=1)
    amax = (torch.empty(programs, dtype=torch.float32, device=out.device)
            if _epilogue_amax(weights, out.numel()) else None)
    with _register_cap_honoured(g, gemm=1):
        gemm1_gated_kernel[(programs,)](
            x_q, a_scale if a_scale is not None else dummy, weights.w13,
            weights.w13_scale if weights.w13_scale is not None else dummy, bias, out,
            *align.kernel_args(), x_q.shape[0] * top_k, weights.num_experts, align.num_tiles, I, H, top_k,
            2 if interleaved else 1, 1 if interleaved else I,
            x_q.stride(0), a_scale.stride(0) if a_scale is not None and a_scale.dim() == 2 else 1,
            weights.w13.stride(0), weights.w13.stride(1), s_e, s_n, bias.stride(0), out.stride(0),
            HAS_BIAS=weights.has_bias, ACTIVATION=ACTIVATION_CODE[activation], **_row_tiles(align),
            **flags, **_launch_kwargs(g), GATED=weights.gated,
            PAIRED=weights.fp4_fragment_order == fp4_fragments.PAIRS, **(lora or _no_lora(dummy)),
            swiglu_limit=swiglu.limit, swiglu_alpha=swiglu.alpha, amax_ptr=amax if amax is not None else dummy,
            AMAX=amax is not None, AMAX_MASK=amax is not None and _amax_mask(weights, g.BLOCK_N), NAIVE=align.naive,
            **pdl_kwargs(out.device), **ptx_math(out.device), EIGHT_BIT_OUT=weights.scheme.quantizes_activations,
            **_weight_descriptors(weights, g, gemm=1, rows=g.BLOCK_N * (2 if weights.gated else 1),
                                  halves=weights.gated and not interleaved),
            W_BLOCKS=_gemm1_weight_blocks(weights, g, interleaved=interleaved), SORTED_OUT=cfg.SORTED_INTER,
            HALF_MMA=g.HALF_MMA, PERSISTENT=bool(g.PERSISTENT))
    return amax


def _check_intermediate_rows(inter: torch.Tensor, align: Alignment, cfg: MoEConfig, *, num_slots: int,
                             gemm: int) -> None:
    """The intermediate a GEMM writes or reads has the rows `intermediate_buffer` gives this config: a buffer of the
    other layout would be written past its end or read at the wrong rows."""
    rows = _intermediate_rows(align, cfg, num_slots=num_slots)
    if inter.shape[0] != rows:
        layout = "one per aligned row (SORTED_INTER)" if cfg.SORTED_INTER else "one per slot"
        raise KernelInputError(f"gemm{gemm}: the intermediate has {inter.shape[0]} rows, and this config lays it out "
                               f"in {rows}, {layout}; allocate it with launch.intermediate_buffer")


def _sorted_input(inter_q: torch.Tensor, cfg: MoEConfig) -> dict:
    """A_SORTED and a_desc of a GEMM2 launch (fused_moe.gemm2_tile): with SORTED_INTER its A tiles are boxes of the
    intermediate's rows, TMA copies of GEMM2's tile rows with gemm2.TMA (tail tiles by address)."""
    if not cfg.SORTED_INTER:
        return dict(A_SORTED=0, a_desc=None)
    if not cfg.gemm2.TMA:
        return dict(A_SORTED=1, a_desc=None)
    box = [cfg.gemm2_block_m, cfg.gemm2.BLOCK_K]
    problem = _tma_problem(inter_q, box)
    if problem:
        raise KernelInputError(f"gemm2: the config asks for TMA copies of the sorted intermediate, which cannot read "
                               f"it ({problem}); set \"TMA\": false in gemm2")
    return dict(A_SORTED=2, a_desc=TensorDescriptor.from_tensor(inter_q, box))


def _epilogue_amax(weights: MoEWeights, inter_numel: int) -> bool:
    """Whether GEMM1 computes the amax of its output: GEMM2's input is quantised dynamically per tensor, and the
    intermediate is larger than one quantiser program reads in one pass."""
    scheme = weights.scheme
    return (scheme.quantizes_activations and scheme.act_granularity == G.tensor
            and weights.a2_scale is None and needs_amax_pass(inter_numel))


def _amax_mask(weights: MoEWeights, block_n: int) -> bool:
    """Whether GEMM1's amax must mask its tiles (fused_moe._stored_amax): a bias lifts the padding rows above zero,
    or the last column tile runs past I (its columns past I read weight row 0)."""
    return weights.has_bias or weights.intermediate % block_n != 0


def gemm2(inter_q: torch.Tensor, inter_scale: Optional[torch.Tensor], *, weights: MoEWeights,
          topk_weights: torch.Tensor, align: Alignment, cfg: MoEConfig, out: torch.Tensor,
          lora: Optional[dict] = None) -> None:
    """One launch: topk_weight * (inter_q . w2[e]^T + bias) of every aligned slot into out [slots, H].

    topk_weights contiguous; `lora` as in `gemm1`, for GEMM2.
    """
    dummy = weights.w13
    bias = weights.w2_bias if weights.has_bias else dummy
    s_e, s_n = _scale_strides(weights.w2_scale)
    cfg = fragment_tiles(cfg, weights.scheme)
    H, I = weights.hidden, weights.intermediate
    g = cfg.gemm2
    _check_intermediate_rows(inter_q, align, cfg, num_slots=out.shape[0], gemm=2)
    inter_q, inter_scale, flags = _gemm_input(inter_q, inter_scale, weights, out.dtype)
    rows = _gemm2_row_tiles(align, cfg)
    programs = _programs(g, align, tiles=rows["num_m_blocks"] * triton.cdiv(H, g.BLOCK_N), device=out.device, gemm=2)
    with _register_cap_honoured(g, gemm=2):
        gemm2_weighted_kernel[(programs,)](
            inter_q, inter_scale if inter_scale is not None else dummy, weights.w2,
            weights.w2_scale if weights.w2_scale is not None else dummy, bias, topk_weights, out,
            *align.kernel_args(), out.shape[0], weights.num_experts, N=H, K=I,
            stride_am=inter_q.stride(0),
            stride_asm=inter_scale.stride(0) if inter_scale is not None and inter_scale.dim() == 2 else 1,
            stride_we=weights.w2.stride(0), stride_wn=weights.w2.stride(1), stride_wse=s_e, stride_wsn=s_n,
            stride_be=bias.stride(0), stride_om=out.stride(0), HAS_BIAS=weights.has_bias, **rows, **flags,
            **_launch_kwargs(g),
            **(lora or _no_lora(dummy)), NAIVE=align.naive, **pdl_kwargs(out.device),
            **_weight_descriptors(weights, g, gemm=2, rows=g.BLOCK_N // (2 if g.HALF_MMA else 1), halves=False),
            W_BLOCKS=_weight_blocks(weights, g, gemm=2, interleaved=False), **_sorted_input(inter_q, cfg),
            HALF_MMA=g.HALF_MMA, PERSISTENT=bool(g.PERSISTENT))
