"""The bf16 MXFP4 decode's PTX (`fused_moe._e2m1x4_to_bf16_asm`), run by a small PTX emulator on the CPU.

The interpreter cannot run inline PTX, so without this only GPU runs would notice a wrong shift, mask or
operand order. The emulator knows exactly the instructions the decode uses and refuses any other.
"""

from __future__ import annotations

import struct

import pytest
import torch

from moerules.kernels.mx import E8M0_BIAS, E8M0_FOLD_MAX, e2m1_decode
from moerules.kernels.triton.fused_moe import _E2M1X4_TO_BF16, _E2M1X4_TO_BF16_FOLDED

MASK32 = 0xFFFFFFFF


def _bf16_bits_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def _float_to_bf16_bits(value: float) -> int:
    return torch.tensor([value], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32's default mode: byte i of the result is byte (selector nibble i & 7) of b:a, its sign
    replicated when the nibble's bit 3 is set."""
    pool = a | (b << 32)
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (pool >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    halves = []
    for shift in (0, 16):
        x, y, z = (_bf16_bits_to_float((v >> shift) & 0xFFFF) for v in (a, b, c))
        halves.append(_float_to_bf16_bits(x * y + z))   # the products here are exact: powers of two times e2m1
    return halves[0] | (halves[1] << 16)


def run_ptx(asm: str, operands: dict[str, int]) -> dict[str, int]:
    """Execute the decode's PTX on 32-bit registers; `operands` holds the inputs $4..$6, the result $0..$3."""
    regs = dict(operands)

    def value(token: str) -> int:
        return regs[token] if token in regs else int(token, 0) & MASK32

    for statement in asm.replace("{", "").replace("}", "").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, args = statement.split(None, 1)
        dst, *src = [t.strip() for t in args.split(",")]
        x = [value(t) for t in src]
        if op == "mov.b32":
            regs[dst] = x[0]
        elif op == "prmt.b32":
            regs[dst] = _prmt(*x)
        elif op == "shl.b32":
            regs[dst] = (x[0] << x[1]) & MASK32
        elif op == "shr.b32":
            regs[dst] = x[0] >> x[1]           # logical: zeros come in at the top
        elif op == "and.b32":
            regs[dst] = x[0] & x[1]
        elif op == "or.b32":
            regs[dst] = x[0] | x[1]
        elif op == "fma.rn.bf16x2":
            regs[dst] = _fma_bf16x2(*x)
        else:
            raise AssertionError(f"the emulator does not know {op!r}: teach it before the decode uses it")
    return {r: regs[r] for r in ("$0", "$1", "$2", "$3")}


def _scale_operand(scales: tuple[int, int], *, folded: bool) -> int:
    """Two bf16 scale operands in one register, as the kernel passes them: 2^(s - 127), or folded 2^(s - 1)."""
    words = [_float_to_bf16_bits(2.0 ** (s - E8M0_BIAS + (126 if folded else 0))) for s in scales]
    return words[0] | (words[1] << 16)


@pytest.mark.parametrize("folded,scales", [
    (False, (1, 127, 200, 254)),                 # the extremes too: 6 * 2^127 is inf in bf16, as in the reference
    (True, (1, 127, E8M0_FOLD_MAX, 100)),
])
def test_every_byte_decodes_to_its_two_scaled_e2m1_values(folded, scales):
    asm = (_E2M1X4_TO_BF16_FOLDED if folded else _E2M1X4_TO_BF16).value
    for first in range(256):
        data = [(first + i) % 256 for i in range(4)]               # every byte in every position
        out = run_ptx(asm, {"$4": int.from_bytes(bytes(data), "little"),
                            "$5": _scale_operand(scales[:2], folded=folded),
                            "$6": _scale_operand(scales[2:], folded=folded)})
        for half, nibble_shift in (("even", 0), ("odd", 4)):
            codes = torch.tensor([(b >> nibble_shift) & 15 for b in data])
            expected = [_float_to_bf16_bits(v * 2.0 ** (s - E8M0_BIAS))
                        for v, s in zip(e2m1_decode(codes, torch.float64).tolist(), scales)]
            lo, hi = ("$0", "$1") if half == "even" else ("$2", "$3")
            got = [out[lo] & 0xFFFF, out[lo] >> 16, out[hi] & 0xFFFF, out[hi] >> 16]
            assert got == expected, (half, data)


def test_the_fold_limit_is_the_largest_scale_whose_fold_is_a_finite_bf16():
    top = torch.tensor([2.0 ** (E8M0_FOLD_MAX - 1)], dtype=torch.float64).to(torch.bfloat16)
    above = torch.tensor([2.0 ** E8M0_FOLD_MAX], dtype=torch.float64).to(torch.bfloat16)
    assert torch.isfinite(top).all() and torch.isinf(above).all()
