"""Kernel tests run on CPU in CI: Triton kernels then go through the interpreter (enabled in
tests/conftest.py, before anything imports triton). The interpreter computes tl.dot wrongly
for bf16 operands (fp16, fp8 and int8 are right), so every interpreter test of a Triton
kernel uses fp16; bf16 is checked on the GPU by bench/moe.py.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def poison_empty(monkeypatch):
    """Make every torch.empty in the Triton launcher return NaN-filled memory.

    An output element the kernels forget to write then stays NaN and fails the check,
    instead of passing on whatever zeros the allocator happened to return.
    """
    from moerules.kernels.triton import launch

    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    class _Torch:
        def __getattr__(self, name):
            return nan_empty if name == "empty" else getattr(torch, name)

    monkeypatch.setattr(launch, "torch", _Torch())
