"""What the launchers read off the GPU: its name (config files are per device) and its SM count (grid sizes).

Each is a driver call, made once per device, never on every forward. Off CUDA (the interpreter) the name is
"cpu" and the SM count 1, and kernels take their Triton-code paths instead of inline PTX.
"""

from __future__ import annotations

import functools

import torch


def device_name(device: torch.device) -> str:
    return _cuda_name(device.index or 0) if device.type == "cuda" else "cpu"


def ptx_math(device: torch.device) -> dict:
    """The kernels' PTX_MATH flag: their fp32 approximations as inline PTX, which only compiled CUDA code runs."""
    return dict(PTX_MATH=device.type == "cuda")


def sm_count(device: torch.device) -> int:
    return _cuda_sms(device.index or 0) if device.type == "cuda" else 1


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
