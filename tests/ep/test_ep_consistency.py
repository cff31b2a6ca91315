"""Ranks that disagree end in the same typed error on every rank: never an abort, never a wrong result.

What a rank built (decision, kernels, scheme, dtype, sizes, padding, placement, the checksum of the
global weights its shard came from) is compared once at build; what a batch carries (top_k, width,
dtype, and the token count where ranks share tokens) rides on the first exchange of each forward.
Before these checks a rank with another hidden size, top_k or dtype aborted (SIGABRT in gloo) while its
peer got a timeout, and ranks with another placement or weights seed finished with wrong output.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from ep_cases import Case, outcome_of_rank_case

BUILD = r"KernelBuildError: {pf}: the 2 ranks of the expert-parallel group built different layers \({detail}\); " \
        r"build every rank from the same decision, placement and global weights"
FORWARD = r"InconsistentRanksError: the 2 ranks of the expert-parallel group disagree on the batch they run " \
          r"\({detail}\); every rank must run the same layer"

CASES = {  # name: (rank 0's case, what rank 1 changes, the error every rank must end in)
    "hidden size": (Case(), dict(H=64),
                    BUILD.format(pf="all2all", detail=r"hidden: rank 0 128\+0, rank 1 64\+0; weights: .*")),
    "dtype": (Case(), dict(dtype="bf16"), BUILD.format(pf="all2all", detail=r"in_dtype: rank 0 fp32, rank 1 bf16; "
                                                                            r"weights: rank 0 \w+, rank 1 \w+")),
    "placement": (Case(), dict(placement="round_robin"),
                  BUILD.format(pf="all2all", detail=r"placement: rank 0 contiguous 8/2, rank 1 round_robin 8/2")),
    "weights seed": (Case(), dict(seed=5), BUILD.format(pf="all2all", detail=r"weights: rank 0 \w+, rank 1 \w+")),
    "scheme": (Case(pf="allgather_reducescatter"), dict(cell="fp8_w8a16/channel"),
               BUILD.format(pf="allgather_reducescatter", detail=r"scheme: rank 0 unquantized, rank 1 "
                                                                 r"fp8_w8a16/channel; weights: .*")),
    "top_k, all2all": (Case(), dict(k=3), FORWARD.format(detail=r"rank 0: top_k=2; rank 1: top_k=3")),
    "top_k, all-gather": (Case(pf="allgather_reducescatter"), dict(k=3),
                          FORWARD.format(detail=r"rank 0: top_k=2; rank 1: top_k=3")),
    "tokens of a replicated batch": (Case(pf="local", placement="tensor", replicated=True, tokens=(5, 5)),
                                     dict(tokens=(4, 4)), FORWARD.format(detail=r"rank 0: tokens=5; rank 1: tokens=4")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inconsistent_ranks_all_end_in_the_same_typed_error(pool2, name):
    base, change, expected = CASES[name]
    outcomes = pool2.run(outcome_of_rank_case, (base, dataclasses.replace(base, **change)))
    errors = [o["error"] for o in outcomes]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert re.match(expected, errors[0]), errors[0]


def test_consistent_ranks_still_build_and_run(pool2):
    outcomes = pool2.run(outcome_of_rank_case, (Case(), Case()))
    assert [o["error"] for o in outcomes] == [None, None]
