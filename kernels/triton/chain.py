"""The whole decode MoE in one launch (MoEConfig.CHAIN): GEMM1's tiles, GEMM2's tiles and the top-k sum, chained.

At decode sizes each of the three launches of the fused MoE spends much of its time ramping up and draining, and
each waits for the whole launch before it: at Qwen3-30B-A3B M=1 on the H200 GEMM1 took 16.6 us, GEMM2 9.8, the top-k
sum 2.1, and about 7.5 us of the 36.0 us forward fell between and around them (bench/results/s36). Here one grid
runs them all:

- Each program takes a ticket (an atomic counter), not its program id, as its place in the order: the first
  tickets are GEMM1's tiles, slot by slot, the rest GEMM2's. A ticket is only handed to a running program, so every
  GEMM1 tile is running or done before any GEMM2 tile can wait on one: waiting never holds up the work it waits
  for, however many programs the GPU keeps resident.
- A GEMM1 tile stores its piece of the slot's intermediate and counts itself done on the slot's counter (release).
  A GEMM2 tile waits (acquire) only for its own slot's GEMM1 tiles, then runs as in its own launch, with the
  config's gemm2 tile: the GEMMs keep their own tile shapes (the one-launch fusion of session 38, GEMM2 split along
  I inside GEMM1's tiles, read w2 in 64-128 byte runs and was slower everywhere).
- The GEMM2 tile that completes a token's columns last (a counter per token and column block) sums the token's k
  slot rows there in fp32 in slot order and rounds once: the bits of topk_sum.py's kernel.
- The program that finishes last zeroes the counters, so the next launch finds them as the first did.

Schemes whose intermediate GEMM2 reads as GEMM1 wrote it (no activation quantisation), under the naive assignment
(align.py: one slot per block), without LoRA or TMA copies (config._check_chain and launch.chained_moe refuse the
rest).

Measured on the H200 (bench/results/s39, whole forward): 0.92-0.97x of the three launches at every M=1 point, where
every slot finishes at about the same time and the ticket and finish atomics add 2.4-3.8 us; 1.11x at Qwen3-30B-A3B
bf16 M=4, where the tiles outnumber what is resident and early slots' GEMM2 tiles run while later slots' GEMM1 tiles
stream. So the tuned files choose it per M.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_moe import _tile_coords, gemm1_tile, gemm2_tile
from .pdl import wait_for_previous_kernel
from .topk_sum import sum_token_columns

# The counters' layout in the int32 sync buffer (launch.chain_sync_buffer): [ticket, finished, slot done ...,
# token column blocks arrived ...].
TICKET, FINISHED, SLOT_DONE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _wait_at_least(counter_ptr, target):
    """Spin until *counter_ptr >= target, with acquire order: what was released before it got there is visible.
    (Measured on the H200 against this, and not kept: polling by acquire loads after a nanosleep, 0.98x; GEMM2's
    tiles prefetching their weights into L2 while they wait, by bulk copies 0.83-0.96x, by one prefetch per 128-byte
    line 0.74-0.98x: bench/results/s39.)"""
    while tl.atomic_add(counter_ptr, 0, sem="acquire") < target:
        pass


@triton.jit
def chained_moe_kernel(
        x_ptr, w13_ptr, w13_scale_ptr, w13_bias_ptr, inter_ptr, w2_ptr, w2_scale_ptr, w2_bias_ptr,
        topk_weights_ptr, slots_ptr, out_ptr, expert_ids_ptr, sync_ptr, dummy_ptr,
        num_slots, num_experts, H, I, gate_row_step, up_row_offset, swiglu_limit, swiglu_alpha,
        stride_xm, stride_w13e, stride_w13n, stride_w13se, stride_w13sn, stride_b13e,
        stride_w2e, stride_w2n, stride_w2se, stride_w2sn, stride_b2e,
        W_SCALE: tl.constexpr, UPCAST_W: tl.constexpr, W_FP4: tl.constexpr, HAS_BIAS: tl.constexpr,
        ACTIVATION: tl.constexpr, GATED: tl.constexpr, PAIRED: tl.constexpr, TOP_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, SWAP_AB1: tl.constexpr,
        STAGES1: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, SWAP_AB2: tl.constexpr,
        STAGES2: tl.constexpr, PTX_MATH: tl.constexpr, PDL: tl.constexpr):
    """x [T, H] -> out [T, H] through inter [T*k, I] and the weighted slot rows slots [T*k, H] (zeroed where a slot's
    expert is remote), with gemm1_tile's and gemm2_tile's arithmetic; one program per tile of either GEMM.
    STAGES1/2: each GEMM's K-loop depth (None: the launch's, for GEMV rows)."""
    wait_for_previous_kernel(PDL)
    ticket = tl.atomic_add(sync_ptr + TICKET, 1, sem="relaxed")
    gemm1_tiles = num_slots * tl.cdiv(I, BLOCK_N1)
    column_blocks = tl.cdiv(H, BLOCK_N2)
    sum_counters = sync_ptr + SLOT_DONE + num_slots
    if ticket < gemm1_tiles:
        slot, pid_n = _tile_coords(ticket, num_slots, I, BLOCK_M, BLOCK_N1, 1)
        gemm1_tile(slot, pid_n, x_ptr, dummy_ptr, w13_ptr, w13_scale_ptr, w13_bias_ptr, inter_ptr,
                   dummy_ptr, expert_ids_ptr, num_slots, num_experts, I, H, TOP_K, gate_row_step,
                   up_row_offset, stride_xm, 1, stride_w13e, stride_w13n, stride_w13se, stride_w13sn, stride_b13e,
                   I, 0, W_SCALE, UPCAST_W, W_FP4, HAS_BIAS, ACTIVATION, False, BLOCK_M, BLOCK_N1, BLOCK_K1,
                   SWAP_AB1, dummy_ptr, dummy_ptr, 0, 0, 0, 0, GATED, PAIRED, False, 16, swiglu_limit,
                   swiglu_alpha, False, False, True, PDL, PTX_MATH, False, STAGES1, None, 0, None)
        tl.debug_barrier()  # every thread's stores of the tile precede the release
        tl.atomic_add(sync_ptr + SLOT_DONE + slot, 1, sem="release")
    else:
        slot, pid_n = _tile_coords(ticket - gemm1_tiles, num_slots, H, BLOCK_M, BLOCK_N2, 1)
        _wait_at_least(sync_ptr + SLOT_DONE + slot, tl.cdiv(I, BLOCK_N1))
        gemm2_tile(slot, pid_n, inter_ptr, dummy_ptr, w2_ptr, w2_scale_ptr, w2_bias_ptr, topk_weights_ptr,
                   slots_ptr, dummy_ptr, expert_ids_ptr, num_slots, num_experts, H, I, I, 1,
                   stride_w2e, stride_w2n, stride_w2se, stride_w2sn, stride_b2e, H, 0, W_SCALE, UPCAST_W, W_FP4,
                   HAS_BIAS, False, BLOCK_M, BLOCK_N2, BLOCK_K2, SWAP_AB2, dummy_ptr, dummy_ptr, 0, 0, 0, 0, False,
                   16, True, PDL, STAGES2, None, 0, None)
        tl.debug_barrier()  # the slot row's stores precede the arrival
        token = slot // TOP_K
        arrived = tl.atomic_add(sum_counters + token * column_blocks + pid_n, 1, sem="acq_rel")
        if arrived == TOP_K - 1:
            # the rows other programs stored, from L2, after the counter's acquire
            sum_token_columns(slots_ptr, out_ptr, token, pid_n * BLOCK_N2 + tl.arange(0, BLOCK_N2), H, TOP_K, ".cg")
    programs = gemm1_tiles + num_slots * column_blocks
    if tl.atomic_add(sync_ptr + FINISHED, 1, sem="acq_rel") == programs - 1:
        used = SLOT_DONE + num_slots + (num_slots // TOP_K) * column_blocks
        for start in range(0, used, 1024):
            at = start + tl.arange(0, 1024)
            tl.store(sync_ptr + at, 0, mask=at < used)
