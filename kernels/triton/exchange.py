"""The all2all exchange's own work on a GPU in three launches: slots, packing, and the combine sum.

The torch expression of the same steps (kernels/ep/all2all.py, used on the CPU) takes about
twenty small launches per dispatch and materialises [T, R, H] copies; at decode batch sizes the
launches are the whole cost, at 8k tokens the extra passes over memory are.

  slots_kernel   one program per destination rank r: whether each token goes to r, its row among
                 r's rows (a running prefix sum over the tokens), the token of each row (-1 for
                 unused rows), and the pairs that overflow the rows per peer (counted on the device).
  pack_kernel    one program per send row: the token's hidden row (copied as raw bits, any dtype)
                 and its routing row (ids renumbered to r's experts, -1 elsewhere; router weights
                 and scales bit-cast to int32); unused rows get zeros and ids -1.
  combine_kernel one program per token: the fp32 sum of its returned partial rows, in rank order.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_BLOCK_T = 1024
_BLOCK_H = 1024
# Bit-exact copies: each dtype read as the integer type of its width.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@triton.jit
def _slots_kernel(ids_ptr, owner_ptr, slot_ptr, row_token_ptr, dropped_ptr, T, C, R,
                  K: tl.constexpr, BLOCK_T: tl.constexpr):
    r = tl.program_id(0)
    carry = tl.sum(tl.zeros((BLOCK_T,), tl.int32), 0)
    dropped = tl.sum(tl.zeros((BLOCK_T,), tl.int32), 0)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = t < T
        goes = tl.zeros((BLOCK_T,), tl.int32)
        for j in tl.static_range(K):
            e = tl.load(ids_ptr + t * K + j, mask=live, other=0)
            goes = tl.maximum(goes, (tl.load(owner_ptr + e, mask=live, other=-1) == r).to(tl.int32))
        pos = carry + tl.cumsum(goes, 0) - 1
        fits = (goes > 0) & (pos < C)
        over = (goes > 0) & (pos >= C)
        slot = tl.where(fits, r * C + pos, tl.where(over, R * C + 1, R * C))
        tl.store(slot_ptr + t * R + r, slot.to(tl.int64), mask=live)
        tl.store(row_token_ptr + r * C + pos, t, mask=fits)
        dropped += tl.sum(over.to(tl.int32), 0)
        carry += tl.sum(goes, 0)
    used = tl.minimum(carry, C)
    for c0 in range(0, C, BLOCK_T):
        c = c0 + tl.arange(0, BLOCK_T)
        tl.store(row_token_ptr + r * C + c, tl.full((BLOCK_T,), -1, tl.int32), mask=(c >= used) & (c < C))
    tl.atomic_add(dropped_ptr, dropped)


@triton.jit
def _pack_kernel(x_ptr, ids_ptr, weights_ptr, scale_ptr, owner_ptr, local_ptr, row_token_ptr, tokens_ptr,
                 routing_ptr, C, H, S, W, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                 HAS_SCALE: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    r = row // C
    t = tl.load(row_token_ptr + row)
    valid = t >= 0
    src = tl.maximum(t, 0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        value = tl.load(x_ptr + src * H + h, mask=(h < H) & valid, other=0)
        tl.store(tokens_ptr + row * H + h, value, mask=h < H)
    j = tl.arange(0, BLOCK_K)
    slots = (j < K) & valid
    e = tl.load(ids_ptr + src * K + j, mask=slots, other=0)
    mine = slots & (tl.load(owner_ptr + e, mask=slots, other=-1) == r)
    local = tl.where(mine, tl.load(local_ptr + e, mask=slots, other=-1), -1).to(tl.int32)
    tl.store(routing_ptr + row * W + j, local, mask=j < K)
    tl.store(routing_ptr + row * W + K + j, tl.load(weights_ptr + src * K + j, mask=slots, other=0), mask=j < K)
    if HAS_SCALE:
        s = tl.arange(0, BLOCK_S)
        scale = tl.load(scale_ptr + src * S + s, mask=(s < S) & valid, other=0)
        tl.store(routing_ptr + row * W + 2 * K + s, scale, mask=s < S)


@triton.jit
def _combine_kernel(back_ptr, slot_ptr, out_ptr, H, R, RC, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_H,), tl.float32)
        for r in range(R):
            s = tl.load(slot_ptr + t * R + r)
            acc += tl.load(back_ptr + s * H + h, mask=(h < H) & (s < RC), other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


def pack_rows(x: torch.Tensor, *, topk_ids: torch.Tensor, topk_weights: torch.Tensor, scale: Optional[torch.Tensor],
              owner: torch.Tensor, local_index: torch.Tensor, ranks: int, rows_per_peer: int,
              dropped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot [T, R] int64, token rows [R*C, H] in x's dtype, routing rows [R*C, 2k + scale columns] int32), as
    All2AllPrepareFinalize lays them out; overflowing pairs are added to `dropped` (int32 [1])."""
    T, H = x.shape
    k = topk_ids.shape[1]
    R, C = ranks, rows_per_peer
    scale_cols = 0 if scale is None else 1 if scale.dim() == 1 else scale.shape[1]
    ids = topk_ids.contiguous()
    slot = torch.empty((T, R), dtype=torch.int64, device=x.device)
    row_token = torch.empty(R * C, dtype=torch.int32, device=x.device)
    _slots_kernel[(R,)](ids, owner, slot, row_token, dropped, T, C, R, K=k, BLOCK_T=_BLOCK_T)
    tokens = torch.empty((R * C, H), dtype=x.dtype, device=x.device)
    routing = torch.empty((R * C, 2 * k + scale_cols), dtype=torch.int32, device=x.device)
    bits = _BITS[x.element_size()]
    scale_bits = routing if scale is None else scale.float().contiguous().view(torch.int32)
    _pack_kernel[(R * C,)](x.contiguous().view(bits), ids, topk_weights.float().contiguous().view(torch.int32),
                           scale_bits, owner, local_index, row_token, tokens.view(bits), routing, C, H,
                           max(scale_cols, 1), routing.shape[1], K=k, BLOCK_K=triton.next_power_of_2(k),
                           BLOCK_S=triton.next_power_of_2(max(scale_cols, 1)), HAS_SCALE=scale is not None,
                           BLOCK_H=_BLOCK_H)
    return slot, tokens, routing


def sum_partials(back: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """[T, H] in back's dtype: per token, the fp32 sum of back's rows slot[t, :] (rows >= len(back) add nothing)."""
    T, R = slot.shape
    out = torch.empty((T, back.shape[1]), dtype=back.dtype, device=back.device)
    if T:
        _combine_kernel[(T,)](back, slot, out, back.shape[1], R, back.shape[0], BLOCK_H=_BLOCK_H)
    return out
