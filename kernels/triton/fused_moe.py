"""Triton kernels of the fused MoE: GEMM1 with the activation fused, GEMM2 with the router weight.

Both GEMMs read the token rows of one BLOCK_M tile of `sorted_ids` (see align.py), all of
one expert, and multiply them with that expert's weights [N, K] (K contiguous). With tail tiles (TAIL_M) an
expert's last rows may take a tile of TAIL_M rows instead, in the same launch (align.py).

GEMM1 multiplies one weight tile holding the gate rows and the up rows of the same BLOCK_N output
columns, one MMA per K step, splits the accumulator after the K loop and writes act(gate) * up: the
[M*k, 2I] pre-activation never reaches memory. Gate/up row pairs are (n, I + n) for the halves layout
and (2n, 2n + 1) when interleaved (gpt-oss). With GATED False (the `*_no_mul` activations, w13 has I
rows) the tile holds BLOCK_N rows and it writes act(h).

Each GEMM's work for one tile is a function (`gemm1_tile`, `gemm2_tile`), run one program per tile by its kernel
here and by the chained decode kernel (chain.py).

SWAP_AB (a config field): the weight tile is the MMA's M side and the tokens its N side (`_dot`).

TMA (a config field, W_TMA here; sm_90+, MMA tiles): each weight tile is one TMA copy of a box of a view of the
weights (`_tma_tile`; MXFP4's slabs and scales, `_fp4_tma_runs`; launch._weight_descriptors) instead of address
loads: the copy engine fills rows and K past the bounds with zeros, and Triton's pipeliner stages the tile in shared
memory (feeding wgmma from there for 8/16-bit weights). The token rows stay address loads (a gather by sorted slot,
which Hopper's TMA cannot do). Measured per GEMM with the tuned tiles (H200, GEMMs alone, 3 alternating rounds;
bench/results/s32): bf16/FP8 GEMM2 1.02-1.06x faster at M = 4096 for every model and scheme, 0.98-1.07x at 16384;
GEMM1 0.92-1.06x there; both 0.97-1.07x at M = 256-1024. MXFP8 1.03-1.20x at M = 16-4096 (its K loop dequantises
the weight tile from registers and was issue-bound). MXFP4 0.63-1.01x: the fragment-order runs then pass a fence
and two more barriers per K step on their way from shared memory to registers (bench/sass_count.py --tma). So the
tuned files choose it per GEMM and M (bench/tma_probe.py --gemms --install).

LoRA (HAS_LORA): `lora_shrink_kernel` first writes scaling * x . A[e]^T per slot ([slots, LORA_R],
in the activation dtype); the GEMM epilogues add that tile times B[e][rows]^T to each
accumulator before the activation (GEMM1) or the router weight (GEMM2). LORA_R is the rank
rounded up to a power of two >= 16 (tl.dot's smallest K); ranks past the real one load as zero,
so the adapters need no padded copy.

Scale codes (tl.constexpr):
  A_SCALE: 0 none, 1 per tensor [1], 2 per row [rows], 3 per 1x128 group [rows, K/128] (MX activations arrive
           dequantised, with 0: see MXFP8 below)
  W_SCALE: 0 none, 1 per expert [E], 2 per channel [E, N], 3 per 128x128 block [E, N/128, K/128],
           4 MX: e8m0 (uint8) per 1x32 group [E, N, K/32]
  W_FP4:   0 no; 1 the weights are packed e2m1 pairs in the MMA fragment order of fp4_fragments.py (what our
           Triton experts build from the checkpoint's [E, N, K/2]), MXFP4; 2 the same with every e8m0 scale at
           most mx.E8M0_FOLD_MAX (`MoEWeights.fp4_scales_fold`): the bf16 decode then folds its fixed 2^126 into
           the scale.
Per-tensor/row/channel scales factor out of the K sum and are applied once in the epilogue;
block and group scales change along K, so each K step's product is promoted (scaled into the accumulator) by itself,
one MMA for the tile or, with HALF_MMA, one per half of its weight rows (`_k_loop_halves`: H100, DeepSeek-V3 FP8
block-128 M=16384, 128 x 256 tiles that way ran GEMM1 1.23x and GEMM2 1.05x faster than the tuned single-MMA tiles,
64 rows deep; bench/results/s47). W8A16 (A_SCALE 0 with quantised weights) upcasts the weight
tile to the activation dtype in the loop. Dequantisation always happens per K step, in registers;
whole weights are never expanded in memory. Hopper has no MX (or mixed-input) MMA, so MX is software:
  - MXFP4: the packed tile, in fragment order, is unpacked and scaled (exactly: the scales are powers of two)
    into the activation dtype straight into the registers of one MMA per K step whose A operand it is: the
    weights on wgmma's (or mma.sync's) M side, the tokens on its N side (`_fp4_fragment_tile`; the host swaps
    every MXFP4 tile, `launch.fragment_tiles`). At 0.53 bytes per weight the decode instructions could bound
    this kernel (on H200, 4 TB/s of fp4 is ~8e12 weights/s, i.e. about 4 instructions per weight for the whole
    GPU), so bf16 decodes four bytes at a time in PTX on packed registers (_E2M1X4_TO_BF16); fp16 and the
    interpreter use Triton code. On sm_90 the K loop of triton_kernels' tile shape issues 3.7-4.0 instructions
    per weight up to 64 tokens per block, 4.5-4.6 at 128 (255 registers; triton_kernels 3.6-3.8 at every size,
    on 8 warps); the checkpoint's order, read byte by byte with the decoded tile shuffled or stored for the MMA,
    took 4.7-5.8 (bench/results/s27-s29). `tl.dot_scaled`, whose Hopper lowering upcasts
    in the compiler, measured no faster than the Triton-code decode on the checkpoint order (H200, Triton 3.6)
    and has no interpreter implementation. The configs use large BLOCK_M to decode each weight once.
  - MXFP8: the GEMMs read their input dequantised once by the host (quant.dequantize_mx: the MX values in the
    output dtype, exact; A_SCALE 0) and dequantise the weight tile in registers (`_mx8_weights`), one 16-bit MMA
    per K step of any multiple of 32: the same products as an fp8 MMA per 32-group scaled by sa*sw, which ran
    1.06-2.07x slower (one MMA wait per 32 of K; H200, both gpt-oss at M = 1..4096, bench/results/s30) and is
    gone, as is dequantising the activations in the K loop (once per column tile: 0.61-0.97x of that). Triton's
    e4m3 -> bf16 conversion is 2.5 SASS per value (F2FP to f16x2, F2F per value); `tl.dot_scaled` (the upcast in
    the compiler) had measured 1.0-2x slower than the fp8 MMA per group on the H200.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import mx, scheme
from .pdl import let_next_kernel_launch, wait_for_previous_kernel
from .quant import FP32_MAX, _e8m0, _finite_abs

# Activation codes shared with launch.py (the device functions below test the literals).
ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_SWIGLUOAI, ACT_RELU2 = 0, 1, 2, 3, 4
# The scale layouts of quantize.py, as the constexprs jit code needs.
SCALE_BLOCK = tl.constexpr(scheme.QUANT_BLOCK)
MX_GROUP = tl.constexpr(mx.MX_GROUP)


@triton.jit
def _tile_coords(pid, num_m_blocks, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program pid in grouped ("swizzled") order: GROUP_M row blocks share each column
    sweep, for L2 reuse."""
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _past_end(num_post_ptr, pid_m, BLOCK_M: tl.constexpr, NAIVE: tl.constexpr):
    """Whether block pid_m lies past the aligned rows (never under the naive assignment: each block is a slot)."""
    if NAIVE:
        past = False
    else:
        past = pid_m * BLOCK_M >= tl.load(num_post_ptr)
    return past


@triton.jit
def _row_tile(tiles_ptr, num_post_ptr, pid_m, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, NAIVE: tl.constexpr):
    """(its first block, whether it is a tail tile of TAIL_M rows, whether it lies past the aligned rows) of row
    tile pid_m: with tail tiles (TAIL_M, align.py), from the tile table; else block pid_m, BLOCK_M rows."""
    if TAIL_M:
        code = tl.load(tiles_ptr + pid_m)
        return code // 2, code % 2 == 1, code < 0
    else:
        return pid_m, False, _past_end(num_post_ptr, pid_m, BLOCK_M, NAIVE)


