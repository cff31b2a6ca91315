"""Fixed-capacity exchange buffers: agreed once, so every later forward exchanges without the host.

A token-exchanging dispatcher sends each peer a buffer of `rows_per_peer` rows, every call,
whatever the routing: the split sizes are equal and known in advance, so one all_to_all_single
moves the tokens with no count exchange and nothing read back on the host, and a CUDA graph can
capture it. Because a token goes at most once to each rank (all2all) the default capacity, the
largest token count of any rank, can never overflow; a smaller `rows_per_peer` (less padding on
the wire) can, and then the overflowing (token, rank) pairs are detected on the device: their
tokens' outputs become NaN and `CapacityError` is raised (at once on the CPU; on a GPU at the
next eager forward or at `check_capacity()`, which never blocks a captured graph). Never a silent
drop: losing a token's experts is the failure this project exists to prevent.

The capacity is agreed at the first forward of every rank: one small all-to-all of each rank's
token count, the batch shape (top_k, width, dtype) and the requested capacity, read on the host
(the only host read of the exchange); ranks that disagree all raise InconsistentRanksError. A later
batch larger than the capacity is a typed error on its rank, raised before any collective (its
peers then fail within the collective timeout): reserve the largest batch with `set_capacity`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .comm import CollectiveError, Comm, batch_shape


class CapacityError(CollectiveError):
    """A batch does not fit the exchange buffers agreed at the first forward."""


@dataclass(frozen=True)
class ExchangePlan:
    tokens_per_rank: int      # the most tokens any rank may send in one forward
    rows_per_peer: int        # rows reserved for each (sender, receiver) pair
    top_k: int

    @property
    def may_overflow(self) -> bool:
        return self.rows_per_peer < self.tokens_per_rank


class Capacity:
    """The exchange plan of one dispatcher: requested (optional), agreed once, then checked per batch."""

    def __init__(self):
        self.requested: Optional[tuple[int, int]] = None     # (tokens_per_rank, rows_per_peer)
        self.plan: Optional[ExchangePlan] = None
        self._overflowed: Optional[torch.Tensor] = None      # int32 [1] on the device: dropped pairs so far
        self._pending: Optional[tuple[torch.Tensor, object]] = None   # (pinned copy, event) of that count

    def request(self, tokens_per_rank: int, rows_per_peer: Optional[int]) -> None:
        rows = tokens_per_rank if rows_per_peer is None else rows_per_peer
        if self.plan is not None:
            raise CapacityError("set_capacity must come before the first forward (the capacity is agreed then)")
        if not (tokens_per_rank >= 1 and 1 <= rows <= tokens_per_rank):
            raise CapacityError(f"capacity needs 1 <= rows_per_peer ({rows}) <= tokens_per_rank ({tokens_per_rank})")
        self.requested = (tokens_per_rank, rows)

    def plan_for(self, comm: Comm, x: torch.Tensor, topk_ids: torch.Tensor) -> ExchangePlan:
        """The agreed plan (agreeing on it at the first call); CapacityError if x has more tokens than it holds."""
        if self.plan is None:
            self.plan = self._agree(comm, x, topk_ids)
        plan = self.plan
        if topk_ids.shape[1] != plan.top_k:
            raise CapacityError(f"rank {comm.rank}/{comm.size}: top_k={topk_ids.shape[1]}, but this layer's exchange "
                                f"was agreed for top_k={plan.top_k} at its first forward; every forward of an "
                                "expert-parallel layer must route to the same number of experts")
        if x.shape[0] > plan.tokens_per_rank:
            raise CapacityError(f"rank {comm.rank}/{comm.size}: {x.shape[0]} tokens exceed the exchange capacity of "
                                f"{plan.tokens_per_rank} tokens per rank agreed at the first forward; reserve the "
                                "largest batch before it: layer.prepare_finalize.set_capacity(tokens_per_rank=N)")
        return plan

    def _agree(self, comm: Comm, x: torch.Tensor, topk_ids: torch.Tensor) -> ExchangePlan:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise CapacityError("the exchange capacity is agreed at the first forward, which cannot be captured "
                                "(it reads the ranks' answer on the host): run one eager forward before capturing")
        tokens, rows = self.requested or (0, 0)
        shape = {**batch_shape(x, topk_ids), "capacity": tokens, "rows_per_peer": rows}
        counts = comm.exchange_counts(torch.full((comm.size,), x.shape[0], device=x.device), shape=shape)
        if self.requested is None:
            tokens = rows = max(max(counts), 1)
        self._overflowed = torch.zeros(1, dtype=torch.int32, device=x.device)
        return ExchangePlan(tokens_per_rank=tokens, rows_per_peer=rows, top_k=topk_ids.shape[1])

    # -- overflow reporting -----------------------------------------------------------------
    @property
    def counter(self) -> torch.Tensor:
        """int32 [1] on the device: (token, rank) pairs dropped since the last report; the packers add to it."""
        return self._overflowed

    def report(self, comm: Comm) -> None:
        """Raise CapacityError for overflows seen so far without waiting on the GPU: CPU counts are read at once,
        a GPU count is read once its asynchronous copy has landed (the next eager forward, typically)."""
        flag = self._overflowed
        if flag is None:
            return
        if not flag.is_cuda:
            self._raise_if(int(flag), comm)
            return
        if torch.cuda.is_current_stream_capturing():
            return
        if self._pending is not None and self._pending[1].query():
            self._raise_if(int(self._pending[0]), comm)
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)

    def check(self, comm: Comm) -> None:
        """Blocking: raise CapacityError if any forward so far (captured replays included) dropped a pair."""
        if self._overflowed is not None:
            self._raise_if(int(self._overflowed), comm)

    def _raise_if(self, dropped: int, comm: Comm) -> None:
        if dropped:
            self._overflowed.zero_()
            plan = self.plan
            raise CapacityError(f"rank {comm.rank}/{comm.size}: {dropped} (token, rank) pairs did not fit the "
                                f"{plan.rows_per_peer} rows per peer of the exchange buffers; those tokens' outputs "
                                "are NaN (their experts were not computed). Raise rows_per_peer in "
                                f"set_capacity (at most tokens_per_rank={plan.tokens_per_rank}, which never "
                                "overflows)")
