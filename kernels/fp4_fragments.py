"""MXFP4 weights in MMA fragment order: the byte layout the Triton GEMMs read without shuffling.

Checkpoint order (weights.py): w [.., N, K/2] uint8, byte (n, k/2) holds k (low nibble) and k + 1 (high).
An Ampere/Hopper bf16 MMA operand held in registers (mma.sync's A, and wgmma's A when the weights are the
MMA's M side: SWAP_AB) gives lane 4g + c of a warp, per 16 rows x 16 of K, rows g and g + 8 at
k = 2c, 2c + 1, 2c + 8, 2c + 9: eight values, four registers of two consecutive k. In checkpoint order those
are eight bytes spread over two rows, read one byte at a time (sm_90: 64 LDS.U8 per 128-row x 128-K step of
8 warps).

Fragment order puts each lane's eight values in one 32-bit word, decoded by `fused_moe._e2m1_unpack*` (four
low nibbles, then four high nibbles, one bf16x2 register per two bytes) straight into those four registers:

  rows in slabs of 16 (n = 16 s + 8 h + g), K in MX groups of 32 (k = 32 b + 16 j + 8 q + 2 c + p);
  slab s, group b is 256 bytes at byte 256 b of the slab's 16 rows (the checkpoint rows 16 s .. 16 s + 15,
  so strides, slicing by expert and the tensor's shape are unchanged), lane 4 g + c at byte 8 (4 g + c) of
  it, word j at 4 j of that, byte 2 h + p of the word: low nibble k with q = 0, high nibble q = 1.

Each lane reads 4 bytes per 16 of K per slab, contiguous over the K step (LDS.64 per group), and the
decode's outputs are the MMA's registers in order.

Paired (`pairs=True`, gpt-oss's w13, whose rows interleave gate and up: gate0, up0, gate1, ...): the kernel's
tile holds BLOCK_N gate rows, then the BLOCK_N up rows of the same columns, so one MMA fragment's rows g and
g + 8 are columns g and g + 8, each a gate and an up row. Slabs are then 32 rows (16 columns,
n = 32 s + 2 (8 h + g) + u) and lane 4 g + c holds 16 bytes per group: word 2 u + j, its bytes as above
(a 512-byte run per slab and group).

Measured on the H200 (bench/results/s28 e.), with triton_kernels' 4-warp tile shape (weights on wgmma's M side,
128-deep K steps) the MXFP4 default: the whole forward 1.11-1.32x faster at M >= 16 than checkpoint order with
its own best tiles in session 27 (another call), 0.90x at M=1 (GEMV rows); triton_kernels / ours 0.853 -> 1.006
geomean. As the MMA's B operand (weights on the N side) the layout ran 2-3x slower, so every MXFP4 tile runs
swapped (`launch.fragment_tiles`).

Scales (e8m0 [.., N, K/32]) follow their slabs: per slab, group-major (the slab's 16 or 32 row bytes of group 0,
then of group 1, ...), same shape, so one K step of a tile reads one contiguous run per slab, which Triton
pipelines with the values (row-major, each step's scales were 4 synchronous byte loads per K step on sm_90).
Measured against row-major scales (H200, bench/results/s29): on the old tiles 1.12-1.21x faster at M=2048/4096
(gpt-oss-20b M=4096 level), level at M=16-256, 0.91x at M=1; retuned, triton_kernels / ours 1.006 -> 1.119
geomean, M=1 0.97-0.98x of row-major.

The layout needs whole slabs and MX groups (`fits`). A kernel tile of it reads whole slabs
(`fused_moe._fp4_fragment_tile`).
"""

from __future__ import annotations

import torch

from .mx import MX_GROUP

# `MoEWeights.fp4_fragment_order`: how w13 is held (w2 always in ROWS): plain slabs, or PAIRS of gate/up rows.
ROWS, PAIRS = "rows", "pairs"
SLAB = 16                          # rows per slab: one MMA fragment's rows (paired: their 16 columns' 32 rows)
# Checkpoint nibbles [.., slabs, h, g, (u,) groups, j, q, c, p] -> fragment [.., slabs, groups, g, c, (u,) j, h, p, q]
# (indices into the trailing dims; q is the nibble, p the byte's place in a k pair, u gate/up).
_TO_FRAGMENTS = {False: (0, 3, 2, 6, 4, 1, 7, 5), True: (0, 4, 2, 7, 3, 5, 1, 8, 6)}


def fits(rows: int, k: int, *, pairs: bool = False) -> bool:
    """True when [rows, k] weights can be held in fragment order (whole slabs and MX groups)."""
    return rows % (2 * SLAB if pairs else SLAB) == 0 and k % MX_GROUP == 0


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[.., N, K/2] bytes -> [.., N, K/2, 2] nibbles (k even, k odd)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1)


def _rows(pairs: bool) -> tuple[int, ...]:
    return (2, 8, 2) if pairs else (2, 8)          # (h, g, u) or (h, g) within a slab


def to_fragment_order(packed: torch.Tensor, *, pairs: bool = False) -> torch.Tensor:
    """Checkpoint-order packed e2m1 [.., N, K/2] (uint8) -> the same values in fragment order, same shape."""
    *lead, rows, half_k = packed.shape
    if not fits(rows, 2 * half_k, pairs=pairs):
        raise ValueError(f"fragment order{' (paired)' if pairs else ''} needs whole {2 * SLAB if pairs else SLAB}-row "
                         f"slabs and K % {MX_GROUP} == 0, got [{rows}, {2 * half_k}]")
    slab_rows = _rows(pairs)
    v = _nibbles(packed).reshape(*lead, -1, *slab_rows, 2 * half_k // MX_GROUP, 2, 2, 4, 2)
    b = len(lead)
    v = v.permute(*range(b), *(b + d for d in _TO_FRAGMENTS[pairs]))
    v = v.reshape(*lead, rows, half_k, 2)                          # each (slab, group) run; the nibble last
    return (v[..., 0] | (v[..., 1] << 4)).contiguous()


def to_checkpoint_order(fragments: torch.Tensor, *, pairs: bool = False) -> torch.Tensor:
    """The inverse of `to_fragment_order`."""
    *lead, rows, half_k = fragments.shape
    order = _TO_FRAGMENTS[pairs]
    checkpoint_shape = (-1, *_rows(pairs), 2 * half_k // MX_GROUP, 2, 2, 4, 2)
    v = _nibbles(fragments).reshape(*lead, *(checkpoint_shape[d] for d in order))
    b = len(lead)
    v = v.permute(*range(b), *(b + order.index(d) for d in range(len(order))))
    v = v.reshape(*lead, rows, half_k, 2)
    return (v[..., 0] | (v[..., 1] << 4)).contiguous()


def _slab_rows(pairs: bool) -> int:
    return 2 * SLAB if pairs else SLAB


def scales_to_fragment_order(scales: torch.Tensor, *, pairs: bool = False) -> torch.Tensor:
    """e8m0 scales [.., N, K/32] -> the same values group-major within each slab of rows, same shape."""
    *lead, rows, groups = scales.shape
    r = _slab_rows(pairs)
    return scales.reshape(*lead, rows // r, r, groups).transpose(-1, -2).contiguous().reshape(scales.shape)


def scales_to_checkpoint_order(scales: torch.Tensor, *, pairs: bool = False) -> torch.Tensor:
    """The inverse of `scales_to_fragment_order`."""
    *lead, rows, groups = scales.shape
    r = _slab_rows(pairs)
    return scales.reshape(*lead, rows // r, groups, r).transpose(-1, -2).contiguous().reshape(scales.shape)
