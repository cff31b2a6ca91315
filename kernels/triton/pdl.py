"""Programmatic dependent launch (sm_90+): a kernel of the forward is launched while the one before it still runs.

Each such kernel first waits until the kernel before it has finished and its writes are visible
(`griddepcontrol.wait`), before it reads or writes anything; it then lets the next kernel launch
(`griddepcontrol.launch_dependents`): the small kernels at once, the GEMMs after their K loop. The next kernel's
programs are thus placed on the SMs while this one's last programs finish, and start working the moment it ends:
the launch gap and program start-up between two kernels are hidden, while every memory access keeps the order of
two plain launches (a kernel launches only once every program of the one before has got that far or exited, so
waiting programs never hold SMs that unstarted programs of that kernel need).

H200, whole forward, against plain launches in the same process (bench/results/s31 e.): Qwen3-30B-A3B M=1 2.2%
(bf16) and 8.5% (FP8) faster, Mixtral-8x7B FP8 M=1024 4%, gpt-oss-20b MXFP4 M=16 1.5%, level (-1% to +0.3%) at
M=4096. Off sm_90 (and in the interpreter) the flag is off and the kernels launch as before.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """The first statement of a kernel launched with `pdl_kwargs`: nothing before it touches memory."""
    if PDL:
        gdc_wait()


@triton.jit
def let_next_kernel_launch(PDL: tl.constexpr):
    """From here the next kernel may launch (it launches once every program of this one got here or exited).

    The GEMMs call it after their K loop: called on entry, the next kernel's waiting programs sat on the SMs while
    the GEMMs' last programs ran and slowed them (H200: Mixtral-8x7B FP8 M=1024 10%, gpt-oss-20b MXFP4 M=16 9%
    slower than plain launches; bench/results/s31)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def dependent_launch_entry(PDL: tl.constexpr):
    """The first statement of a small kernel launched with `pdl_kwargs`: wait for the last kernel, free the next."""
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)


def pdl_kwargs(device: torch.device) -> dict:
    """Launch keywords of a kernel that starts by waiting for the previous one: on for CUDA devices of sm_90 and up."""
    on = device.type == "cuda" and _sm90_or_later(device.index or 0)
    return dict(PDL=on, launch_pdl=on)


@functools.lru_cache(maxsize=None)
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)
