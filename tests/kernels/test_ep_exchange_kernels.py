"""The all2all exchange's Triton kernels (pack and combine) equal its torch expression, bit for bit.

Run in the interpreter on CPU and natively on a GPU: random routings over 1, 2 and 4 ranks, with
capacity to spare, exactly enough, and too little (overflow counted, rows never written twice), in
fp16 and FP8 (rows copied as bits), with per-token and 1x128 scales riding along. The slots of the
two agree exactly; the token and routing rows agree bit for bit; the sums agree to fp32 rounding
(both add the same rows in the same order).
"""

from __future__ import annotations

import pytest
import torch

from moerules.kernels.ep import Placement
from moerules.kernels.ep.all2all import _pack_with_torch
from moerules.kernels.ep.capacity import ExchangePlan
from moerules.kernels.ep.placement import routing_tables
from moerules.kernels.routing import fused_topk
from moerules.kernels.triton.exchange import pack_rows, sum_partials

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [  # (ranks, experts, top_k, tokens, rows per peer, dtype, scale columns or None)
    (1, 8, 2, 5, 5, torch.float16, None),
    (2, 8, 2, 9, 9, torch.float16, None),
    (2, 16, 4, 7, 3, torch.float16, 1),                  # overflow, per-token scales
    (4, 8, 3, 11, 6, torch.float8_e4m3fn, 2),            # FP8 rows as bits, 1x128 scales (H=256)
    (4, 16, 8, 6, 20, torch.float16, None),              # capacity larger than the batch
    (2, 8, 2, 0, 4, torch.float16, None),                # no tokens
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("ranks,E,k,T,C,dtype,scale_cols", CASES)
def test_the_kernels_pack_and_sum_as_the_torch_expression_does(ranks, E, k, T, C, dtype, scale_cols):
    g = torch.Generator().manual_seed(ranks * 100 + T)
    H = 256
    x = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    ids, weights = fused_topk(torch.randn(T, E, generator=g), top_k=k, renormalize=True)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)
    scale = None
    if scale_cols is not None:
        scale = torch.rand(T, generator=g) if scale_cols == 1 else torch.rand(T, scale_cols, generator=g)
        scale = scale.to(DEVICE)
    plan = ExchangePlan(tokens_per_rank=max(T, C), rows_per_peer=C, top_k=k)
    for rank in range(ranks):   # the tables differ per rank only in expert_map, which packing never reads
        tables = routing_tables(Placement.contiguous(E, ranks), rank, torch.device(DEVICE))
        dropped_torch = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        dropped_kernel = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        want = _pack_with_torch(x, ids, weights, scale, tables, ranks, plan, dropped_torch)
        got = pack_rows(x, topk_ids=ids, topk_weights=weights, scale=scale, owner=tables.owner,
                        local_index=tables.local_index, ranks=ranks, rows_per_peer=C, dropped=dropped_kernel)
        assert torch.equal(got[0], want[0]), "slots"
        assert torch.equal(_bits(got[1]), _bits(want[1])), "token rows"
        assert torch.equal(got[2], want[2]), "routing rows"
        assert int(dropped_kernel) == int(dropped_torch)
    back = torch.randn(ranks * C, H, generator=g).to(torch.float16).to(DEVICE)
    expected = torch.cat([back, back.new_zeros(2, H)])[want[0]].sum(dim=1, dtype=torch.float32).to(back.dtype)
    assert torch.equal(sum_partials(back, want[0]), expected)


def test_overflow_is_counted_per_pair():
    ids = torch.zeros(6, 1, dtype=torch.int32, device=DEVICE)          # every token to expert 0, on rank 0
    weights = torch.ones(6, 1, device=DEVICE)
    tables = routing_tables(Placement.contiguous(2, 2), 0, torch.device(DEVICE))
    dropped = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    slot, _, routing = pack_rows(torch.zeros(6, 8, dtype=torch.float16, device=DEVICE), topk_ids=ids,
                                 topk_weights=weights, scale=None, owner=tables.owner,
                                 local_index=tables.local_index, ranks=2, rows_per_peer=4, dropped=dropped)
    assert int(dropped) == 2
    assert slot.tolist() == [[0, 8], [1, 8], [2, 8], [3, 8], [9, 8], [9, 8]]
    assert routing[:, 0].tolist() == [0, 0, 0, 0, -1, -1, -1, -1]
