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
partial rows back into the sender's slots, gathered per token (pairs that overflowed a smaller
capacity read a NaN row, never a silent zero).
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
    slot: torch.Tensor        # int64 [T, R]: the send-buffer row of (token, rank); a zero row, or the NaN row
    num_tokens: int


class All2AllPrepareFinalize(ExchangePrepareFinalize):
    needs_expert_placement = True

    def dispatch(self, prepared: PreparedInput) -> PreparedInput:
        x, comm = prepared.hidden_q, self.comm
        ids = prepared.topk_ids.long()
        plan = self.capacity.plan_for(comm, x, ids)
        slot = self._slots(ids, plan)
        rows = comm.size * plan.rows_per_peer
        send = torch.zeros((rows + 2, x.shape[1]), dtype=x.dtype, device=x.device)
        _put_rows(send, slot, x[:, None].expand(-1, comm.size, -1))
        scale = self.token_scale(prepared.a_scale)
        routing = self._routing_rows(ids, prepared.topk_weights, scale, slot, rows)
        recv_x = comm.all_to_all_equal(send[:rows], what="tokens")
        parts = {"topk": (torch.int32, (rows, 2 * ids.shape[1]))}
        if scale is not None:
            parts["scales"] = (torch.float32, (rows, *scale.shape[1:]))
        recv_routing = comm.all_to_all_equal(routing, what="routing", parts=parts)
        k = ids.shape[1]
        a_scale = prepared.a_scale
        if scale is not None:
            a_scale = recv_routing[:, 2 * k:].contiguous().view(torch.float32).reshape(rows, *scale.shape[1:])
        return PreparedInput(hidden_q=recv_x, a_scale=a_scale, topk_ids=recv_routing[:, :k].contiguous(),
                             topk_weights=recv_routing[:, k:2 * k].contiguous().view(torch.float32),
                             handle=ExchangeHandle(slot, ids.shape[0]))

    def _slots(self, ids: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
        """[T, R] send-buffer row of each (token, rank) pair: peer r's rows are r*C.., in token order; pairs that
        are not sent point at the zero row R*C, pairs that overflow C at the NaN row R*C+1 (and are counted)."""
        R, C = self.comm.size, plan.rows_per_peer
        owner = self.routing_tables(ids.device).owner[ids]
        goes = torch.zeros((ids.shape[0], R), dtype=torch.bool, device=ids.device).scatter_(1, owner, True)
        pos = goes.cumsum(0) - 1
        first_row = torch.arange(0, R * C, C, device=ids.device)
        slot = torch.where(goes, first_row + pos, R * C)
        if plan.may_overflow:
            dropped = goes & (pos >= C)
            self.capacity.count_dropped(dropped)
            slot = torch.where(dropped, R * C + 1, slot)
        return slot

    def _routing_rows(self, ids: torch.Tensor, weights: torch.Tensor, scale: Optional[torch.Tensor],
                      slot: torch.Tensor, rows: int) -> torch.Tensor:
        """int32 [R*C, 2k (+ scale columns)]: per sent row, the ids renumbered to the receiver's experts (-1 for
        slots it does not own), the router weights and the token's scales, bit-cast; unused rows: ids -1."""
        R, k = self.comm.size, ids.shape[1]
        tables = self.routing_tables(ids.device)
        mine = tables.owner[ids][:, None, :] == torch.arange(R, device=ids.device)[None, :, None]
        per_rank = [torch.where(mine, tables.local_index[ids][:, None, :], -1).to(torch.int32),
                    weights.float().view(torch.int32)[:, None, :].expand(-1, R, -1)]
        if scale is not None:
            per_rank.append(scale.float().reshape(ids.shape[0], 1, -1).view(torch.int32).expand(-1, R, -1))
        values = torch.cat(per_rank, dim=2)
        out = torch.zeros((rows + 2, values.shape[2]), dtype=torch.int32, device=ids.device)
        out[:, :k] = -1
        out[slot] = values
        return out[:rows]

    def combine(self, expert_out: torch.Tensor, *, prepared: PreparedInput) -> torch.Tensor:
        return self.return_partials(expert_out, prepared.handle)

    def return_partials(self, partial: torch.Tensor, handle: ExchangeHandle) -> torch.Tensor:
        """Partial rows (in received order) -> [T, H] sums per own token, in partial's dtype."""
        rows = partial.shape[0]
        back = torch.empty((rows + 2, partial.shape[1]), dtype=partial.dtype, device=partial.device)
        back[rows] = 0
        back[rows + 1] = float("nan")
        self.comm.all_to_all_equal(partial.contiguous(), what="partial outputs", out=back[:rows])
        out = back[handle.slot].sum(dim=1, dtype=torch.float32).to(partial.dtype)
        if self.capacity.plan.may_overflow:
            self.capacity.report(self.comm)
        return out


def _put_rows(buffer: torch.Tensor, slot: torch.Tensor, values: torch.Tensor) -> None:
    """buffer[slot] = values, FP8 as bytes (index_put has no FP8 kernels on every device)."""
    as_bytes = buffer.dtype.itemsize == 1 and buffer.dtype != torch.uint8
    (buffer.view(torch.uint8) if as_bytes else buffer)[slot] = values.view(torch.uint8) if as_bytes else values
