"""Programmatic dependent launch (sm_90+): a kernel of the forward is launched while the one before it still runs.

Each such kernel, on entry, lets the next kernel launch (`griddepcontrol.launch_dependents`) and then waits until the
kernel before it has finished and its writes are visible (`griddepcontrol.wait`), before it reads or writes
anything. The next kernel's programs are thus placed on the SMs while this one's last programs run, and start
working the moment it ends: the launch gap and program start-up between two kernels are hidden, while the order
of every memory access stays that of two plain launches (a kernel can only launch once every program of the one
before has started, so waiting programs never hold SMs that unstarted programs of that kernel need). H200, whole
forward at M=1: 1.1-2.5% faster over GEMM1 -> GEMM2 -> top-k sum (bench/results/s31).

Off sm_90 (and in the interpreter) the flag is off and the kernels launch as before.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def dependent_launch_entry(PDL: tl.constexpr):
    """The first statement of a kernel launched with `pdl_kwargs`: free the next launch, then wait for the last."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def pdl_kwargs(device: torch.device) -> dict:
    """Launch keywords of a kernel that starts with `dependent_launch_entry`: on for CUDA devices of sm_90 and up."""
    on = device.type == "cuda" and _sm90_or_later(device.index or 0)
    return dict(PDL=on, launch_pdl=on)


@functools.lru_cache(maxsize=None)
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)
