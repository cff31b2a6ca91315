"""A rank that raises, dies or never joins makes the others fail within the collective timeout
with an error that says which rank, which collective, the timeout and the fix; never a hang.

Each test starts its own 2-rank pool with a 3 s timeout: after a fault the group is unusable.
"""

from __future__ import annotations

import re
import time

import pytest
import torch.multiprocessing as mp

from ep_cases import Case, fail_or_forward, join_alone
from rank_pool import RankPool, free_port

TIMEOUT_S = 3.0
# Spawned ranks on a loaded 2-core machine: how late after the timeout an error may still arrive.
SLACK_S = 4.0


@pytest.fixture
def fault_pool(one_thread):
    pool = RankPool(2, timeout_s=TIMEOUT_S)
    yield pool
    pool.close()


def test_a_rank_that_raises_makes_the_other_fail_within_the_timeout(fault_pool):
    # Per-tensor dynamic FP8: the first collective is the all-reduce agreeing on the activation amax.
    case = Case(pf="allgather_reducescatter", cell="fp8_w8a8/tensor/tensor", dtype="bf16", timeout_s=TIMEOUT_S)
    outcomes = fault_pool.outcomes(fail_or_forward, case, 1, "raise", wait_s=TIMEOUT_S + 30)
    assert outcomes[1][0] == "error" and "injected failure" in outcomes[1][1][1]
    status, report = outcomes[0]
    assert status == "ok" and report["error"] is not None, "rank 0 did not notice that rank 1 failed"
    assert re.match(r"rank 0/2: all_reduce of the MoE activation amax failed after \d+\.\d s \(collective timeout "
                    r"3 s\): .*\. Another rank of the expert-parallel group failed, exited or never reached this "
                    r"collective: look for its error first\. If the ranks are only slow .* raise the timeout with "
                    r"\$MOERULES_EP_TIMEOUT_S or build\(\.\.\., timeout_s=\.\.\.\)$", report["error"]), report["error"]
    assert TIMEOUT_S - 0.5 <= report["elapsed"] <= TIMEOUT_S + SLACK_S


def test_a_rank_that_dies_makes_the_other_fail_fast(fault_pool):
    outcomes = fault_pool.outcomes(fail_or_forward, Case(pf="all2all", timeout_s=TIMEOUT_S), 1, "exit",
                                   wait_s=TIMEOUT_S + 30, answers=1)
    assert 1 not in outcomes
    status, report = outcomes[0]
    assert status == "ok" and report["error"] is not None
    assert re.match(r"rank 0/2: all_to_all_single of the MoE counts failed after \d+\.\d s \(collective timeout 3 s\)",
                    report["error"]), report["error"]
    assert report["elapsed"] <= TIMEOUT_S + SLACK_S


def test_a_rank_that_never_joins_fails_init_within_the_timeout(one_thread):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_join_alone_into, args=(free_port(), results), daemon=True)
    start = time.monotonic()
    proc.start()
    report = results.get(timeout=TIMEOUT_S + 60)
    proc.join(timeout=10)
    assert report["error"] is not None, "init returned although rank 1 never started"
    assert re.match(r"rank 0/2: the gloo process group did not form within 3 s \(.*\)\. Every rank must start and "
                    r"reach init: check that all ranks launched \(torchrun --nproc-per-node N\), that they share "
                    r"MASTER_ADDR/MASTER_PORT, or raise \$MOERULES_EP_TIMEOUT_S$", report["error"]), report["error"]
    assert report["elapsed"] <= TIMEOUT_S + SLACK_S
    assert time.monotonic() - start < TIMEOUT_S + 60


def _join_alone_into(port: int, results) -> None:
    results.put(join_alone(port, TIMEOUT_S))
