"""fp4_words: the kernel bit order of packed e2m1 words, checked against its own decode terms on every byte."""

from __future__ import annotations

import pytest
import torch

from moerules.kernels.fp4_words import DECODE_TERMS, REGISTER_VALUES, to_checkpoint_order, to_kernel_order

# The decode's 16-bit pattern: m, e0, e1 at bits 6..8, the sign at 15.
FIELD_BITS = (6, 7, 8, 15)


def _rotl(words: torch.Tensor, r: int) -> torch.Tensor:
    return ((words << r) | (words >> (32 - r))) & 0xFFFFFFFF if r else words


def _words(packed: torch.Tensor) -> torch.Tensor:
    b = packed.reshape(-1, 4).long()
    return b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24


def _every_byte_in_every_position() -> torch.Tensor:
    first = torch.arange(256)
    return torch.stack([(first + 37 * i) % 256 for i in range(4)], dim=-1).to(torch.uint8).reshape(1, 256, 4)


def test_every_register_holds_the_checkpoint_nibbles_it_names():
    checkpoint = _every_byte_in_every_position()
    words = _words(to_kernel_order(checkpoint))
    byte = checkpoint.reshape(-1, 4).long()
    for register, terms in enumerate(DECODE_TERMS):
        value = sum(_rotl(words, r) & mask for r, mask in terms)
        for half, (i, nibble) in enumerate(REGISTER_VALUES[register]):
            code = (byte[:, i] >> (4 * nibble)) & 15
            expected = sum(((code >> f) & 1) << bit for f, bit in enumerate(FIELD_BITS))
            assert torch.equal((value >> (16 * half)) & 0xFFFF, expected), (register, half)


def test_the_orders_are_inverse_and_differ():
    packed = torch.randint(0, 256, (3, 5, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    kernel = to_kernel_order(packed)
    assert not torch.equal(kernel, packed) and torch.equal(to_checkpoint_order(kernel), packed)
    assert torch.equal(to_kernel_order(torch.zeros(1, 4, dtype=torch.uint8)), torch.zeros(1, 4, dtype=torch.uint8))


def test_rows_that_are_not_whole_words_are_refused():
    with pytest.raises(ValueError, match=r"a multiple of 4 along K/2; got torch.uint8 \(2, 6\)"):
        to_kernel_order(torch.zeros(2, 6, dtype=torch.uint8))
