"""Sort (token, slot) pairs by expert and pad each expert's run to BLOCK_M ("moe_align").

Outputs, for T = M*k slots:
  sorted_ids [num_blocks*BLOCK_M]: slot indices grouped by expert, each run padded with the
      sentinel T; the order inside a run is whatever the atomics give (each output row of the
      GEMMs depends only on its own row, so results do not depend on it).
  expert_ids [num_blocks]: the expert of each BLOCK_M block.
  num_post_padded [1]: rows actually used, on the device (no host sync; GEMM programs past it exit).

With tail tiles (`tail_m`), blocks are tail_m rows and the GEMMs run tiles of block_m rows: an expert's rows fill
whole block_m tiles, and a remainder of at most tail_m rows takes one tile of tail_m rows instead of a padded block_m
one (a larger remainder still pads to block_m). Each run is padded to that, and
  tiles [max_blocks(T, E, block_m)]: per tile, 2 * (its first block) + 1 if it is a tail_m tile; -1 past the end.
An expert's tiles are consecutive, so the GEMMs' grouped order runs a tail tile beside its expert's full tiles and
both read the expert's weights through L2 in one launch. Uniform routing pads DeepSeek-V3 at M=4096 to 1.50x its
rows at block_m 128 (each expert ~128 +- 11 rows) and gpt-oss-120b to 1.46x; session 31 found a second launch for
the tails slower (0.75-0.97x) because it read the weights again (bench/results/s31 a.).

Ids outside [0, E) are dropped rather than indexed with: their slots get no row, so their
contribution is unspecified but no memory outside the buffers is touched. The host-side
check in `routing.validate_topk` reports them wherever a sync is allowed.

Tiny batches (4*T <= E, as in vLLM's naive assignment, fused_moe.py:1570-1579) skip sorting and launch nothing:
block b is slot b alone and its expert is topk_ids[b], which the GEMMs read themselves (`Alignment.naive`). The
naive-assignment kernel this replaced took 1.0-1.9 us of each decode forward on the H200 (bench/results/s31).
Small ones (T <= _ONE_PROGRAM_SLOTS) are aligned by one program in one launch; larger ones take a zeroing
memset and four grid-wide launches (count, run offsets, block experts, scatter). At decode sizes every
launch costs about as much as its work: Qwen3-30B-A3B at M=16 went from 16 to 12 launches per FP8 forward
and ran 1.03x faster on the H100 (bench/results/decode_align).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .pdl import dependent_launch_entry, pdl_kwargs

# Blocks whose expert ids one program writes; each compares them against all E run ends.
_BLOCKS_PER_PROGRAM = 64
_SLOTS_PER_PROGRAM = 1024
# Slots and experts one program aligns alone (its [slots] ids and [experts] histogram stay in registers).
_ONE_PROGRAM_SLOTS = 1024
_ONE_PROGRAM_EXPERTS = 1024


@dataclass
class Alignment:
    """sorted_ids and num_post_padded are None under the naive assignment; expert_ids is then the flattened top-k
    ids, one block per slot (ids outside [0, E) give their block no row). block_m: the rows of a GEMM tile; tail_m
    (0: none) the rows of a tail tile and then of a block, with `tiles` the tile table (module docstring)."""
    sorted_ids: Optional[torch.Tensor]
    expert_ids: torch.Tensor
    num_post_padded: Optional[torch.Tensor]
    block_m: int
    tail_m: int = 0
    tiles: Optional[torch.Tensor] = None

    @property
    def num_blocks(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def block_rows(self) -> int:
        """Rows of each block of sorted_ids / expert_ids."""
        return self.tail_m or self.block_m

    @property
    def num_tiles(self) -> int:
        """Row tiles the GEMMs launch (some past the end exit at once)."""
        return self.num_blocks if self.tiles is None else self.tiles.shape[0]

    @property
    def naive(self) -> bool:
        return self.sorted_ids is None

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sorted_ids, expert_ids, num_post_padded) as the kernels take them: under the naive assignment, which
        reads neither, expert_ids stands in for the other two."""
        if self.naive:
            return self.expert_ids, self.expert_ids, self.expert_ids
        return self.sorted_ids, self.expert_ids, self.num_post_padded