@triton.jit
def _block_rows(sorted_ids_ptr, expert_ids_ptr, pid_m, num_slots, num_experts, BLOCK_M: tl.constexpr,
                NAIVE: tl.constexpr, ROW_UNIT: tl.constexpr = 0, SPLIT: tl.constexpr = 1):
    """(slot of each row of the BLOCK_M rows from block pid_m, which rows are real (not padding), the block's expert).
    ROW_UNIT: the rows of a block (0: BLOCK_M; with tail tiles the tail's rows, align.py). SPLIT: tiles per entry of
    expert_ids (GEMM2's own row tiles, MoEConfig.GEMM2_BLOCK_M: the alignment's blocks are SPLIT * BLOCK_M rows).

    NAIVE (align.py): block pid_m is slot pid_m alone, in its row 0, and expert_ids_ptr the flattened top-k ids; an
    id outside [0, E) (-1: an expert of another rank) leaves the block no real row and reads expert 0's weights.
    """
    e = tl.load(expert_ids_ptr + pid_m // SPLIT).to(tl.int64)
    if NAIVE:
        r = tl.arange(0, BLOCK_M)
        routed = (e >= 0) & (e < num_experts)
        slot = tl.where(r == 0, pid_m, num_slots).to(tl.int64)
        row_ok = (r == 0) & routed
        e = tl.where(routed, e, 0)
    else:
        first_row = pid_m * (ROW_UNIT if ROW_UNIT else BLOCK_M)
        slot = tl.load(sorted_ids_ptr + first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = slot < num_slots
    return slot, row_ok, e


@triton.jit
def _real_rows(rows, row_ok):
    """Weight rows a K loop reads: rows past N read row 0 instead (their products are never stored), so each
    thread's copies share one K mask per step rather than one mask per row (sm_90: up to 3 instructions fewer per
    16-byte copy; N is mostly a multiple of BLOCK_N, so row 0 is seldom read twice).

    Not for the token rows: padding rows that read a real row (row 0, or the block's first) instead of being
    masked made the GEMMs up to 1.5x slower on the H200 (DeepSeek-V3 M=1024, half of each 64-row block padding:
    the zero-filled copies move no data; bench/results/s29 f., g.), though the K loops issued 10-27% fewer
    instructions."""
    return tl.where(row_ok, rows, 0)


@triton.jit
def _sorted_first_row(pid_m, BLOCK_M: tl.constexpr, ROW_UNIT: tl.constexpr):
    """The first row of the tile from block pid_m in an intermediate laid out by aligned row (MoEConfig.SORTED_INTER):
    its first row of sorted_ids (_block_rows)."""
    return pid_m.to(tl.int64) * (ROW_UNIT if ROW_UNIT else BLOCK_M)


@triton.jit
def _sorted_rows(pid_m, BLOCK_M: tl.constexpr, ROW_UNIT: tl.constexpr):
    """The tile's BLOCK_M rows in an intermediate laid out by aligned row."""
    return _sorted_first_row(pid_m, BLOCK_M, ROW_UNIT) + tl.arange(0, BLOCK_M)


@triton.jit
def _e2m1_x2pow14(t):
    """The e2m1 nibble held in bits 12..15 of t (int32) -> its value * 2^-14 in fp32, exactly.

    Sign and exponent/mantissa bits are moved to their fp16 places (sign 15, e 10..11, m 9): an fp16
    with exponent bias 15 then reads 2^(e-15) * (1 + m/2), and code 1 (0.5) is the fp16 subnormal 2^-15.
    """
    bits = (t & 0x8000) | ((t >> 3) & 0x0E00)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _step_scales(a_scale_ptr, a_rows, row_ok, stride_asm, w_scale_e, w_rows, col_ok, stride_wsn, k0,
                 A_SCALE: tl.constexpr, W_SCALE: tl.constexpr, W_BLOCKS: tl.constexpr = 0):
    """Scales of one K step under 128x128 block scaling: a 1x128 group scale per row, and a block scale per column
    (W_BLOCKS 0), or (`_k_step`'s block_rows: first rows of real tiles, so below N) one (1) or a pair: the gate
    half's, the up half's (2)."""
    if A_SCALE == 3:
        sa = tl.load(a_scale_ptr + a_rows * stride_asm + k0 // SCALE_BLOCK, mask=row_ok, other=0.0)
    else:
        sa = tl.full(a_rows.shape, 1.0, tl.float32)
    if W_BLOCKS == 2:
        sw = (tl.load(w_scale_e + (w_rows[0] // SCALE_BLOCK) * stride_wsn + k0 // SCALE_BLOCK),
              tl.load(w_scale_e + (w_rows[1] // SCALE_BLOCK) * stride_wsn + k0 // SCALE_BLOCK))
    elif W_BLOCKS == 1:
        sw = tl.load(w_scale_e + (w_rows // SCALE_BLOCK) * stride_wsn + k0 // SCALE_BLOCK)
    else:
        sw = tl.load(w_scale_e + (w_rows // SCALE_BLOCK) * stride_wsn + k0 // SCALE_BLOCK, mask=col_ok, other=0.0)
    return sa, sw


@triton.jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, dtype: tl.constexpr, SWAP_AB: tl.constexpr):
    """A GEMM accumulator: [BLOCK_M, BLOCK_N], or its transpose when the weights are the MMA's M side."""
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=dtype)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=dtype)
    return acc


@triton.jit
def _acc_rows_first(acc, SWAP_AB: tl.constexpr):
    """The accumulator as [BLOCK_M, BLOCK_N] for the epilogues (one transpose per tile, after the K loop)."""
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _row_dot(a, w, acc, SWAP_AB: tl.constexpr):
    """`_dot` for a one-row block, on CUDA cores: products in the accumulator's type, summed over K."""
    if SWAP_AB:
        acc += tl.sum(w.to(acc.dtype) * a.to(acc.dtype), axis=1)[:, None]
    else:
        acc += tl.sum(w.to(acc.dtype) * tl.reshape(a, (a.shape[1], 1)).to(acc.dtype), axis=0)[None, :]
    return acc


@triton.jit
def _dot(a, w, acc, SWAP_AB: tl.constexpr):
    """acc += a . w, with w [BLOCK_K, BLOCK_N]; or, swapped, acc^T += w . a^T with w [BLOCK_N, BLOCK_K].

    Swapped, the weight tile is the MMA's M side (Hopper's wgmma needs 64 rows there) and a few tokens
    its N side (8 suffice): at decode a 16-row token block otherwise fills an Ampere-style mma.sync.
    A one-row block (BLOCK_M 1, below tl.dot's smallest tile) is a GEMV: each program then streams a
    narrow weight slice with no MMA padding, so a decode step runs many more programs.
    """
    if a.shape[0] == 1:
        acc = _row_dot(a, w, acc, SWAP_AB)
    elif SWAP_AB:
        acc = tl.dot(w, tl.trans(a), acc, out_dtype=acc.dtype)
    else:
        acc = tl.dot(a, w, acc, out_dtype=acc.dtype)
    return acc


@triton.jit
def _mma(acc, a, b, sa, sw, W_SCALE: tl.constexpr, UPCAST_W: tl.constexpr, SWAP_AB: tl.constexpr,
         W_BLOCKS: tl.constexpr = 0):
    if UPCAST_W:
        b = b.to(a.dtype)
    if W_SCALE == 3:
        step = _dot(a, b, tl.zeros(acc.shape, tl.float32), SWAP_AB)
        if W_BLOCKS == 2:  # per half; which half an accumulator register holds is known at compile time
            gate, up = sa * sw[0], sa * sw[1]
            if SWAP_AB:
                first = tl.arange(0, acc.shape[0]) < acc.shape[0] // 2
                acc += step * tl.where(first[:, None], gate[None, :], up[None, :])
            else:
                first = tl.arange(0, acc.shape[1]) < acc.shape[1] // 2
                acc += step * tl.where(first[None, :], gate[:, None], up[:, None])
        elif W_BLOCKS == 1:
            factor = sa * sw
            if SWAP_AB:
                acc += step * factor[None, :]
            else:
                acc += step * factor[:, None]
        elif SWAP_AB:
            acc += step * sw[:, None] * sa[None, :]
        else:
            acc += step * sa[:, None] * sw[None, :]
    else:
        acc = _dot(a, b, acc, SWAP_AB)  # int32 accumulator for int8 operands
    return acc


# Four packed bytes -> the bf16 values of their low nibbles ($0, $1) and high nibbles ($2, $3), each
# times its bf16 scale ($5, $6 hold the scales of bytes 0,1 and 2,3). Two bytes at a time go to the high byte
# of each half of a register (prmt), then each nibble is moved into bf16 place: sign -> bit 15, exponent and
# mantissa -> bits 6..8, which reads as value * 2^-126 (code 1, 0.5, is a bf16 subnormal). From there a low
# nibble's e/m bits (8..10) reach 6..8 by one shift and its sign (11) reaches 15 by another, each shifted
# copy zero where the other's bits go, so one and-or (one LOP3) joins them; a high nibble's sign already is
# bit 15, and its e/m bits (12..14) shift to 6..8. Three SASS instructions per bf16x2 instead of four when
# the nibbles sat in the low byte (two shifts and two masks each). Multiplying by 2^126 and then by the scale
# (powers of two; fma with -0 keeps every sign, and bf16x2 fma is sm80+) is exact. Folded, the scale operand
# already holds scale * 2^126, one multiply per pair. Compiled for sm_90 on the checkpoint's byte order, GEMM1's
# main loop (BLOCK 16x32x64) came to 5.2 SASS instructions per weight (5.72 with the low-byte decode, 11 with the
# Triton-code decode of _e2m1_unpack); in fragment order the bytes of one call are one lane's word, and its four
# outputs the four registers of its MMA fragment (fp4_fragments.py).
_E2M1X4_PROLOGUE = """{
.reg .b32 h0, h1, e, s, v, zero, negz, two126;
mov.b32 zero, 0;
mov.b32 negz, 0x80008000;
prmt.b32 h0, $4, zero, 0x1404;
prmt.b32 h1, $4, zero, 0x3424;"""


def _e2m1x4_to_bf16_asm(folded: bool) -> str:
    """The PTX above; `folded`: the scale operands are scale * 2^126, so the separate 2^126 multiply goes."""
    lines = [_E2M1X4_PROLOGUE] + ([] if folded else ["mov.b32 two126, 0x7E807E80;"])
    for out, pair, low_nibble, scale in (("$0", "h0", True, "$5"), ("$1", "h1", True, "$6"),
                                         ("$2", "h0", False, "$5"), ("$3", "h1", False, "$6")):
        if low_nibble:
            lines.append(f"shr.b32 e, {pair}, 2; shl.b32 s, {pair}, 4; or.b32 v, e, s; and.b32 v, v, 0x81C081C0;")
        else:
            lines.append(f"shr.b32 e, {pair}, 6; and.b32 e, e, 0x01C001C0; and.b32 s, {pair}, 0x80008000; "
                         "or.b32 v, e, s;")
        if not folded:
            lines.append("fma.rn.bf16x2 v, v, two126, negz;")
        lines.append(f"fma.rn.bf16x2 {out}, v, {scale}, negz;")
    return "\n".join(lines + ["}"])


_E2M1X4_TO_BF16 = tl.constexpr(_e2m1x4_to_bf16_asm(folded=False))
_E2M1X4_TO_BF16_FOLDED = tl.constexpr(_e2m1x4_to_bf16_asm(folded=True))


@triton.jit
def _e2m1_unpack_bf16(packed, s, FOLDED: tl.constexpr):
    """packed e2m1 bytes [..] (uint8) and their e8m0 scales (broadcastable) -> (low nibbles, high nibbles) in bf16.

    FOLDED needs every s <= E8M0_FOLD_MAX: 2^(s - 127) * 2^126 = 2^(s - 1) is then a finite bf16.
    """
    if FOLDED:
        scale = ((s.to(tl.int16) + 126) << 7).to(tl.bfloat16, bitcast=True)    # 2^(s - 1)
        asm: tl.constexpr = _E2M1X4_TO_BF16_FOLDED
    else:
        scale = (s.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)            # 2^(s - 127)
        asm: tl.constexpr = _E2M1X4_TO_BF16
    return tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r,r", [packed, tl.broadcast_to(scale, packed.shape)],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _e2m1_unpack(packed, s, dtype: tl.constexpr):
    """The same in Triton code, for fp16 (and the interpreter): nibbles through fp16 bit patterns, fp32 scaling."""
    t = packed.to(tl.int32)
    # 2^(s - 127) * 2^14 undoes the 2^-14 of _e2m1_x2pow14; the exponent field s + 14 is finite for s <= 240
    # (group amax below 2^116: larger weights could not be fp16 MMA operands anyway).
    scale = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    return (_e2m1_x2pow14(t << 12) * scale).to(dtype), (_e2m1_x2pow14(t << 8) * scale).to(dtype)


@triton.jit
def _mx8_weights(b, w_scale_e, w_rows, stride_wsn, k0, K, dtype: tl.constexpr, SWAP_AB: tl.constexpr):
    """An MXFP8 weight tile b (e4m3; [BLOCK_N, BLOCK_K] swapped, else [BLOCK_K, BLOCK_N]) times its e8m0 scales
    ([N, K/32] per expert; w_rows are real rows), in dtype. Exact: e4m3's 4 significant bits fit bf16's 8 and
    fp16's 11, and bf16 has fp32's exponent range (fp16 holds the values while they stay in its range, as the fp16
    model's own weights do; its scaling runs in fp32, where every e8m0 scale is finite)."""
    NB: tl.constexpr = (b.shape[1] if SWAP_AB else b.shape[0]) // MX_GROUP
    g = k0 // MX_GROUP + tl.arange(0, NB)
    g_ok = g < K // MX_GROUP
    w_off = w_rows.to(tl.int64) * stride_wsn
    if SWAP_AB:
        s = tl.load(w_scale_e + w_off[:, None] + g[None, :], mask=g_ok[None, :], other=0)
    else:
        s = tl.load(w_scale_e + w_off[None, :] + g[:, None], mask=g_ok[:, None], other=0)
    if dtype == tl.bfloat16:
        v = b.to(tl.bfloat16)
        scale = (s.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)          # 2^(s - 127), as _e8m0
    else:
        v = b.to(tl.float32)
        scale = _e8m0(s)
    if SWAP_AB:
        v = tl.reshape(v, (b.shape[0], NB, MX_GROUP)) * scale[:, :, None]
    else:
        v = tl.reshape(v, (NB, MX_GROUP, b.shape[1])) * scale[:, None, :]
    return tl.reshape(v, b.shape).to(dtype)


@triton.jit
def _fp4_fragment_tile(w_e, w_scale_e, slab_rows, stride_wn, stride_wsn, k0, K, dtype: tl.constexpr,
                       FOLDED: tl.constexpr, PAIRED: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                       w_desc, s_desc, tma_e, tma_row, W_TMA: tl.constexpr):
    """The [ROWS, BLOCK_K] weight tile at k0 of fragment-order MXFP4 weights (fp4_fragments.py), decoded to dtype.

    slab_rows: the first row of each slab the tile reads, in tile order (16 rows; PAIRED, the paired layout of
    interleaved gate/up rows: 32, and the tile is the slabs' gate rows, then their up rows), each a real slab
    (`_real_rows`). Each lane loads its words contiguously and the reshapes below only rename registers: on sm_90
    the decoded values are the MMA's register operand as they leave the decode (bench/sass_count.py).
    W_TMA: the values and scales are TMA copies instead (`_fp4_tma_runs`), the tile's first row tma_row.
    """
    U: tl.constexpr = 2 if PAIRED else 1                                     # rows per column in a slab
    S: tl.constexpr = ROWS // (16 * U)
    NB: tl.constexpr = BLOCK_K // MX_GROUP
    RUN: tl.constexpr = 256 * U                                               # bytes of one slab and group
    if W_TMA:
        packed, s = _fp4_tma_runs(w_desc, s_desc, tma_e, tma_row // (16 * U), k0 // MX_GROUP, PAIRED, S, NB, RUN,
                                  16 * U)
    else:
        t = tl.arange(0, NB * RUN)
        group_ok = k0 // MX_GROUP + t // RUN < K // MX_GROUP
        packed = tl.load(w_e + slab_rows.to(tl.int64)[:, None] * stride_wn + (k0 // MX_GROUP) * RUN + t[None, :],
                         mask=group_ok[None, :], other=0)
        ts = tl.arange(0, NB * 16 * U)                                        # the slab's scales, group-major
        scale_ok = k0 // MX_GROUP + ts // (16 * U) < K // MX_GROUP
        s = tl.load(w_scale_e + slab_rows.to(tl.int64)[:, None] * stride_wsn + (k0 // MX_GROUP) * 16 * U
                    + ts[None, :], mask=scale_ok[None, :], other=0)
    packed = tl.reshape(packed, (S, NB, 8, 4, U, 2, 2, 2))                    # slab, group, g, c, u, j, h, p
    s = tl.permute(tl.reshape(s, (S, NB, 2, 8, U)), (0, 1, 3, 4, 2))          # slab, group, g, u, h
    s = tl.reshape(s, (S, NB, 8, 1, U, 1, 2, 1))
    if dtype == tl.bfloat16:
        low, high = _e2m1_unpack_bf16(packed, s, FOLDED)
    else:
        low, high = _e2m1_unpack(packed, s, dtype)
    w = tl.permute(tl.join(low, high), (4, 0, 6, 2, 1, 5, 8, 3, 7))           # u, s, h, g | group, j, q, c, p
    return tl.reshape(w, (ROWS, BLOCK_K))


@triton.jit
def _fp4_tma_runs(w_desc, s_desc, tma_e, slab0, g0, PAIRED: tl.constexpr, S: tl.constexpr, NB: tl.constexpr,
                  RUN: tl.constexpr, SCALES: tl.constexpr):
    """(values [S, NB * RUN], scales [S, NB * SCALES]) of S slabs from slab0 and NB groups from g0, as TMA copies of
    boxes of the fragment order's views (launch._weight_descriptors): [E, slabs, K/32, 256] ([2E, ..] with GEMM1's
    halves as two planes; paired, [E, slabs, K/32, 2, 256]) and the scales' [E, slabs, K/32, SCALES]. Groups and
    slabs past the bounds come as zeros, which decode to 0: no masks."""
    if PAIRED:
        packed = w_desc.load([tma_e, slab0, g0, 0, 0])
    else:
        packed = w_desc.load([tma_e, slab0, g0, 0])
    return (tl.reshape(packed, (S, NB * RUN)),
            tl.reshape(s_desc.load([tma_e, slab0, g0, 0]), (S, NB * SCALES)))


@triton.jit
def _fp4_mma(acc, a, w_e, w_scale_e, slab_rows, stride_wn, stride_wsn, k0, K, W_FP4: tl.constexpr,
             PAIRED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
             w_desc, s_desc, tma_e, tma_row, W_TMA: tl.constexpr):
    """acc^T += w[slab rows, k0:k0+BLOCK_K] . a[:, same k]^T for MXFP4 weights in fragment order: one MMA per K
    step, the decoded weights its A operand (the host swaps every such tile: `launch.fragment_tiles`)."""
    tl.static_assert(SWAP_AB, "MXFP4 tiles run swapped (launch.fragment_tiles)")
    w = _fp4_fragment_tile(w_e, w_scale_e, slab_rows, stride_wn, stride_wsn, k0, K, a.dtype, W_FP4 == 2,
                           PAIRED, BLOCK_N, BLOCK_K, w_desc, s_desc, tma_e, tma_row, W_TMA)
    return _dot(a, w, acc, SWAP_AB)


@triton.jit
def _tma_tile(w_desc, tma_e, tma_row, k0, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr):
    """The [ROWS, BLOCK_K] weight tile (transposed unless SWAP_AB) as one TMA copy of w_desc's 3-d box at
    [tma_e, tma_row, k0] (launch._weight_descriptors): [1, ROWS, BLOCK_K] of [E, N, K], or GEMM1's gate and up rows
    as [2, ROWS / 2, BLOCK_K] of [2E, I, K]. The copy engine fills rows and K past the bounds with zeros, so the
    tile needs no address or mask instructions."""
    w = tl.reshape(w_desc.load([tma_e, tma_row, k0]), (ROWS, BLOCK_K))
    if not SWAP_AB:
        w = tl.trans(w)
    return w


@triton.jit
def _k_step(acc, a, a_scale_ptr, a_rows, row_ok, stride_asm, w_e, w_scale_e, w_rows, col_ok, slab_rows,
            stride_wn, stride_wsn, k0, ks, k_ok, K, A_SCALE: tl.constexpr, W_SCALE: tl.constexpr,
            UPCAST_W: tl.constexpr, W_FP4: tl.constexpr, PAIRED: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, w_desc=None, tma_e=0, tma_row=0, W_TMA: tl.constexpr = 0,
            s_desc=None, block_rows=None, W_BLOCKS: tl.constexpr = 0):
    """acc += a . w[w_rows, k0:k0+BLOCK_K] for one K step, in the arithmetic of the scheme codes.

    w_rows and slab_rows are real rows (`_real_rows`), so the weight loads mask K alone; col_ok masks the block
    scales of the columns past N. W_TMA: the tile is w_desc's box at [tma_e, tma_row, k0] instead (`_tma_tile`;
    MXFP4, w_desc's and s_desc's boxes of its slabs: `_fp4_tma_runs`). W_BLOCKS 1 or 2, under block scaling: the
    tile's rows lie in one 128-row block (block_rows: the tile's first row) or each half of them in one (a pair: the
    first gate row, the first up row). Each K step then loads one or two weight scales and multiplies them into the
    row scales, and each accumulator element takes one FFMA, not an FMUL and an FFMA (the select between the halves'
    factors folds away). 0: a scale per row."""
    if W_FP4:
        acc = _fp4_mma(acc, a, w_e, w_scale_e, slab_rows, stride_wn, stride_wsn, k0, K, W_FP4, PAIRED,
                       BLOCK_N, BLOCK_K, SWAP_AB, w_desc, s_desc, tma_e, tma_row, W_TMA)
    else:
        if W_TMA:
            b = _tma_tile(w_desc, tma_e, tma_row, k0, BLOCK_N, BLOCK_K, SWAP_AB)
        elif SWAP_AB:
            b = tl.load(w_e + w_rows.to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=k_ok[None, :], other=0.0)
        else:
            b = tl.load(w_e + w_rows.to(tl.int64)[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None], other=0.0)
        tl.static_assert(A_SCALE != 4, "MXFP8 inputs come dequantised (launch._gemm_input)")
        if W_SCALE == 4:
            acc = _dot(a, _mx8_weights(b, w_scale_e, w_rows, stride_wsn, k0, K, a.dtype, SWAP_AB), acc, SWAP_AB)
        else:
            sa, sw = 1.0, 1.0  # unused unless block-scaled
            if W_SCALE == 3:
                sa, sw = _step_scales(a_scale_ptr, a_rows, row_ok, stride_asm, w_scale_e,
                                      w_rows if W_BLOCKS == 0 else block_rows, col_ok, stride_wsn, k0, A_SCALE,
                                      W_SCALE, W_BLOCKS)
            acc = _mma(acc, a, b, sa, sw, W_SCALE, UPCAST_W, SWAP_AB, W_BLOCKS)
    return acc


@triton.jit
def _a_tile(a_ptr, a_desc, rows, row_ok, pid_m, stride_am, k0, ks, k_ok, A_SORTED: tl.constexpr,
            BLOCK_M: tl.constexpr, ROW_UNIT: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] A tile of one K step: its rows gathered by address (A_SORTED 0), or the tile's box of
    an intermediate laid out by aligned row, by address (1) or as a TMA copy of a_desc's box (2; gemm2_tile)."""
    if A_SORTED == 2:
        a = a_desc.load([_sorted_first_row(pid_m, BLOCK_M, ROW_UNIT).to(tl.int32), k0])
    elif A_SORTED == 1:
        a = tl.load(a_ptr + _sorted_rows(pid_m, BLOCK_M, ROW_UNIT)[:, None] * stride_am + ks[None, :],
                    mask=k_ok[None, :], other=0.0)
    else:
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return a


@triton.jit
def _k_loop_halves(a_ptr, a_desc, a_rows, row_ok, pid_m, stride_am, a_scale_ptr, stride_asm, w_e, ws_e, w_rows1,
                   w_rows2, col_ok1, col_ok2, first1, first2, K, stride_wn, stride_wsn, A_SCALE: tl.constexpr,
                   W_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, HALF_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SWAP_AB: tl.constexpr, STAGES: tl.constexpr, w_desc, tma_e1, tma_e2, tma_row1, tma_row2,
                   W_TMA: tl.constexpr, A_SORTED: tl.constexpr, ROW_UNIT: tl.constexpr):
    """The K loop of a block-scaled tile whose two halves of HALF_N weight rows (w_rows1, the first from first1;
    w_rows2 from first2; by TMA, boxes of planes tma_e1 / tma_e2 at rows tma_row1 / tma_row2) each lie in one block
    of 128 rows: per K step one A tile and two MMAs, each product promoted into its own fp32 accumulator.

    One MMA over the whole tile needs a fresh product as large as the tile beside its accumulator: at 128 x 256 on
    8 warps that is 256 fp32 registers per thread, which ptxas spills (sm_90, DeepSeek-V3 FP8 block-128), so the
    single-MMA loop is held to 64-row tiles there. Halves need half of that, and each weight byte from L2 then serves
    128 rows."""
    tl.static_assert(W_SCALE == 3, "promoted halves serve 128x128 block-scaled weights")
    acc1 = _acc_zeros(BLOCK_M, HALF_N, tl.float32, SWAP_AB)
    acc2 = _acc_zeros(BLOCK_M, HALF_N, tl.float32, SWAP_AB)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = _a_tile(a_ptr, a_desc, a_rows, row_ok, pid_m, stride_am, k0, ks, k_ok, A_SORTED, BLOCK_M, ROW_UNIT)
        acc1 = _k_step(acc1, a, a_scale_ptr, a_rows, row_ok, stride_asm, w_e, ws_e, w_rows1, col_ok1, w_rows1,
                       stride_wn, stride_wsn, k0, ks, k_ok, K, A_SCALE, W_SCALE, False, 0, False, HALF_N, BLOCK_K,
                       SWAP_AB, w_desc, tma_e1, tma_row1, W_TMA, None, first1, 1)
        acc2 = _k_step(acc2, a, a_scale_ptr, a_rows, row_ok, stride_asm, w_e, ws_e, w_rows2, col_ok2, w_rows2,
                       stride_wn, stride_wsn, k0, ks, k_ok, K, A_SCALE, W_SCALE, False, 0, False, HALF_N, BLOCK_K,
                       SWAP_AB, w_desc, tma_e2, tma_row2, W_TMA, None, first2, 1)
    return acc1, acc2


@triton.jit
def _epilogue_scale(acc, a_scale_ptr, a_rows, row_ok, w_scale_e, w_rows, col_ok, stride_wsn,
                    A_SCALE: tl.constexpr, W_SCALE: tl.constexpr):
    """Apply the scales that factor out of the K sum (everything except block scales)."""
    acc = acc.to(tl.float32)
    if A_SCALE == 1 or W_SCALE == 1:  # the per-tensor and per-expert scales as one factor: one multiply each
        factor = tl.load(a_scale_ptr) if A_SCALE == 1 else 1.0
        if W_SCALE == 1:
            factor = factor * tl.load(w_scale_e)
        acc = acc * factor
    if A_SCALE == 2:
        acc = acc * tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)[:, None]
    if W_SCALE == 2:
        acc = acc * tl.load(w_scale_e + w_rows * stride_wsn, mask=col_ok, other=0.0)[None, :]
    return acc


# 1 / (1 + 2^(-x log2 e)) in fp32 by the SFU's approximations with denormals flushed (ex2 within 2 ulp, rcp
# within 1 ulp: far inside the bf16/fp16 outputs' rounding). tl.sigmoid's exp and division keep denormals, which
# costs a compare and two predicated multiplies per exp and a range fix-up per reciprocal. At Mixtral-8x7B FP8
# M=1024 (one 8-warp program per SM, nothing to overlap its epilogue; K loop 105 instructions per K step) GEMM1's
# instructions outside the K loop went 2719 -> 2079 with this and one scale factor, and GEMM1 ran 1.02x faster on
# the H200; FP8 per-tensor GEMM1s 1.01-1.04x, bf16 level (bench/results/s33).
_SIGMOID_PTX = tl.constexpr("""{
.reg .f32 t;
mul.f32 t, $1, 0fBFB8AA3B;
ex2.approx.ftz.f32 t, t;
add.f32 t, t, 0f3F800000;
rcp.approx.ftz.f32 $0, t;
}""")


# tanh(x) by one SFU op (MUFU.TANH, sm_75+): max relative error 2^-10.99 (PTX ISA, tanh), so sigmoid(x) =
# 0.5 + 0.5 tanh(x / 2) errs by at most 2.5e-4 absolute (held to that on the GPU: tests/kernels/
# test_semantic_constants.py). That is coarse for a bf16/fp16 intermediate (x sigmoid(x) at x = -3 by ~1 bf16 ulp), so
# it serves only outputs that are quantised to 8 bits next (EIGHT_BIT_OUT: GEMM2's FP8/INT8 input, whose rounding is
# ~100 times coarser). There it halves the SFU work of the epilogue, its bound once the amax came from the registers
# (_stored_amax): two SFU ops per value (16 per SM per clock: 2048 clocks a 128x128 tile of 8 warps) against ~1560
# clocks of issue. FP8 per tensor on the H200, GEMM1 alone: Mixtral-8x7B M=4096 1750 -> 1707 us, Qwen3-30B-A3B
# M=16384 834 -> 805, output errors unchanged (bench/results/s37).
_TANH_PTX = tl.constexpr("tanh.approx.f32 $0, $1;")


@triton.jit
def _tanh(x):
    return tl.inline_asm_elementwise(_TANH_PTX, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _sigmoid(x, PTX_MATH: tl.constexpr, EIGHT_BIT_OUT: tl.constexpr):
    """sigmoid(x) of fp32 x; PTX_MATH (compiled for CUDA, not the interpreter): _SIGMOID_PTX, or from _tanh where
    the result feeds an EIGHT_BIT_OUT."""
    if PTX_MATH and EIGHT_BIT_OUT:
        out = 0.5 * _tanh(0.5 * x) + 0.5
    elif PTX_MATH:
        out = tl.inline_asm_elementwise(_SIGMOID_PTX, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        out = tl.sigmoid(x)
    return out


@triton.jit
def _silu(x, PTX_MATH: tl.constexpr, EIGHT_BIT_OUT: tl.constexpr):
    """x * sigmoid(x); from _tanh as h + h tanh(h), h = x / 2: one multiply fewer than x times the sigmoid."""
    if PTX_MATH and EIGHT_BIT_OUT:
        h = 0.5 * x
        out = h * _tanh(h) + h
    else:
        out = x * _sigmoid(x, PTX_MATH, EIGHT_BIT_OUT)
    return out


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr, PTX_MATH: tl.constexpr, EIGHT_BIT_OUT: tl.constexpr):
    """The elementwise function: silu, gelu (erf), gelu (tanh) or relu^2."""
    if ACTIVATION == 0:
        out = _silu(x, PTX_MATH, EIGHT_BIT_OUT)
    elif ACTIVATION == 1:
        out = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == 2:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        out = 0.5 * x * (1.0 + (2.0 * _sigmoid(2.0 * inner, PTX_MATH, EIGHT_BIT_OUT) - 1.0))  # tanh via sigmoid
    else:
        out = tl.maximum(x, 0.0)
        out = out * out
    return out


@triton.jit
def _gated_activation(gate, up, swiglu_limit, swiglu_alpha, ACTIVATION: tl.constexpr, PTX_MATH: tl.constexpr,
                      EIGHT_BIT_OUT: tl.constexpr):
    """act(gate) * up; swigluoai clamps by the model's limit and scales the sigmoid by its alpha (runtime
    scalars: a model's values never recompile the kernel)."""
    if ACTIVATION == 3:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        out = gate * _sigmoid(swiglu_alpha * gate, PTX_MATH, EIGHT_BIT_OUT) * (up + 1.0)
    else:
        out = _activation(gate, ACTIVATION, PTX_MATH, EIGHT_BIT_OUT) * up
    return out


@triton.jit
def _lora_delta(shrink_ptr, stride_sm, slot, row_ok, lora_b_e, w_rows, col_ok, stride_lbn, rank,
                LORA_R: tl.constexpr):
    """[BLOCK_M, BLOCK_N] LoRA delta: the block's shrink rows (scaling included) times B[e][w_rows]^T."""
    rs = tl.arange(0, LORA_R)
    r_ok = rs < rank
    s = tl.load(shrink_ptr + slot[:, None] * stride_sm + rs[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    b = tl.load(lora_b_e + w_rows[None, :].to(tl.int64) * stride_lbn + rs[:, None],
                mask=r_ok[:, None] & col_ok[None, :], other=0.0)
    return _dot(s, b, tl.zeros((s.shape[0], b.shape[1]), tl.float32), False)


@triton.jit
def lora_shrink_kernel(
        a_ptr, lora_a_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
        num_slots, num_experts, K, rank, slots_per_row, scaling,
        stride_am, stride_lae, stride_lar, stride_om,
        LORA_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NAIVE: tl.constexpr):
    """out[slot, r] = scaling * a[slot // slots_per_row] . A[e, r] over one sorted block; 0 for r >= rank.

    slots_per_row is top_k for GEMM1 (a = the token rows) and 1 for GEMM2 (a = the slot rows).
    """
    pid_m = tl.program_id(0)
    if _past_end(num_post_ptr, pid_m, BLOCK_M, NAIVE):
        return
    slot, row_ok, e = _block_rows(sorted_ids_ptr, expert_ids_ptr, pid_m, num_slots, num_experts, BLOCK_M, NAIVE)
    a_rows = slot // slots_per_row
    rs = tl.arange(0, LORA_R)
    r_ok = rs < rank
    la_e = lora_a_ptr + e * stride_lae
    acc = tl.zeros((BLOCK_M, LORA_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(la_e + rs[None, :] * stride_lar + ks[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = _dot(a, w, acc, False)
    tl.store(out_ptr + slot[:, None] * stride_om + rs[None, :], (acc * scaling).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _pre_activation(acc, a_scale_ptr, a_rows, row_ok, w_scale_e, w_rows, col_ok, stride_wsn, bias_e, slot,
                    lora_shrink_ptr, stride_lsm, lora_b_e, stride_lbn, lora_rank, A_SCALE: tl.constexpr,
                    W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, LORA_R: tl.constexpr):
    """One GEMM1 output (gate or up rows) before the activation: scaled, plus bias, plus LoRA delta."""
    h = _epilogue_scale(acc, a_scale_ptr, a_rows, row_ok, w_scale_e, w_rows, col_ok, stride_wsn, A_SCALE, W_SCALE)
    if HAS_BIAS:
        h += tl.load(bias_e + w_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        h += _lora_delta(lora_shrink_ptr, stride_lsm, slot, row_ok, lora_b_e, w_rows, col_ok, stride_lbn, lora_rank,
                         LORA_R)
    return h


@triton.jit
def _read_back_amax(out_ptrs, tile_ok):
    """The finite amax of the tile a program stored at `out_ptrs` where `tile_ok`, read back after a barrier (which
    makes the program's stores visible to it)."""
    tl.debug_barrier()
    values = tl.load(out_ptrs, mask=tile_ok, other=0.0)
    return tl.max(tl.max(_finite_abs(values.to(tl.float32)), axis=1), axis=0)


# The fp32 magnitudes from which rounding to bf16 / fp16 reaches Inf: halfway past each type's largest finite value
# (0x1.fep+127 and 65504), where ties go to the even neighbour, Inf.
_BF16_INF_FROM = tl.constexpr(float.fromhex("0x1.ffp+127"))
_FP16_INF_FROM = tl.constexpr(65520.0)


@triton.jit
def _registers_amax(out, tile_ok, dtype: tl.constexpr, AMAX_MASK: tl.constexpr):
    """The finite amax of `out` (fp32) as stored in dtype (bf16 or fp16) where tile_ok, from the registers alone:
    the values that round to Inf, and NaN, count as 0 (the read-back's finite amax, _read_back_amax), and rounding is
    monotone, so the max of the magnitudes kept, rounded once, is the max of the stored ones."""
    magnitudes = tl.abs(out)
    inf_from = _FP16_INF_FROM if dtype == tl.float16 else _BF16_INF_FROM
    keep = magnitudes < inf_from
    if AMAX_MASK:
        keep = keep & tile_ok
    return tl.max(tl.max(tl.where(keep, magnitudes, 0.0), axis=1), axis=0).to(dtype).to(tl.float32)


@triton.jit
def _stored_amax(out, out_ptrs, tile_ok, SWAP_AB: tl.constexpr, AMAX_MASK: tl.constexpr,
                 IN_REGISTERS: tl.constexpr = False):
    """The finite amax of the tile a program stored: `out` (fp32) cast to out_ptrs' dtype, at `out_ptrs` where
    `tile_ok`.

    Unswapped, from the registers: max |out| rounded once to the stored dtype, which is the max of the stored
    magnitudes because rounding is monotone (and the max ignores NaN). Only where that comes out non-finite (a value
    rounds to Inf when stored, or every value is NaN) is the tile read back and its finite values taken, as swapped
    tiles always are: reduced in the registers, Triton gave those another layout than the store's and computed the
    whole epilogue twice (gpt-oss-120b FP8 M=4096: 204 registers, not 125; GEMM1 26% slower on the H200 when first
    seen). AMAX_MASK (launch.gemm1): whether values outside tile_ok can be non-zero, so the mask must apply; without
    it padding rows are act(0) * 0 = 0 (their token rows load as zeros, no bias) and every column is below N. At
    Mixtral-8x7B FP8 M=1024 (compiled for sm_90, bench/sass_count.py) GEMM1's instructions outside the K loop went
    from 2118 to 1502 on the path that runs (the read-back branch adds 664 more that run only where it is taken):
    the stored values' upcast, finite test, select and mask had cost 8-9 instructions per value.
    IN_REGISTERS (persistent tiles): no read-back, _registers_amax; a branch that loads in the epilogue of a flattened
    K loop stops Triton pipelining it (compiled for sm_90: one stage of shared memory instead of three)."""
    if IN_REGISTERS:
        amax = _registers_amax(out, tile_ok, out_ptrs.dtype.element_ty, AMAX_MASK)
    elif SWAP_AB:
        amax = _read_back_amax(out_ptrs, tile_ok)
    else:
        magnitudes = tl.abs(out)
        if AMAX_MASK:
            magnitudes = tl.where(tile_ok, magnitudes, 0.0)
        amax = tl.max(tl.max(magnitudes, axis=1), axis=0).to(out_ptrs.dtype.element_ty).to(tl.float32)
        if not (amax <= FP32_MAX):
            amax = _read_back_amax(out_ptrs, tile_ok)
    return amax


@triton.jit
def gemm1_gated_kernel(
        a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
        sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
        num_slots, num_experts, num_m_blocks, N, K, top_k, gate_row_step, up_row_offset,
        stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om,
        A_SCALE: tl.constexpr, W_SCALE: tl.constexpr, UPCAST_W: tl.constexpr, W_FP4: tl.constexpr,
        HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ACC_INT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SWAP_AB: tl.constexpr, lora_shrink_ptr, lora_b_ptr, lora_rank, stride_lsm, stride_lbe, stride_lbn,
        GATED: tl.constexpr, PAIRED: tl.constexpr, HAS_LORA: tl.constexpr, LORA_R: tl.constexpr, swiglu_limit,
        swiglu_alpha, amax_ptr, AMAX: tl.constexpr, AMAX_MASK: tl.constexpr, NAIVE: tl.constexpr, PDL: tl.constexpr,
        PTX_MATH: tl.constexpr, EIGHT_BIT_OUT: tl.constexpr, w_desc=None, W_TMA: tl.constexpr = 0, s_desc=None,
        W_BLOCKS: tl.constexpr = 0, tiles_ptr=None, TAIL_M: tl.constexpr = 0, SORTED_OUT: tl.constexpr = False,
        HALF_MMA: tl.constexpr = False, PERSISTENT: tl.constexpr = False):
    """GEMM1, one program per tile (gemm1_tile), its K loop pipelined by the launch's num_stages. TAIL_M: the rows
    of the tail tiles (0: none), swapped (tokens on the MMA's N side, so a short tile keeps wgmma's 64-row side full
    of weights); `tiles_ptr`: the tile table (align.py). SORTED_OUT, HALF_MMA: as in gemm1_tile. PERSISTENT
    (GemmConfig.PERSISTENT): each program runs tiles in turn, its K loops flattened into one, and stores the amax of
    all of them (taken in the registers: _stored_amax's IN_REGISTERS)."""
    wait_for_previous_kernel(PDL)
    if PERSISTENT:
        tl.static_assert(not TAIL_M and not NAIVE, "PERSISTENT: whole BLOCK_M tiles of the sorted assignment")
        amax = 0.0
        num_m_real = tl.load(num_post_ptr) // BLOCK_M
        for tile in tl.range(tl.program_id(0), num_m_real * tl.cdiv(N, BLOCK_N), tl.num_programs(0), flatten=True):
            pid_m, pid_n = _tile_coords(tile, num_m_real, N, BLOCK_M, BLOCK_N, GROUP_M)
            amax = tl.maximum(amax, gemm1_tile(
                pid_m, pid_n, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, sorted_ids_ptr,
                expert_ids_ptr, num_slots, num_experts, N, K, top_k, gate_row_step, up_row_offset, stride_am,
                stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om, A_SCALE, W_SCALE,
                UPCAST_W, W_FP4, HAS_BIAS, ACTIVATION, ACC_INT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, lora_shrink_ptr,
                lora_b_ptr, lora_rank, stride_lsm, stride_lbe, stride_lbn, GATED, PAIRED, HAS_LORA, LORA_R,
                swiglu_limit, swiglu_alpha, AMAX, AMAX_MASK, NAIVE, PDL, PTX_MATH, EIGHT_BIT_OUT, None, w_desc, W_TMA,
                s_desc, W_BLOCKS, 0, SORTED_OUT, HALF_MMA, AMAX_IN_REGISTERS=True))
        if AMAX:
            tl.store(amax_ptr + tl.program_id(0), amax)
        return
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_m_blocks, N, BLOCK_M, BLOCK_N, GROUP_M)
    block, tail, past = _row_tile(tiles_ptr, num_post_ptr, pid_m, BLOCK_M, TAIL_M, NAIVE)
    if past:
        if AMAX:
            tl.store(amax_ptr + tl.program_id(0), 0.0)
        return
    if TAIL_M:  # constexpr: without tail tiles the tail branch is not compiled
        if tail:
            amax = gemm1_tile(block, pid_n, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
                              sorted_ids_ptr, expert_ids_ptr, num_slots, num_experts, N, K, top_k, gate_row_step,
                              up_row_offset, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                              stride_be, stride_om, A_SCALE, W_SCALE, UPCAST_W, W_FP4, HAS_BIAS, ACTIVATION, ACC_INT,
                              TAIL_M, BLOCK_N, BLOCK_K, True, lora_shrink_ptr, lora_b_ptr, lora_rank, stride_lsm,
                              stride_lbe, stride_lbn, GATED, PAIRED, HAS_LORA, LORA_R, swiglu_limit, swiglu_alpha,
                              AMAX, AMAX_MASK, NAIVE, PDL, PTX_MATH, EIGHT_BIT_OUT, None, w_desc, W_TMA, s_desc,
                              W_BLOCKS, TAIL_M, SORTED_OUT, HALF_MMA)
            if AMAX:
                tl.store(amax_ptr + tl.program_id(0), amax)
            return
    amax = gemm1_tile(block, pid_n, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
                      sorted_ids_ptr, expert_ids_ptr, num_slots, num_experts, N, K, top_k, gate_row_step,
                      up_row_offset, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be,
                      stride_om, A_SCALE, W_SCALE, UPCAST_W, W_FP4, HAS_BIAS, ACTIVATION, ACC_INT, BLOCK_M, BLOCK_N,
                      BLOCK_K, SWAP_AB, lora_shrink_ptr, lora_b_ptr, lora_rank, stride_lsm, stride_lbe, stride_lbn,
                      GATED, PAIRED, HAS_LORA, LORA_R, swiglu_limit, swiglu_alpha, AMAX, AMAX_MASK, NAIVE, PDL,
                      PTX_MATH, EIGHT_BIT_OUT, None, w_desc, W_TMA, s_desc, W_BLOCKS, TAIL_M, SORTED_OUT, HALF_MMA)
    if AMAX:
        tl.store(amax_ptr + tl.program_id(0), amax)


@triton.jit
def gemm1_tile(
        pid_m, pid_n, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
        sorted_ids_ptr, expert_ids_ptr,
        num_slots, num_experts, N, K, top_k, gate_row_step, up_row_offset,
        stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om,
        A_SCALE: tl.constexpr, W_SCALE: tl.constexpr, UPCAST_W: tl.constexpr, W_FP4: tl.constexpr,
        HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ACC_INT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SWAP_AB: tl.constexpr, lora_shrink_ptr, lora_b_ptr, lora_rank, stride_lsm, stride_lbe, stride_lbn,
        GATED: tl.constexpr, PAIRED: tl.constexpr, HAS_LORA: tl.constexpr, LORA_R: tl.constexpr, swiglu_limit,
        swiglu_alpha, AMAX: tl.constexpr, AMAX_MASK: tl.constexpr, NAIVE: tl.constexpr, PDL: tl.constexpr,
        PTX_MATH: tl.constexpr, EIGHT_BIT_OUT: tl.constexpr, STAGES: tl.constexpr, w_desc, W_TMA: tl.constexpr,
        s_desc, W_BLOCKS: tl.constexpr = 0, ROW_UNIT: tl.constexpr = 0, SORTED_OUT: tl.constexpr = False,
        HALF_MMA: tl.constexpr = False, AMAX_IN_REGISTERS: tl.constexpr = False):
    """out[slot, n] = act(x[token] . w[e, gate(n)], x[token] . w[e, up(n)]) for n < N = I.

    Non-gated: out[slot, n] = act(x[token] . w[e, n]). Bias and LoRA delta join each pre-activation.
    Returns with AMAX the finite amax of the values the tile stores (0 if none), else 0: for GEMM2's dynamic
    per-tensor scale (the kernel stores one per program, quant.scale_of_partials); AMAX_MASK: see _stored_amax.
    EIGHT_BIT_OUT: GEMM2 quantises this output to 8 bits, so the activation may take the coarser sigmoid of _TANH_PTX.
    W_TMA (launch._weight_descriptors): 0 pointer loads; 1 TMA, the gate and up rows of the halves layout as two
    planes of one box; 2 TMA of 2 * BLOCK_N consecutive rows (non-gated, or interleaved pairs, whose accumulator
    columns then alternate gate, up; MXFP4's paired slabs decode gate rows first, as without TMA).
    STAGES: the K loop's software pipeline depth, or None for the launch's num_stages. A depth set on the loop
    pipelines the GEMV rows' loop (no tl.dot) through shared memory, which the launch's leaves alone: DeepSeek-V3
    bf16 M=1 ran 266 us against 182 so (H200, bench/results/s39). pid_m, pid_n: the tile. The block is not past the
    aligned rows (the caller checks). W_BLOCKS (block scaling, launch._weight_blocks): the tile's rows lie in 1 block
    of 128 rows, each of its halves (gate, up) in 1 (2), or no such promise (0).
    ROW_UNIT: the rows of a block of sorted_ids, where the tile's BLOCK_M rows start at block pid_m (_block_rows).
    SORTED_OUT (MoEConfig.SORTED_INTER): the tile's row r goes to out row first + r, first its first row of sorted_ids,
    instead of its slot's row, padding rows zero, so GEMM2 reads whole boxes of it (gemm2_tile's A_SORTED).
    HALF_MMA (block scaling, W_BLOCKS 2; _k_loop_halves): the gate half and the up half of each K step are two MMAs,
    each promoted into its own accumulator. AMAX_IN_REGISTERS: as _stored_amax's IN_REGISTERS.
    """
    slot, row_ok, e = _block_rows(sorted_ids_ptr, expert_ids_ptr, pid_m, num_slots, num_experts, BLOCK_M, NAIVE,
                                  ROW_UNIT)
    a_rows = slot // top_k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    gate_rows = cols * gate_row_step
    up_rows = gate_rows + up_row_offset
    # Gated, one weight tile holds the BLOCK_N gate rows then the BLOCK_N up rows, so each K step is one MMA
    # of twice the width: two half-width MMAs re-read the A tile from shared memory. On the H100 the GEMMs ran
    # 1.00-1.04x faster at M=4096 and 1.00-1.06x at M=16384 this way, level below (bench/results, session 23).
    W_COLS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    j = tl.arange(0, W_COLS)
    ALTERNATING: tl.constexpr = W_TMA == 2 and GATED and not W_FP4  # accumulator columns gate, up, gate, ...
    if ALTERNATING:
        w_rows = pid_n * W_COLS + j
        w_ok = w_rows // 2 < N
    else:
        w_cols = pid_n * BLOCK_N + j % BLOCK_N
        w_rows = w_cols * gate_row_step + (j // BLOCK_N) * up_row_offset
        w_ok = w_cols < N
    w_rows = _real_rows(w_rows, w_ok)
    tma_e = (e * 2 if W_TMA == 1 else e).to(tl.int32)
    tma_row = pid_n * (BLOCK_N if W_TMA == 1 else W_COLS)
    slab_rows = w_rows  # MXFP4 reads whole slabs of fragment order (16 rows; PAIRED 32)
    if W_FP4 and PAIRED:
        slab_rows = 2 * pid_n * BLOCK_N + 32 * tl.arange(0, W_COLS // 32)
        slab_rows = _real_rows(slab_rows, slab_rows < 2 * N)
    elif W_FP4:
        slab = 16 * tl.arange(0, W_COLS // 16)
        slab_rows = (pid_n * BLOCK_N + slab % BLOCK_N) * gate_row_step + (slab // BLOCK_N) * up_row_offset
        slab_rows = _real_rows(slab_rows, pid_n * BLOCK_N + slab % BLOCK_N < N)
    w_e = w_ptr + e * stride_we
    ws_e = w_scale_ptr + e * stride_wse
    block_rows = pid_n * W_COLS  # W_BLOCKS 1 (_k_step): non-gated, or interleaved pairs, the rows consecutive
    if W_BLOCKS == 2:
        block_rows = (pid_n * BLOCK_N, up_row_offset + pid_n * BLOCK_N)
    if HALF_MMA:
        tl.static_assert(W_BLOCKS == 2, "HALF_MMA: each half of the tile in one block of 128 rows")
        gate_w_rows = _real_rows(gate_rows, col_ok)
        acc_g, acc_u = _k_loop_halves(
            a_ptr, None, a_rows, row_ok, pid_m, stride_am, a_scale_ptr, stride_asm, w_e, ws_e, gate_w_rows,
            gate_w_rows + up_row_offset, col_ok, col_ok, block_rows[0], block_rows[1], K, stride_wn, stride_wsn,
            A_SCALE, W_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, STAGES, w_desc, (2 * e).to(tl.int32),
            (2 * e + 1).to(tl.int32), pid_n * BLOCK_N, pid_n * BLOCK_N, W_TMA, 0, ROW_UNIT)
    else:
        acc = _acc_zeros(BLOCK_M, W_COLS, tl.int32 if ACC_INT else tl.float32, SWAP_AB)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = _a_tile(a_ptr, None, a_rows, row_ok, pid_m, stride_am, k0, ks, k_ok, 0, BLOCK_M, ROW_UNIT)
            acc = _k_step(acc, a, a_scale_ptr, a_rows, row_ok, stride_asm, w_e, ws_e, w_rows, w_ok, slab_rows,
                          stride_wn, stride_wsn, k0, ks, k_ok, K, A_SCALE, W_SCALE, UPCAST_W, W_FP4, PAIRED, W_COLS,
                          BLOCK_K, SWAP_AB, w_desc, tma_e, tma_row, W_TMA, s_desc, block_rows, W_BLOCKS)
    let_next_kernel_launch(PDL)
    if HALF_MMA:
        acc_g, acc_u = _acc_rows_first(acc_g, SWAP_AB), _acc_rows_first(acc_u, SWAP_AB)
    else:
        acc = _acc_rows_first(acc, SWAP_AB)
        if ALTERNATING:
            acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        elif GATED:
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        else:
            acc_g = acc
    b_e = bias_ptr + e * stride_be
    lb_e = lora_b_ptr + e * stride_lbe
    gate = _pre_activation(acc_g, a_scale_ptr, a_rows, row_ok, ws_e, gate_rows, col_ok, stride_wsn, b_e, slot,
                           lora_shrink_ptr, stride_lsm, lb_e, stride_lbn, lora_rank, A_SCALE, W_SCALE, HAS_BIAS,
                           HAS_LORA, LORA_R)
    if GATED:
        up = _pre_activation(acc_u, a_scale_ptr, a_rows, row_ok, ws_e, up_rows, col_ok, stride_wsn, b_e, slot,
                             lora_shrink_ptr, stride_lsm, lb_e, stride_lbn, lora_rank, A_SCALE, W_SCALE, HAS_BIAS,
                             HAS_LORA, LORA_R)
        out = _gated_activation(gate, up, swiglu_limit, swiglu_alpha, ACTIVATION, PTX_MATH, EIGHT_BIT_OUT)
    else:
        out = _activation(gate, ACTIVATION, PTX_MATH, EIGHT_BIT_OUT)
    stored = out.to(out_ptr.dtype.element_ty)
    tile_ok = row_ok[:, None] & col_ok[None, :]
    if SORTED_OUT:
        out_ptrs = out_ptr + _sorted_rows(pid_m, BLOCK_M, ROW_UNIT)[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, tl.where(row_ok[:, None], stored, 0), mask=col_ok[None, :])
    else:
        out_ptrs = out_ptr + slot[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, stored, mask=tile_ok)
    amax = 0.0
    if AMAX:
        amax = _stored_amax(out, out_ptrs, tile_ok, SWAP_AB, AMAX_MASK, AMAX_IN_REGISTERS)
    return amax


@triton.jit
def gemm2_weighted_kernel(
        a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, topk_weights_ptr, out_ptr,
        sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
        num_slots, num_experts, num_m_blocks, N, K,
        stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om,
        A_SCALE: tl.constexpr, W_SCALE: tl.constexpr, UPCAST_W: tl.constexpr, W_FP4: tl.constexpr,
        HAS_BIAS: tl.constexpr, ACC_INT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SWAP_AB: tl.constexpr, lora_shrink_ptr, lora_b_ptr, lora_rank, stride_lsm, stride_lbe, stride_lbn,
        HAS_LORA: tl.constexpr, LORA_R: tl.constexpr, NAIVE: tl.constexpr, PDL: tl.constexpr, w_desc=None,
        W_TMA: tl.constexpr = 0, s_desc=None, W_BLOCKS: tl.constexpr = 0, tiles_ptr=None, TAIL_M: tl.constexpr = 0,
        a_desc=None, A_SORTED: tl.constexpr = 0, HALF_MMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
        PERSISTENT: tl.constexpr = False):
    """GEMM2, one program per tile (gemm2_tile), its K loop pipelined by the launch's num_stages. TAIL_M, tiles_ptr,
    PERSISTENT: as in gemm1_gated_kernel; A_SORTED, a_desc, HALF_MMA: as in gemm2_tile. SPLIT
    (MoEConfig.GEMM2_BLOCK_M): each row tile of the alignment (SPLIT * BLOCK_M rows; a tail tile, at most BLOCK_M
    rows, runs whole in its first part) is SPLIT tiles of BLOCK_M rows; a tile of padding rows alone exits (a run's
    padding follows its rows, so its first row tells)."""
    wait_for_previous_kernel(PDL)
    if PERSISTENT:
        tl.static_assert(not TAIL_M and not NAIVE and SPLIT == 1,
                         "PERSISTENT: whole BLOCK_M tiles of the sorted assignment")
        num_m_real = tl.load(num_post_ptr) // BLOCK_M
        for tile in tl.range(tl.program_id(0), num_m_real * tl.cdiv(N, BLOCK_N), tl.num_programs(0), flatten=True):
            pid_m, pid_n = _tile_coords(tile, num_m_real, N, BLOCK_M, BLOCK_N, GROUP_M)
            gemm2_tile(pid_m, pid_n, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, topk_weights_ptr, out_ptr,
                       sorted_ids_ptr, expert_ids_ptr, num_slots, num_experts, N, K, stride_am, stride_asm,
                       stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om, A_SCALE, W_SCALE, UPCAST_W,
                       W_FP4, HAS_BIAS, ACC_INT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, lora_shrink_ptr, lora_b_ptr,
                       lora_rank, stride_lsm, stride_lbe, stride_lbn, HAS_LORA, LORA_R, NAIVE, PDL, None, w_desc,
                       W_TMA, s_desc, W_BLOCKS, 0, a_desc, A_SORTED, HALF_MMA)
        return
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_m_blocks, N, BLOCK_M, BLOCK_N, GROUP_M)
    block, tail, past = _row_tile(tiles_ptr, num_post_ptr, pid_m // SPLIT, BLOCK_M * SPLIT, TAIL_M, NAIVE)
    # the block gemm2_tile starts at, in units of ROW_UNIT rows, and which expert_ids entry it reads (_block_rows)
    ROW_UNIT: tl.constexpr = TAIL_M if TAIL_M else BLOCK_M
    EXPERT_SPLIT: tl.constexpr = 1 if TAIL_M else SPLIT
    if SPLIT > 1:
        part = pid_m % SPLIT
        if TAIL_M:
            past = past | (tail & (part > 0))
            block = tl.where(tail, block, block + part * (BLOCK_M // TAIL_M))
        else:
            block = pid_m
        past = past | (tl.load(sorted_ids_ptr + block * ROW_UNIT, mask=past == 0, other=num_slots) >= num_slots)
    if past:
        return
    if TAIL_M:  # constexpr: without tail tiles the tail branch is not compiled
        # a_desc's boxes are BLOCK_M rows, so a tail tile reads its rows of a sorted intermediate by address
        TAIL_A_SORTED: tl.constexpr = 1 if A_SORTED else 0
        if tail:
            gemm2_tile(block, pid_n, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, topk_weights_ptr, out_ptr,
                       sorted_ids_ptr, expert_ids_ptr, num_slots, num_experts, N, K, stride_am, stride_asm,
                       stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om, A_SCALE, W_SCALE, UPCAST_W,
                       W_FP4, HAS_BIAS, ACC_INT, TAIL_M, BLOCK_N, BLOCK_K, True, lora_shrink_ptr, lora_b_ptr, lora_rank,
                       stride_lsm, stride_lbe, stride_lbn, HAS_LORA, LORA_R, NAIVE, PDL, None, w_desc, W_TMA, s_desc,
                       W_BLOCKS, TAIL_M, a_desc, TAIL_A_SORTED, HALF_MMA)
            return
    gemm2_tile(block, pid_n, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, topk_weights_ptr, out_ptr,
               sorted_ids_ptr, expert_ids_ptr, num_slots, num_experts, N, K, stride_am, stride_asm,
               stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om, A_SCALE, W_SCALE, UPCAST_W,
               W_FP4, HAS_BIAS, ACC_INT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, lora_shrink_ptr, lora_b_ptr,
               lora_rank, stride_lsm, stride_lbe, stride_lbn, HAS_LORA, LORA_R, NAIVE, PDL, None, w_desc, W_TMA,
               s_desc, W_BLOCKS, TAIL_M, a_desc, A_SORTED, HALF_MMA, EXPERT_SPLIT)


@triton.jit
def gemm2_tile(
        pid_m, pid_n, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, topk_weights_ptr, out_ptr,
        sorted_ids_ptr, expert_ids_ptr,
        num_slots, num_experts, N, K,
        stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om,
        A_SCALE: tl.constexpr, W_SCALE: tl.constexpr, UPCAST_W: tl.constexpr, W_FP4: tl.constexpr,
        HAS_BIAS: tl.constexpr, ACC_INT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SWAP_AB: tl.constexpr, lora_shrink_ptr, lora_b_ptr, lora_rank, stride_lsm, stride_lbe, stride_lbn,
        HAS_LORA: tl.constexpr, LORA_R: tl.constexpr, NAIVE: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr,
        w_desc, W_TMA: tl.constexpr, s_desc, W_BLOCKS: tl.constexpr = 0, ROW_UNIT: tl.constexpr = 0, a_desc=None,
        A_SORTED: tl.constexpr = 0, HALF_MMA: tl.constexpr = False, SPLIT: tl.constexpr = 1):
    """out[slot, n] = topk_weight[slot] * (inter[slot] . w[e, n] + bias[e, n] + LoRA delta) for n < N = H.

    W_TMA 2: the weight tiles are TMA copies of w_desc's [1, BLOCK_N, BLOCK_K] boxes (gemm1_tile). STAGES, pid_m,
    pid_n, W_BLOCKS (0 or 1), ROW_UNIT: as in gemm1_tile. A_SORTED: the intermediate's rows are the slots' (0), or in
    aligned-row order (gemm1_tile's SORTED_OUT), the tile's A then one box of rows read by address (1) or as a TMA
    copy of a_desc's [BLOCK_M, BLOCK_K] box (2); its padding rows hold zeros, so the box needs no row mask.
    HALF_MMA (block scaling; _k_loop_halves): the tile's two column halves, each in one block of 128 rows, are two
    MMAs per K step, each promoted into its own accumulator. SPLIT: as in _block_rows."""
    slot, row_ok, e = _block_rows(sorted_ids_ptr, expert_ids_ptr, pid_m, num_slots, num_experts, BLOCK_M, NAIVE,
                                  ROW_UNIT, SPLIT)
    w_e = w_ptr + e * stride_we
    ws_e = w_scale_ptr + e * stride_wse
    if HALF_MMA:
        HALF_N: tl.constexpr = BLOCK_N // 2
        first = pid_n * BLOCK_N
        cols = first + tl.arange(0, HALF_N)
        col_ok, col_ok2 = cols < N, cols + HALF_N < N
        acc, acc2 = _k_loop_halves(
            a_ptr, a_desc, slot, row_ok, pid_m, stride_am, a_scale_ptr, stride_asm, w_e, ws_e,
            _real_rows(cols, col_ok), _real_rows(cols + HALF_N, col_ok2), col_ok, col_ok2, first, first + HALF_N, K,
            stride_wn, stride_wsn, A_SCALE, W_SCALE, BLOCK_M, HALF_N, BLOCK_K, SWAP_AB, STAGES, w_desc,
            e.to(tl.int32), e.to(tl.int32), first, first + HALF_N, W_TMA, A_SORTED, ROW_UNIT)
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_rows = _real_rows(cols, col_ok)
        slab_rows = w_rows
        if W_FP4:
            slab_rows = pid_n * BLOCK_N + 16 * tl.arange(0, BLOCK_N // 16)
            slab_rows = _real_rows(slab_rows, slab_rows < N)
        acc = _acc_zeros(BLOCK_M, BLOCK_N, tl.int32 if ACC_INT else tl.float32, SWAP_AB)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = _a_tile(a_ptr, a_desc, slot, row_ok, pid_m, stride_am, k0, ks, k_ok, A_SORTED, BLOCK_M, ROW_UNIT)
            acc = _k_step(acc, a, a_scale_ptr, slot, row_ok, stride_asm, w_e, ws_e, w_rows, col_ok, slab_rows,
                          stride_wn, stride_wsn, k0, ks, k_ok, K, A_SCALE, W_SCALE, UPCAST_W, W_FP4, False, BLOCK_N,
                          BLOCK_K, SWAP_AB, w_desc, e.to(tl.int32), pid_n * BLOCK_N, W_TMA, s_desc, pid_n * BLOCK_N,
                          W_BLOCKS)
    let_next_kernel_launch(PDL)
    _gemm2_epilogue(acc, cols, col_ok, slot, row_ok, e, a_scale_ptr, ws_e, bias_ptr, topk_weights_ptr, out_ptr,
                    stride_wsn, stride_be, stride_om, lora_shrink_ptr, stride_lsm, lora_b_ptr, stride_lbe, stride_lbn,
                    lora_rank, A_SCALE, W_SCALE, HAS_BIAS, HAS_LORA, LORA_R, SWAP_AB)
    if HALF_MMA:
        _gemm2_epilogue(acc2, cols + HALF_N, col_ok2, slot, row_ok, e, a_scale_ptr, ws_e, bias_ptr, topk_weights_ptr,
                        out_ptr, stride_wsn, stride_be, stride_om, lora_shrink_ptr, stride_lsm, lora_b_ptr,
                        stride_lbe, stride_lbn, lora_rank, A_SCALE, W_SCALE, HAS_BIAS, HAS_LORA, LORA_R, SWAP_AB)


@triton.jit
def _gemm2_epilogue(acc, cols, col_ok, slot, row_ok, e, a_scale_ptr, ws_e, bias_ptr, topk_weights_ptr, out_ptr,
                    stride_wsn, stride_be, stride_om, lora_shrink_ptr, stride_lsm, lora_b_ptr, stride_lbe, stride_lbn,
                    lora_rank, A_SCALE: tl.constexpr, W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_LORA: tl.constexpr, LORA_R: tl.constexpr, SWAP_AB: tl.constexpr):
    """Stores topk_weight[slot] * (acc, scaled, + bias + LoRA delta) at out[slot, cols]."""
    out = _epilogue_scale(_acc_rows_first(acc, SWAP_AB), a_scale_ptr, slot, row_ok, ws_e, cols, col_ok, stride_wsn,
                          A_SCALE, W_SCALE)
    if HAS_BIAS:
        out += tl.load(bias_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        out += _lora_delta(lora_shrink_ptr, stride_lsm, slot, row_ok, lora_b_ptr + e * stride_lbe, cols, col_ok,
                           stride_lbn, lora_rank, LORA_R)
    out = out * tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + slot[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
