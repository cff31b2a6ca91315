"""Fixed-capacity exchange buffers: agreed once, constant collectives after, overflow never silent.

The ranks agree on the capacity at the first forward (one count exchange, read on the host);
every later forward issues a constant set of equal-split collectives. A capacity smaller than a
rank's token count fails before any collective; a rows_per_peer below what the routing needs
makes the overflowing tokens' outputs NaN and raises CapacityError naming the dropped pairs.
"""

from __future__ import annotations

import re

import torch

from ep_cases import Case, capacity_outcome, collectives_of_forwards, overflow_without_report, single_device

A2A_FORWARD = ["all_to_all_single tokens", "all_to_all_single routing", "all_to_all_single partial outputs"]


def test_after_the_first_forward_all2all_issues_three_equal_split_collectives(pool2):
    per_rank = pool2.run(collectives_of_forwards, Case(pf="all2all", tokens=(5, 3)), 3)
    for forwards in per_rank:
        assert forwards[0] == ["all_to_all_single counts"] + A2A_FORWARD
        assert forwards[1:] == [A2A_FORWARD] * 2


def test_after_the_first_forward_allgather_issues_no_count_exchange(pool2):
    per_rank = pool2.run(collectives_of_forwards, Case(pf="allgather_reducescatter", tokens=(5, 3)), 2)
    for forwards in per_rank:
        assert forwards[0][0] == "all_to_all_single counts"
        assert forwards[1] == ["all_gather tokens", "all_gather topk", "reduce_scatter partial outputs"]


def test_reserved_capacity_gives_the_single_device_output(pool2):
    case = Case(pf="all2all", tokens=(5, 3), k=3)
    single, _ = single_device(case)
    # 5 rows per peer hold any routing of at most 5 tokens, but 5 < 16 makes the device-side overflow check run.
    for rows_per_peer in (None, 5):
        outcomes = pool2.run(capacity_outcome, case, 16, rows_per_peer)
        for out, want in zip(outcomes, single):
            assert out["error"] is None and ((out["out"] - want).norm() / want.norm()).item() < 1e-5


def test_rows_per_peer_overflow_is_an_error_and_nan_never_a_silent_drop(pool2):
    # Every token routes to rank 0's experts only: each rank sends all 6 tokens to rank 0, 2 rows fit.
    case = Case(pf="all2all", tokens=(6, 6), route="rank0_experts")
    outcomes = pool2.run(capacity_outcome, case, 6, 2)
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] == (
            f"rank {rank}/2: 4 (token, rank) pairs did not fit the 2 rows per peer of the exchange buffers; those "
            "tokens' outputs are NaN (their experts were not computed). Raise rows_per_peer in set_capacity (at most "
            "tokens_per_rank=6, which never overflows)")


def test_the_overflowing_tokens_are_nan_and_the_others_exact(pool2):
    case = Case(pf="all2all", tokens=(6, 6), route="rank0_experts")
    outcomes = pool2.run(overflow_without_report, case, 6, 2)
    single, _ = single_device(case)
    for rank, (outcome, want) in enumerate(zip(outcomes, single)):
        out = outcome["out"]
        assert torch.isnan(out[2:]).all(), "tokens past the capacity must not look computed"
        assert ((out[:2] - want[:2]).norm() / want[:2].norm()).item() < 1e-5
        assert outcome["error"].startswith(f"rank {rank}/2: 4 (token, rank) pairs did not fit"), outcome["error"]


def test_a_batch_larger_than_the_capacity_fails_before_any_exchange(pool2):
    outcomes = pool2.run(capacity_outcome, Case(pf="all2all", tokens=(5, 5)), 4, None)
    for rank, outcome in enumerate(outcomes):
        assert re.fullmatch(rf"rank {rank}/2: 5 tokens exceed the exchange capacity of 4 tokens per rank agreed at "
                            r"the first forward; reserve the largest batch before it: "
                            r"layer\.prepare_finalize\.set_capacity\(tokens_per_rank=N\)", outcome["error"])
