"""The batched activation format on one rank: layout planning, `local_batched`, `torch.batched_reference`.

Layout: every top-k slot (token t, position j) with expert e becomes a row of expert e's batch in
[E_local, max_tokens, Hp]; an expert's rows are its distinct tokens in token order, and
`expert_num_tokens[e]` counts them. A token that lists one expert twice (explicit topk_ids may) is
placed once and both slots read that row back: expert(x_t) is the same for both, and every expert
then holds at most T rows, so max_tokens = T is a bound that needs no host read of the counts
(no sync, CUDA-graph safe). The price is memory: E_local x T rows are allocated although only
T x k of them are valid; nothing reads or writes the rest.

`plan_batches` / `to_batched` / `from_batched` work from any (expert, source row) list, so a
dispatcher that receives slots from other ranks can batch them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moerules.activation import SwigluParams
from moerules.quant import Granularity

from .interfaces import BatchedExperts, PreparedInput
from .prepare_finalize import LocalPrepareFinalize
from .reference import moe_reference
from .scheme import TORCH_DTYPE
from .weights import MoEWeights


@dataclass(frozen=True)
class BatchedLayout:
    """Where each slot lives in the batch; the handle of `local_batched`."""

    dest: torch.Tensor               # int64 [S]: flat row e * max_tokens + r of each slot
    expert_num_tokens: torch.Tensor  # int32 [E]: valid rows per expert
    max_tokens: int


def plan_batches(expert_ids: torch.Tensor, source_rows: torch.Tensor, *, num_experts: int, num_source_rows: int,
                 max_tokens: int) -> BatchedLayout:
    """Rows of S slots in the batch, all on the device. expert_ids / source_rows [S]: each slot's (local)
    expert and the row of the source tensor it copies; slots with equal (expert, source row) share a row.

    The caller guarantees no expert has more than max_tokens distinct source rows (num_source_rows is
    always enough).
    """
    e = expert_ids.reshape(-1).long()
    key = e * num_source_rows + source_rows.reshape(-1).long()
    sorted_key, order = torch.sort(key)
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    e_sorted = e[order]
    counts = torch.zeros(num_experts, dtype=torch.long, device=e.device).index_add_(0, e_sorted, first.long())
    # Rank of each distinct (expert, row) pair in expert-major order, minus where its expert starts;
    # a repeated pair gets the cumsum of its first occurrence, hence the same row.
    row = torch.cumsum(first, 0) - 1 - (torch.cumsum(counts, 0) - counts)[e_sorted]
    dest = torch.empty_like(key)
    dest[order] = e_sorted * max_tokens + row
    return BatchedLayout(dest=dest, expert_num_tokens=counts.to(torch.int32), max_tokens=max_tokens)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Byte view of 1-byte dtypes: torch has no index_copy for fp8."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def to_batched(rows: torch.Tensor, source_rows: torch.Tensor, layout: BatchedLayout,
               num_experts: int) -> torch.Tensor:
    """rows [R, ...] -> [E, max_tokens, ...]: slot s copies rows[source_rows[s]] to its row; padding is left empty."""
    out = rows.new_empty(num_experts * layout.max_tokens, *rows.shape[1:])
    # A shared row is written by each of its slots, with identical bytes.
    _raw(out).index_copy_(0, layout.dest, _raw(rows)[source_rows.long()])
    return out.view(num_experts, layout.max_tokens, *rows.shape[1:])


def from_batched(expert_out: torch.Tensor, layout: BatchedLayout, topk_weights: torch.Tensor) -> torch.Tensor:
    """[E, max_tokens, H] unweighted expert rows -> [T, H]: sum over k of topk_weight * row, in fp32 (or wider),
    one rounding."""
    T, k = topk_weights.shape
    H = expert_out.shape[-1]
    acc = torch.promote_types(expert_out.dtype, torch.float32)
    slots = expert_out.reshape(-1, H)[layout.dest].view(T, k, H).to(acc)
    return (slots * topk_weights.to(acc)[..., None]).sum(dim=1).to(expert_out.dtype)


class LocalBatchedPrepareFinalize(LocalPrepareFinalize):
    """`local_batched`: one rank, no communication; standard [T, H] in and out, batched in between.

    prepare pads and quantises exactly as `local` does (once, on [T, H], before batching, unless
    deferred), then copies each slot's row and scale into its expert's batch (max_tokens = T, see
    the module doc). finalize gathers the rows back, applies the router weights and sums over k.
    """


    def dispatch(self, prepared: PreparedInput) -> PreparedInput:
        if self.num_local_experts is None:
            raise ValueError("local_batched needs num_local_experts (build_layer passes weights.num_experts)")
        E = self.num_local_experts
        T, k = prepared.topk_ids.shape
        source_rows = torch.arange(T * k, device=prepared.topk_ids.device) // k
        layout = plan_batches(prepared.topk_ids, source_rows, num_experts=E, num_source_rows=T, max_tokens=T)
        a_scale = prepared.a_scale
        if a_scale is not None and self.scheme.act_granularity != Granularity.tensor:
            a_scale = to_batched(a_scale, source_rows, layout, E)  # [T] -> [E, T]; [T, G] -> [E, T, G]
        return PreparedInput(hidden_q=to_batched(prepared.hidden_q, source_rows, layout, E), a_scale=a_scale,
                             topk_ids=prepared.topk_ids, topk_weights=prepared.topk_weights,
                             expert_num_tokens=layout.expert_num_tokens, handle=layout)

    def finalize(self, expert_out: torch.Tensor, *, prepared: PreparedInput, hidden_size: int) -> torch.Tensor:
        out = from_batched(expert_out, prepared.handle, prepared.topk_weights)
        return out[:, :hidden_size] if out.shape[1] != hidden_size else out


def _valid_rows(expert_num_tokens: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """Flat indices e * max_tokens + r of the valid rows (reads the counts on the host)."""
    valid = torch.arange(max_tokens, device=expert_num_tokens.device)[None, :] < expert_num_tokens.long()[:, None]
    return valid.reshape(-1).nonzero().squeeze(1)


def batched_reference(hidden_q: torch.Tensor, *, a_scale: Optional[torch.Tensor], expert_num_tokens: torch.Tensor,
                      weights: MoEWeights, activation, compute_dtype: torch.dtype = torch.float32,
                      swiglu: SwigluParams = SwigluParams()) -> torch.Tensor:
    """[E, M, H] (quantised iff the scheme quantises) -> [E, M, H] in compute_dtype, padding rows zero.

    Every valid row goes through `moe_reference` as a top-1 slot of weight 1 (an exact multiply), so
    the batched yardstick is the standard one: same dequantisation and roundings, and the
    intermediate's dynamic per-tensor scale spans exactly the valid rows.
    """
    E, M, H = hidden_q.shape
    flat = _valid_rows(expert_num_tokens, M)
    rows = _raw(hidden_q.reshape(E * M, H))[flat].view(hidden_q.dtype)
    if a_scale is not None and weights.scheme.act_granularity != Granularity.tensor:
        a_scale = a_scale.reshape(E * M, *a_scale.shape[2:])[flat]  # [E, M] -> [S]; [E, M, G] -> [S, G]
    ids = (flat // max(M, 1)).to(torch.int32)[:, None]
    y = moe_reference(rows, weights=weights, topk_ids=ids, topk_weights=torch.ones(ids.shape, device=ids.device),
                      a_scale=a_scale, activation=activation, compute_dtype=compute_dtype, swiglu=swiglu)
    out = torch.zeros(E * M, weights.hidden, dtype=compute_dtype, device=hidden_q.device)
    out[flat] = y
    return out.view(E, M, weights.hidden)


class BatchedReferenceExperts(BatchedExperts):
    """`torch.batched_reference`: the batched format in fp32 torch, for tests and CPUs."""


    def apply(self, hidden_q: torch.Tensor, *, weights: MoEWeights, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, a_scale: Optional[torch.Tensor],
              expert_num_tokens: torch.Tensor) -> torch.Tensor:
        x, a_scale = self.gemm1_input(hidden_q, a_scale=a_scale, weights=weights, expert_num_tokens=expert_num_tokens)
        out = batched_reference(x, a_scale=a_scale, expert_num_tokens=expert_num_tokens, weights=weights,
                                activation=self.activation, compute_dtype=torch.float32, swiglu=self.swiglu)
        return out.to(TORCH_DTYPE[weights.in_dtype])
