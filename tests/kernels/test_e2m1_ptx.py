"""The bf16 MXFP4 decode's PTX (`fused_moe._e2m1x4_to_bf16_asm`), run by a small PTX emulator on the CPU.

The interpreter cannot run inline PTX, so without this only GPU runs would notice a wrong rotation, mask or
operand order. The emulator knows exactly the instructions the decode uses and refuses any other. The decode
reads words in fp4_words' kernel order: every checkpoint word is converted with `to_kernel_order` first and
the values are checked against the checkpoint's nibbles.
"""

from __future__ import annotations

import re
import struct

import pytest
import torch

from moerules.kernels.fp4_words import to_kernel_order
from moerules.kernels.mx import E8M0_BIAS, E8M0_FOLD_MAX, e2m1_decode
from moerules.kernels.triton.fused_moe import _E2M1_WORD_TO_BF16, _E2M1_WORD_TO_BF16_FOLDED

MASK32 = 0xFFFFFFFF


def _bf16_bits_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def _float_to_bf16_bits(value: float) -> int:
    return torch.tensor([value], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    halves = []
    for shift in (0, 16):
        x, y, z = (_bf16_bits_to_float((v >> shift) & 0xFFFF) for v in (a, b, c))
        halves.append(_float_to_bf16_bits(x * y + z))   # the products here are exact: powers of two times e2m1
    return halves[0] | (halves[1] << 16)


def run_ptx(asm: str, operands: dict[str, int]) -> dict[str, int]:
    """Execute the decode's PTX on 32-bit registers; `operands` holds the inputs $8 (word) and $9 (bf16 scale),
    the result the 16-bit outputs $0..$7."""
    regs = dict(operands)

    def value(token: str) -> int:
        return regs[token] if token in regs else int(token, 0) & MASK32

    body = asm.strip()
    assert body[0] == "{" and body[-1] == "}", "the decode is one PTX block"
    for statement in body[1:-1].split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, args = statement.split(None, 1)
        unpack = re.fullmatch(r"\{(\S+), (\S+)\}, (\S+)", args)     # mov.b32 {lo, hi}, whole
        pack = re.fullmatch(r"(\S+), \{(\S+), (\S+)\}", args)       # mov.b32 whole, {lo, hi}
        if op == "mov.b32" and unpack:
            lo, hi, whole = unpack.groups()
            regs[lo], regs[hi] = value(whole) & 0xFFFF, value(whole) >> 16
            continue
        if op == "mov.b32" and pack:
            whole, lo, hi = pack.groups()
            regs[whole] = value(lo) | (value(hi) << 16)
            continue
        dst, *src = [t.strip() for t in args.split(",")]
        x = [value(t) for t in src]
        if op == "mov.b32":
            regs[dst] = x[0]
        elif op == "shf.l.wrap.b32":    # funnel shift of x[1]:x[0] by x[2] mod 32: a rotation when both are one word
            pair, shift = (x[1] << 32) | x[0], x[2] % 32
            regs[dst] = ((pair << shift) >> 32) & MASK32
        elif op == "and.b32":
            regs[dst] = x[0] & x[1]
        elif op == "or.b32":
            regs[dst] = x[0] | x[1]
        elif op == "fma.rn.bf16x2":
            regs[dst] = _fma_bf16x2(*x)
        else:
            raise AssertionError(f"the emulator does not know {op!r}: teach it before the decode uses it")
    return {f"${i}": regs[f"${i}"] for i in range(8)}


@pytest.mark.parametrize("folded,scale", [(False, 1), (False, 127), (False, 254),   # 6 * 2^127 is inf in bf16,
                                          (True, 1), (True, 100), (True, E8M0_FOLD_MAX)])  # as in the reference
def test_every_byte_decodes_to_its_two_scaled_e2m1_values(folded, scale):
    asm = (_E2M1_WORD_TO_BF16_FOLDED if folded else _E2M1_WORD_TO_BF16).value
    operand = _float_to_bf16_bits(2.0 ** (scale - E8M0_BIAS + (126 if folded else 0)))
    for first in range(256):
        data = [(first + 37 * i) % 256 for i in range(4)]          # every byte in every position
        word = to_kernel_order(torch.tensor([[data]], dtype=torch.uint8))[0, 0].tolist()
        out = run_ptx(asm, {"$8": int.from_bytes(bytes(word), "little"), "$9": operand})
        for nibble in (0, 1):                                       # low nibble: even k; high: odd k
            codes = torch.tensor([(b >> (4 * nibble)) & 15 for b in data])
            expected = [_float_to_bf16_bits(v * 2.0 ** (scale - E8M0_BIAS))
                        for v in e2m1_decode(codes, torch.float64).tolist()]
            assert [out[f"${4 * nibble + byte}"] for byte in range(4)] == expected, (nibble, data)


def test_the_fold_limit_is_the_largest_scale_whose_fold_is_a_finite_bf16():
    top = torch.tensor([2.0 ** (E8M0_FOLD_MAX - 1)], dtype=torch.float64).to(torch.bfloat16)
    above = torch.tensor([2.0 ** E8M0_FOLD_MAX], dtype=torch.float64).to(torch.bfloat16)
    assert torch.isfinite(top).all() and torch.isinf(above).all()