@triton.jit
def _load_ids(topk_ids_ptr, num_slots, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(topk_ids_ptr + offs, mask=offs < num_slots, other=-1)
    valid = (offs < num_slots) & (e >= 0) & (e < num_experts)
    return offs, tl.where(valid, e, 0), valid


@triton.jit
def _count_kernel(topk_ids_ptr, counts_ptr, num_slots, num_experts, BLOCK: tl.constexpr, PDL: tl.constexpr):
    dependent_launch_entry(PDL)
    _, e, valid = _load_ids(topk_ids_ptr, num_slots, num_experts, BLOCK)
    tl.atomic_add(counts_ptr + e, 1, mask=valid)


@triton.jit
def _padded(counts, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr):
    """Each run's rows padded: to a multiple of BLOCK_M; with tail tiles (TILE_M > BLOCK_M = tail_m), to whole TILE_M
    tiles, a remainder of at most BLOCK_M rows to BLOCK_M."""
    if TILE_M:
        full = counts // TILE_M * TILE_M
        rest = counts - full
        padded = full + tl.where(rest > BLOCK_M, TILE_M, tl.where(rest > 0, BLOCK_M, 0))
    else:
        padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    return padded


@triton.jit
def _tile_table(padded, ends, t, tiles_ptr, num_tiles, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr):
    """tiles[t] for the tiles t (module docstring), from each run's padded rows and end row."""
    per_run = tl.cdiv(padded, TILE_M)
    tile_ends = tl.cumsum(per_run, 0)
    j = t[:, None] - (tile_ends - per_run)[None, :]  # t's index among each run's tiles
    mine = (j >= 0) & (t[:, None] < tile_ends[None, :])  # one run at most holds tile t
    first_row = (ends - padded)[None, :] + j * TILE_M
    code = (first_row // BLOCK_M) * 2 + (first_row + TILE_M > ends[None, :]).to(tl.int32)
    code = tl.sum(tl.where(mine, code, 0), axis=1) - (tl.max(mine.to(tl.int32), axis=1) == 0).to(tl.int32)
    tl.store(tiles_ptr + t, code, mask=t < num_tiles)


@triton.jit
def _run_offsets_kernel(counts_ptr, cursor_ptr, block_ends_ptr, num_post_ptr, num_experts,
                        BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    dependent_launch_entry(PDL)
    e = tl.arange(0, BLOCK_E)
    mask = e < num_experts
    padded = _padded(tl.load(counts_ptr + e, mask=mask, other=0), BLOCK_M, TILE_M)
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + e, ends - padded, mask=mask)
    tl.store(block_ends_ptr + e, ends // BLOCK_M, mask=mask)
    tl.store(num_post_ptr, tl.sum(padded, 0))


@triton.jit
def _block_experts(block_ends, b, expert_ids_ptr, sorted_ids_ptr, num_blocks, sentinel, BLOCK_M: tl.constexpr):
    """Expert of each block b = number of runs ending at or before it; also sentinel-fills its rows."""
    expert = tl.sum((block_ends[None, :] <= b[:, None]).to(tl.int32), axis=1)
    tl.store(expert_ids_ptr + b, expert, mask=b < num_blocks)
    rows = b[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids_ptr + rows, tl.full(rows.shape, sentinel, tl.int32), mask=(b < num_blocks)[:, None])


@triton.jit
def _one_program_align_kernel(topk_ids_ptr, cursor_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, tiles_ptr,
                              num_slots, num_experts, num_blocks, num_tiles, BLOCK_M: tl.constexpr,
                              TILE_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                              BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """The whole alignment of up to BLOCK_T slots: histogram, run offsets, block experts (and the tile table), then
    the scatter."""
    dependent_launch_entry(PDL)
    slot, e, valid = _load_ids(topk_ids_ptr, num_slots, num_experts, BLOCK_T)
    padded = _padded(tl.histogram(e, BLOCK_E, mask=valid), BLOCK_M, TILE_M)
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + tl.arange(0, BLOCK_E), ends - padded)
    tl.store(num_post_ptr, tl.sum(padded, 0))
    block_ends = tl.where(tl.arange(0, BLOCK_E) < num_experts, ends // BLOCK_M, 2147483647)
    for b0 in range(0, num_blocks, BLOCKS):
        _block_experts(block_ends, b0 + tl.arange(0, BLOCKS), expert_ids_ptr, sorted_ids_ptr, num_blocks,
                       num_slots, BLOCK_M)
    if TILE_M:
        for t0 in range(0, num_tiles, BLOCKS):
            _tile_table(padded, ends, t0 + tl.arange(0, BLOCKS), tiles_ptr, num_tiles, BLOCK_M, TILE_M)
    tl.debug_barrier()  # the cursors and the sentinel fill reach every thread of the program before the scatter
    pos = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
    tl.store(sorted_ids_ptr + pos, slot, mask=valid)


@triton.jit
def _block_experts_kernel(block_ends_ptr, expert_ids_ptr, sorted_ids_ptr, counts_ptr, tiles_ptr, num_blocks,
                          num_tiles, num_experts, sentinel, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr,
                          BLOCKS: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """Blocks (and, with tail tiles, tiles; never more than blocks) BLOCKS * program ... + BLOCKS - 1."""
    dependent_launch_entry(PDL)
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(block_ends_ptr + e, mask=e < num_experts, other=2147483647)
    first = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    _block_experts(ends, first, expert_ids_ptr, sorted_ids_ptr, num_blocks, sentinel, BLOCK_M)
    if TILE_M:
        padded = _padded(tl.load(counts_ptr + e, mask=e < num_experts, other=0), BLOCK_M, TILE_M)
        _tile_table(padded, tl.cumsum(padded, 0), first, tiles_ptr, num_tiles, BLOCK_M, TILE_M)


@triton.jit
def _scatter_kernel(topk_ids_ptr, cursor_ptr, sorted_ids_ptr, num_slots, num_experts, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    dependent_launch_entry(PDL)
    slot, e, valid = _load_ids(topk_ids_ptr, num_slots, num_experts, BLOCK)
    pos = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
    tl.store(sorted_ids_ptr + pos, slot, mask=valid)


def use_naive_assignment(num_slots: int, num_experts: int) -> bool:
    return num_slots * 4 <= num_experts


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound on blocks: each non-empty expert adds at most one partly filled block."""
    if use_naive_assignment(num_slots, num_experts):
        return num_slots
    return min(num_slots, triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m))


def moe_align(topk_ids: torch.Tensor, *, num_experts: int, block_m: int, tail_m: int = 0) -> Alignment:
    """topk_ids' slots sorted by expert into runs padded for tiles of block_m rows, and tail_m-row tails if tail_m
    (module docstring; a power of two from 16 below block_m, config.check_config). The naive assignment has no
    tails."""
    ids = topk_ids.reshape(-1)
    T, dev = ids.numel(), ids.device
    if T and use_naive_assignment(T, num_experts):
        return Alignment(sorted_ids=None, expert_ids=ids.contiguous(), num_post_padded=None, block_m=block_m)
    num_tiles = max_blocks(T, num_experts, block_m)
    rows = tail_m or block_m
    nb = num_tiles * block_m // rows  # padding to tiles never exceeds padding to block_m
    sorted_ids = torch.empty(nb * rows, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(nb, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    tiles = torch.empty(num_tiles, dtype=torch.int32, device=dev) if tail_m else None
    tile_args = dict(BLOCK_M=rows, TILE_M=block_m if tail_m else 0)
    pdl = pdl_kwargs(dev)
    if T == 0:
        num_post.zero_()
        if tiles is not None:
            tiles.fill_(-1)
    elif T <= _ONE_PROGRAM_SLOTS and num_experts <= _ONE_PROGRAM_EXPERTS:
        block_e = triton.next_power_of_2(num_experts)
        cursor = torch.empty(block_e, dtype=torch.int32, device=dev)
        _one_program_align_kernel[(1,)](ids, cursor, sorted_ids, expert_ids, num_post, _or(tiles, expert_ids), T,
                                        num_experts, nb, num_tiles, **tile_args,
                                        BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_E=block_e,
                                        BLOCKS=_BLOCKS_PER_PROGRAM, **pdl)
    else:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
        cursor = torch.empty_like(counts)
        block_ends = torch.empty_like(counts)
        block_e = triton.next_power_of_2(num_experts)
        slot_grid = (triton.cdiv(T, _SLOTS_PER_PROGRAM),)
        _count_kernel[slot_grid](ids, counts, T, num_experts, BLOCK=_SLOTS_PER_PROGRAM, **pdl)
        _run_offsets_kernel[(1,)](counts, cursor, block_ends, num_post, num_experts, **tile_args, BLOCK_E=block_e,
                                  **pdl)
        _block_experts_kernel[(triton.cdiv(nb, _BLOCKS_PER_PROGRAM),)](
            block_ends, expert_ids, sorted_ids, counts, _or(tiles, expert_ids), nb, num_tiles, num_experts, T,
            **tile_args, BLOCKS=_BLOCKS_PER_PROGRAM, BLOCK_E=block_e, **pdl)
        _scatter_kernel[slot_grid](ids, cursor, sorted_ids, T, num_experts, BLOCK=_SLOTS_PER_PROGRAM, **pdl)
    return Alignment(sorted_ids=sorted_ids, expert_ids=expert_ids, num_post_padded=num_post, block_m=block_m,
                     tail_m=tail_m, tiles=tiles)


def _or(tensor: Optional[torch.Tensor], stand_in: torch.Tensor) -> torch.Tensor:
    """A pointer argument the kernel reads only when `tensor` is set."""
    return stand_in if tensor is None else tensor
