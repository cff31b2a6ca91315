"""`all2all`: tokens travel to the ranks that own their experts and back, over all_to_all_single.

A token goes ONCE to each rank that owns at least one of its k experts, not once per
(token, expert) slot: the receiving rank gets the token's ids renumbered to its own experts,
with -1 for the slots it does not own, and its experts already reduce those slots (weighted
sum over k) before the return trip. So a token whose experts share a rank costs one row on
the wire each way instead of several; with k=8 over few ranks (DeepSeek-V3) that is most
tokens. The owner then adds up at most R partial rows per token, in fp32.

dispatch: per-destination counts (one small all-to-all, read on the host to size buffers),
then the token rows, their packed top-k ids/weights, and per-token scales if they travel.
combine: the partial rows go back along the inverse split and are summed into token order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..interfaces import PreparedInput
from .comm import batch_shape
from .exchange import ExchangePrepareFinalize, pack_topk, unpack_topk


@dataclass(frozen=True)
class ExchangeHandle:
    token_of_row: torch.Tensor   # [rows sent]: the local token each sent row came from (grouped by rank)
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int


class All2AllPrepareFinalize(ExchangePrepareFinalize):
    needs_expert_placement = True

    def dispatch(self, prepared: PreparedInput) -> PreparedInput:
        x, comm = prepared.hidden_q, self.comm
        ids = prepared.topk_ids.long()
        tables = self.routing_tables(x.device)
        owner = tables.owner[ids]                                                 # [T, k]
        goes = torch.zeros(ids.shape[0], comm.size, dtype=torch.bool, device=x.device)
        goes.scatter_(1, owner, True)                                             # token t -> rank r
        rank_of_row, token_of_row = goes.T.nonzero(as_tuple=True)                 # grouped by destination
        send_counts = goes.sum(dim=0)
        recv_counts = comm.exchange_counts(send_counts, shape=batch_shape(x, ids))
        send = send_counts.tolist()

        local = tables.local_index[ids[token_of_row]]
        row_ids = torch.where(owner[token_of_row] == rank_of_row[:, None], local, -1)
        topk = pack_topk(row_ids, prepared.topk_weights[token_of_row])
        recv_x = comm.all_to_all(x[token_of_row], send_counts=send, recv_counts=recv_counts, what="tokens")
        recv_ids, recv_weights = unpack_topk(comm.all_to_all(topk, send_counts=send, recv_counts=recv_counts,
                                                             what="topk"))
        a_scale = prepared.a_scale
        scale = self.token_scale(a_scale)
        if scale is not None:
            a_scale = comm.all_to_all(scale[token_of_row], send_counts=send, recv_counts=recv_counts, what="scales")
        return PreparedInput(hidden_q=recv_x, a_scale=a_scale, topk_ids=recv_ids, topk_weights=recv_weights,
                             handle=ExchangeHandle(token_of_row, send, recv_counts, ids.shape[0]))

    def combine(self, expert_out: torch.Tensor, *, prepared: PreparedInput) -> torch.Tensor:
        return self.return_partials(expert_out, prepared.handle)

    def return_partials(self, partial: torch.Tensor, handle: ExchangeHandle) -> torch.Tensor:
        """Partial rows (in received order) -> [T, H] sums per own token, in partial's dtype."""
        back = self.comm.all_to_all(partial, send_counts=handle.recv_counts, recv_counts=handle.send_counts,
                                    what="partial outputs")
        out = torch.zeros(handle.num_tokens, partial.shape[1], dtype=torch.float32, device=partial.device)
        return out.index_add_(0, handle.token_of_row, back.float()).to(partial.dtype)
