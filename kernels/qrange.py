"""The quantised ranges and the dynamic-scale rule every quantiser shares: the torch ones (quantize.py) and
the Triton ones (triton/quant.py, triton/batched.py). It imports nothing of ours, so each of them can import
it without the quantisers importing one another.
"""

from __future__ import annotations

import torch

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
INT8_MAX = 127.0
# Keeps an all-zero group from producing a zero scale (and then 0/0 on quantisation).
MIN_SCALE = 1e-10


def qmax(dtype: torch.dtype) -> float:
    if dtype == torch.float8_e4m3fn:
        return FP8_MAX
    if dtype == torch.int8:
        return INT8_MAX
    raise ValueError(f"no quantised range for dtype {dtype}")


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dynamic scale: the amax maps to the largest quantised value."""
    return (amax.float() / qmax(dtype)).clamp_min(MIN_SCALE)
