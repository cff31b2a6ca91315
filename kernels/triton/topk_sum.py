"""The last step of the fused MoE: each token's k weighted expert outputs [T, k, H] summed into [T, H].

One program per (token, H chunk) adds the k rows in fp32 and rounds once, as torch's sum over dim 1 does. torch's
reduction kernel for that took 2.6-5.6 us at decode sizes on the H200 (Qwen3-30B-A3B M=1: 4.9 us of a 39.6 us
forward; bench/results/s31), several times what one small launch costs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import dependent_launch_entry, pdl_kwargs

# Columns per program: one 16-byte load per thread of 4 warps in bf16; larger H takes several programs per token.
_BLOCK_H = 1024


@triton.jit
def sum_token_columns(src_ptr, out_ptr, t, cols, H, TOP_K: tl.constexpr, CACHE: tl.constexpr):
    """out[t, cols] = the fp32 sum of token t's TOP_K slot rows of src there, in slot order, rounded once (the bits
    of torch's sum over dim 1). CACHE: the loads' cache modifier (".cg" reads rows other programs stored from L2)."""
    ok = cols < H
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(src_ptr + (t * TOP_K + j) * H + cols, mask=ok, other=0.0, cache_modifier=CACHE).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _topk_sum_kernel(src_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    dependent_launch_entry(PDL)
    sum_token_columns(src_ptr, out_ptr, tl.program_id(0).to(tl.int64),
                      tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H), H, TOP_K, "")


def topk_sum(slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """slots [T * top_k, H] (contiguous, each token's rows adjacent) -> [T, H], same dtype."""
    rows, H = slots.shape
    T = rows // top_k
    out = torch.empty(T, H, dtype=slots.dtype, device=slots.device)
    block_h = min(_BLOCK_H, triton.next_power_of_2(H))
    if T:
        _topk_sum_kernel[(T, triton.cdiv(H, block_h))](slots, out, H, TOP_K=top_k, BLOCK_H=block_h,
                                                           **pdl_kwargs(slots.device))
    return out
