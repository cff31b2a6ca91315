"""`allgather_reducescatter`: every rank computes its experts over the tokens of all ranks.

dispatch: all-gather the tokens, padded to the capacity the ranks agreed at their first forward
(capacity.py: the largest token count of any rank, or `set_capacity`), so every forward is one
all-gather of equal blocks with no sizes read on the host; then their top-k ids and weights, and
their per-token scales.
Padding rows carry id -1 and contribute nothing. Each rank renumbers the ids to its own
experts (-1 elsewhere) and runs its experts over the whole gathered batch.
combine: reduce-scatter the partial outputs in the same padded layout, so each rank gets the
sum over all ranks for its own rows.

Under EP the partial outputs are each rank's experts' share; with the tensor placement (DP
without EP) every rank holds a slice of every expert's intermediate size and the partials are
slice sums (w2's bias lives on rank 0 only, see sharding.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..interfaces import PreparedInput
from .exchange import ExchangePrepareFinalize, pack_topk, unpack_topk
from .placement import map_to_local


@dataclass(frozen=True)
class _Handle:
    num_tokens: int     # this rank's own rows; the first rows of its reduce-scatter block


class AllGatherReduceScatter(ExchangePrepareFinalize):
    def dispatch(self, prepared: PreparedInput) -> PreparedInput:
        x, comm = prepared.hidden_q, self.comm
        num_tokens = x.shape[0]
        cap = self.capacity.plan_for(comm, x, prepared.topk_ids).tokens_per_rank
        ids = torch.full((cap, prepared.topk_ids.shape[1]), -1, dtype=torch.int32, device=x.device)
        ids[:num_tokens] = prepared.topk_ids
        weights = torch.zeros(ids.shape, dtype=torch.float32, device=x.device)
        weights[:num_tokens] = prepared.topk_weights
        tokens = comm.all_gather(_pad_rows(x, cap), what="tokens")
        all_ids, all_weights = unpack_topk(comm.all_gather(pack_topk(ids, weights), what="topk"))
        a_scale = prepared.a_scale
        scale = self.token_scale(a_scale)
        if scale is not None:
            a_scale = comm.all_gather(_pad_rows(scale, cap), what="scales")
        return PreparedInput(hidden_q=tokens, a_scale=a_scale, topk_weights=all_weights,
                             topk_ids=map_to_local(all_ids, self.routing_tables(x.device).expert_map),
                             handle=_Handle(num_tokens))

    def combine(self, expert_out: torch.Tensor, *, prepared: PreparedInput) -> torch.Tensor:
        mine = self.comm.reduce_scatter(expert_out, what="partial outputs")
        return mine[:prepared.handle.num_tokens]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows appended up to `rows` (a copy only when padding is needed)."""
    if t.shape[0] == rows:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out
