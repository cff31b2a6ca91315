"""The bit order of packed e2m1 words that the Triton MXFP4 decode reads (`MoEWeights.use_kernel_layout`).

A checkpoint packs two e2m1 values per byte (mx.py: low nibble the even k; nibble bits m, e0, e1, sign), so a
32-bit word holds k .. k+7 of one row. The decode turns each value into a 16-bit pattern with the sign at
bit 15 and (e1 e0 m) at bits 8..6, which reads as bf16 value * 2^-126, exactly (the 2^126 joins the
scale), two values to a 32-bit register:

    register 0: (even k of byte 0, even k of byte 1)    register 2: (odd k of byte 0, odd k of byte 1)
    register 1: (even k of byte 2, even k of byte 3)    register 3: (odd k of byte 2, odd k of byte 3)

(the even values of a word feed one MMA and the odd values another, the order fused_moe's two dots read).
From the checkpoint order a register costs a byte permute, then a shift and a mask per field and an or:
18 logic instructions per word. The kernel order moves the 32 bits of every word once, at build, so that each
register is the word rotated left and masked (`DECODE_TERMS`), one term or two: 9 instructions per word.
No 4 rotations of one mask tile the 32 bits (the mask's bits 6, 7, 8 leave no room), hence the two-term
register. Compiled for sm_90, GEMM1's main loop at BLOCK 16x32x64 fell from 183 to 146 SASS instructions.

Only bits move inside each aligned word of 8 values, so the K-cuts that sharding and padding make (whole MX
groups of 32 values) cut either order alike; what decodes values (the references, other packages' layouts,
checksums) reads `to_checkpoint_order` first.
"""

from __future__ import annotations

import functools

import torch

# The 16-bit pattern's positions of a nibble's bits m, e0, e1, sign.
_FIELD_BITS = (6, 7, 8, 15)
# (byte, nibble) of the low and high half of each decode register: nibble 0 = low = even k.
REGISTER_VALUES = (((0, 0), (1, 0)), ((2, 0), (3, 0)), ((0, 1), (1, 1)), ((2, 1), (3, 1)))
# Per register: the (left rotation, mask) terms whose or is the register: (word rotl r) & mask.
DECODE_TERMS = (((0, 0x81C081C0),), ((4, 0x81C081C0),), ((10, 0x81C081C0),),
                ((6, 0x00400040), (14, 0x81808180)))


def _kernel_bit_sources() -> list[int]:
    """source[q]: the checkpoint bit of a word that the kernel order keeps at bit q."""
    source = [-1] * 32
    for register, halves in enumerate(REGISTER_VALUES):
        for half, (byte, nibble) in enumerate(halves):
            for field, bit in enumerate(_FIELD_BITS):
                out = 16 * half + bit
                rotation = next(r for r, mask in DECODE_TERMS[register] if mask >> out & 1)
                source[(out - rotation) % 32] = 8 * byte + 4 * nibble + field
    assert sorted(source) == list(range(32)), "DECODE_TERMS must move every bit of a word exactly once"
    return source


@functools.lru_cache(maxsize=None)
def _byte_tables(to_kernel: bool, device: torch.device) -> torch.Tensor:
    """[4, 256] int64: what byte i of a word contributes to the word in the other order, per byte value."""
    source = _kernel_bit_sources()
    moves = [(s, q) for q, s in enumerate(source)] if to_kernel else list(enumerate(source))
    values = torch.arange(256, dtype=torch.int64)
    table = torch.zeros(4, 256, dtype=torch.int64)
    for frm, to in moves:
        table[frm // 8] |= ((values >> (frm % 8)) & 1) << to
    return table.to(device)


def _reorder(packed: torch.Tensor, to_kernel: bool) -> torch.Tensor:
    if packed.dtype != torch.uint8 or packed.shape[-1] % 4:
        raise ValueError(f"packed e2m1 words need uint8 bytes, a multiple of 4 along K/2; got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    table = _byte_tables(to_kernel, packed.device)
    out = torch.empty_like(packed)
    for e in range(packed.shape[0]):  # one expert at a time: int64 temporaries of 8x one expert's bytes
        words = packed[e].reshape(-1, 4).long()
        moved = table[0][words[:, 0]] | table[1][words[:, 1]] | table[2][words[:, 2]] | table[3][words[:, 3]]
        out[e] = torch.stack([(moved >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(packed[e].shape)
    return out


def to_kernel_order(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [E, ..., K/2] (checkpoint order) -> the same values in the kernel order (a new tensor)."""
    return _reorder(packed, to_kernel=True)


def to_checkpoint_order(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_kernel_order`."""
    return _reorder(packed, to_kernel=False)
