"""`all2all`: tokens travel to the ranks that own their experts and back, over all_to_all_single.

A token goes ONCE to each rank that owns at least one of its k experts, not once per
(token, expert) slot: the receiving rank gets the token's ids renumbered to its own experts,
with -1 for the slots it does not own, and its experts already reduce those slots (weighted
sum over k) before the return trip. So a token whose experts share a rank costs one row on
the wire each way instead of several; with k=8 over few ranks (DeepSeek-V3) that is most
tokens. The owner then adds up at most R partial rows per token, in fp32.

The buffers have a fixed capacity (capacity.py): each rank sends every peer `rows_per_peer`
rows, the unused ones zero with ids -1, so the splits are equal and never read on the host.
dispatch: two all_to_all_single, the token rows and one int32 routing row per token (renumbered
ids, fp32 router weights and per-token scales, bit-cast); combine: one all_to_all_single of the
partial rows back into the sender's slots, summed per token. Tokens with a pair that overflowed
a smaller capacity get NaN outputs, never a silent partial sum.

On a GPU the packing and the sum are three Triton launches (kernels/triton/exchange.py); the
torch expression below is the CPU path and the reference those kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..interfaces import PreparedInput
from .capacity import ExchangePlan
from .exchange import ExchangePrepareFinalize


@dataclass(frozen=True)
class ExchangeHandle:
    slot: torch.Tensor        # int64 [T, R]: the send row of (token, rank); R*C: not sent, R*C+1: overflowed
    num_tokens: int


class All2AllPrepareFinalize(ExchangePrepareFinalize):
    needs_expert_placement = True

    def dispatch(self, prepared: PreparedInput) -> PreparedInput:
        x, comm = prepared.hidden_q, self.comm
        plan = self.capacity.plan_for(comm, x, prepared.topk_ids)
        scale = self.token_scale(prepared.a_scale)
        pack = _pack_on_gpu if x.is_cuda else _pack_with_torch
        slot, tokens, routing = pack(x, prepared.topk_ids, prepared.topk_weights, scale,
                                     self.routing_tables(x.device), comm.size, plan, self.capacity.counter)
        rows, k = tokens.shape[0], prepared.topk_ids.shape[1]
        recv_x = comm.all_to_all_equal(tokens, what="tokens")
        parts = {"topk": (torch.int32, (rows, 2 * k))}
        if scale is not None:
            parts["scales"] = (torch.float32, (rows, *scale.shape[1:]))
        recv_routing = comm.all_to_all_equal(routing, what="routing", parts=parts)
        a_scale = prepared.a_scale
        if scale is not None:
            a_scale = recv_routing[:, 2 * k:].contiguous().view(torch.float32).reshape(rows, *scale.shape[1:])
        return PreparedInput(hidden_q=recv_x, a_scale=a_scale, topk_ids=recv_routing[:, :k].contiguous(),
                             topk_weights=recv_routing[:, k:2 * k].contiguous().view(torch.float32),
                             handle=ExchangeHandle(slot, x.shape[0]))

    def combine(self, expert_out: torch.Tensor, *, prepared: PreparedInput) -> torch.Tensor:
        return self.return_partials(expert_out, prepared.handle)

    def return_partials(self, partial: torch.Tensor, handle: ExchangeHandle) -> torch.Tensor:
        """Partial rows (in received order) -> [T, H] sums per own token, in partial's dtype."""
        back = self.comm.all_to_all_equal(partial.contiguous(), what="partial outputs")
        if back.is_cuda:
            from ..triton.exchange import sum_partials
            out = sum_partials(back, handle.slot)
        else:
            zero_rows = back.new_zeros((2, back.shape[1]))
            out = torch.cat([back, zero_rows])[handle.slot].sum(dim=1, dtype=torch.float32).to(back.dtype)
        if self.capacity.plan.may_overflow:
            overflowed = (handle.slot == back.shape[0] + 1).any(dim=1, keepdim=True)
            out = out.masked_fill(overflowed, float("nan"))
            self.capacity.report(self.comm)
        return out


def _pack_on_gpu(x, topk_ids, topk_weights, scale, tables, ranks: int, plan: ExchangePlan, dropped):
    from ..triton.exchange import pack_rows
    return pack_rows(x, topk_ids=topk_ids, topk_weights=topk_weights, scale=scale, owner=tables.owner,
                     local_index=tables.local_index, ranks=ranks, rows_per_peer=plan.rows_per_peer, dropped=dropped)


def _pack_with_torch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     scale: Optional[torch.Tensor], tables, ranks: int, plan: ExchangePlan,
                     dropped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot [T, R], token rows [R*C, H], routing rows [R*C, 2k + scale columns] int32): peer r's rows are r*C..,
    in token order; routing rows hold the ids renumbered to r's experts (-1 for slots r does not own), the router
    weights and the token's scales, bit-cast; unused rows are zero with ids -1."""
    R, C, k = ranks, plan.rows_per_peer, topk_ids.shape[1]
    ids = topk_ids.long()
    owner = tables.owner[ids]
    goes = torch.zeros((ids.shape[0], R), dtype=torch.bool, device=ids.device).scatter_(1, owner, True)
    pos = goes.cumsum(0) - 1
    slot = torch.where(goes, torch.arange(0, R * C, C, device=ids.device) + pos, R * C)
    over = goes & (pos >= C)
    dropped.add_(over.sum().to(torch.int32))
    slot = torch.where(over, R * C + 1, slot)      # rows R*C and R*C+1 are scratch, never sent
    tokens = torch.zeros((R * C + 2, x.shape[1]), dtype=x.dtype, device=x.device)
    as_bytes = x.dtype.itemsize == 1 and x.dtype != torch.uint8    # index_put has no FP8 kernels everywhere
    (tokens.view(torch.uint8) if as_bytes else tokens)[slot] = (
        x.view(torch.uint8) if as_bytes else x)[:, None].expand(-1, R, -1)
    mine = owner[:, None, :] == torch.arange(R, device=ids.device)[None, :, None]
    values = [torch.where(mine, tables.local_index[ids][:, None, :], -1).to(torch.int32),
              topk_weights.float().view(torch.int32)[:, None, :].expand(-1, R, -1)]
    if scale is not None:
        values.append(scale.float().reshape(ids.shape[0], 1, -1).view(torch.int32).expand(-1, R, -1))
    values = torch.cat(values, dim=2)
    routing = torch.zeros((R * C + 2, values.shape[2]), dtype=torch.int32, device=ids.device)
    routing[:, :k] = -1
    routing[slot] = values
    return slot, tokens[:R * C], routing[:R * C]
