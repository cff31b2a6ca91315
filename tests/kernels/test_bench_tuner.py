"""bench/moe.py's tuner: the moves of its coordinate sweep (the timing needs a GPU; the moves do not)."""

from __future__ import annotations

import pytest
from kernel_helpers import bench_module

from moerules.kernels.triton.config import GemmConfig


@pytest.fixture
def tuner(monkeypatch):
    return object.__new__(bench_module(monkeypatch, "moe").Bench)


def test_a_block_n_move_also_moves_the_warps_in_step(tuner):
    """One field at a time cannot reach 32x128x32 at 8 warps from 32x64x32 at 4 (bench/results/s26): the BLOCK_N
    sweep offers both halves and doubles at the same warps, and with the warps scaled where 4 or 8 results."""
    g = GemmConfig(BLOCK_N=64, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=5)
    assert tuner.moves(g, "BLOCK_N", 32, gemv=False) == [
        GemmConfig(32, 32, 1, 4, 5), GemmConfig(128, 32, 1, 4, 5), GemmConfig(128, 32, 1, 8, 5)]
    g8 = GemmConfig(BLOCK_N=64, BLOCK_K=32, GROUP_M=1, num_warps=8, num_stages=5)
    assert tuner.moves(g8, "BLOCK_N", 32, gemv=False) == [
        GemmConfig(32, 32, 1, 8, 5), GemmConfig(128, 32, 1, 8, 5), GemmConfig(32, 32, 1, 4, 5)]


def test_other_fields_and_gemv_tiles_move_alone(tuner):
    g = GemmConfig(BLOCK_N=64, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=5)
    assert tuner.moves(g, "num_warps", 32, gemv=False) == [GemmConfig(64, 32, 1, 8, 5)]
    gemv = GemmConfig(BLOCK_N=16, BLOCK_K=512, GROUP_M=1, num_warps=4, num_stages=2)
    assert tuner.moves(gemv, "BLOCK_N", 1, gemv=True) == [GemmConfig(8, 512, 1, 4, 2), GemmConfig(32, 512, 1, 4, 2)]
