"""`all2all_batched`: the all-to-all exchange, delivering per-expert batches (batched format).

The wire is the standard all-to-all's (a token once per destination rank, ids renumbered to
the destination's experts). The receiving rank then lays the received (token, local expert)
slots out as [E_local, max_tokens, H] with `expert_num_tokens` valid rows per expert (rows
in received order; the rest zero) and the matching scale layout: [1] per tensor,
[E_local, max_tokens] per token, [E_local, max_tokens, H/128] per 1x128 group.
Batched experts return [E_local, max_tokens, H] *without* router weights; combine weights
each valid row, sums a token's rows into one partial row and returns it like the standard
exchange. The experts' own topk_ids/topk_weights are this rank's routing [T, k], unused here.
Batched dispatch needs round-robin expert placement (checked at build).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..interfaces import PreparedInput
from .all2all import All2AllPrepareFinalize, ExchangeHandle


@dataclass(frozen=True)
class _BatchHandle:
    exchange: ExchangeHandle
    expert: torch.Tensor      # [slots]: local expert of each valid slot
    position: torch.Tensor    # [slots]: its row in that expert's batch
    row: torch.Tensor         # [slots]: the received token row it came from
    weight: torch.Tensor      # [slots]: its router weight (fp32)
    num_rows: int             # received token rows


class BatchedAll2AllPrepareFinalize(All2AllPrepareFinalize):

    def dispatch(self, prepared: PreparedInput) -> PreparedInput:
        own_ids, own_weights = prepared.topk_ids, prepared.topk_weights
        received = super().dispatch(prepared)
        x, ids = received.hidden_q, received.topk_ids
        k = ids.shape[1]
        num_local = self.placement.num_local_experts
        flat = ids.reshape(-1).long()
        slots = (flat >= 0).nonzero().squeeze(1)
        expert, order = torch.sort(flat[slots], stable=True)
        slots = slots[order]
        counts = torch.bincount(expert, minlength=num_local)
        position = torch.arange(slots.shape[0], device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
        # At least one row, so kernels never see an empty grid; the host read sizes the batch.
        max_tokens = max(int(counts.max()) if slots.numel() else 0, 1)
        row = slots // k
        handle = _BatchHandle(received.handle, expert, position, row,
                              received.topk_weights.reshape(-1)[slots], x.shape[0])
        return PreparedInput(hidden_q=_batch(x, handle, num_local, max_tokens),
                             a_scale=self._batched_scale(received.a_scale, handle, num_local, max_tokens),
                             topk_ids=own_ids, topk_weights=own_weights,
                             expert_num_tokens=counts.to(torch.int32), handle=handle)

    def _batched_scale(self, a_scale: Optional[torch.Tensor], handle: _BatchHandle, num_local: int,
                       max_tokens: int) -> Optional[torch.Tensor]:
        if self.token_scale(a_scale) is None:
            return a_scale                      # None, or the [1] per-tensor scale every rank shares
        return _batch(a_scale, handle, num_local, max_tokens)

    def combine(self, expert_out: torch.Tensor, *, prepared: PreparedInput) -> torch.Tensor:
        h = prepared.handle
        y = expert_out[h.expert, h.position].float() * h.weight[:, None]
        partial = torch.zeros(h.num_rows, expert_out.shape[-1], dtype=torch.float32, device=expert_out.device)
        partial.index_add_(0, h.row, y)
        return self.return_partials(partial.to(expert_out.dtype), h.exchange)


def _batch(rows: torch.Tensor, h: _BatchHandle, num_local: int, max_tokens: int) -> torch.Tensor:
    """[N, ...] received rows -> [E_local, max_tokens, ...], slot (expert, position) <- rows[row]."""
    out = torch.zeros((num_local, max_tokens, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    # Byte views: index_put has no FP8 kernels on every device; a copy is a copy.
    as_bytes = rows.dtype.itemsize == 1 and rows.dtype != torch.uint8
    (out.view(torch.uint8) if as_bytes else out)[h.expert, h.position] = (
        rows.view(torch.uint8) if as_bytes else rows)[h.row]
    return out
