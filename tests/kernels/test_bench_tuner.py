"""bench/moe.py's tuner: its seeds and the moves of its coordinate sweep (the timing needs a GPU; these do not)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest
import torch
from kernel_helpers import bench_module

from moerules.activation import Dtype
from moerules.kernels.scheme import Scheme
from moerules.kernels.triton.config import GemmConfig, MoEConfig
from moerules.quant import QuantConfig
from moerules.quant import QuantFamily as F

MXFP4 = Scheme.from_quant(QuantConfig(family=F.mxfp4_w4a16))
BF16 = Scheme.from_quant(QuantConfig())


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


def test_register_caps_move_to_one_more_program_per_sm(tuner):
    """MAXNREG moves (GemmConfig.MAXNREG): none, or the register counts at which 2, 3 or 4 programs of the tile's
    warps share an SM's 65536 registers (multiples of 8, within ptxas's 24..255)."""
    g4 = GemmConfig(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    assert [m.MAXNREG for m in tuner.moves(g4, "MAXNREG", 8, gemv=False)] == [168, 128]
    g8 = dataclasses.replace(g4, num_warps=8, MAXNREG=128)
    assert [m.MAXNREG for m in tuner.moves(g8, "MAXNREG", 8, gemv=False)] == [None, 80, 64]
    assert "MAXNREG" in tuner.FIELDS


def test_half_mma_moves_are_kept_for_block_scaled_weights_only(tuner, monkeypatch):
    """HALF_MMA toggles like SWAP_AB and TMA; `valid` keeps a halved config for FP8 block-128 (session 47's H100
    winner at DeepSeek-V3 M=16384: 128 x 256 tiles in both GEMMs) and drops it for FP8 per tensor, which check_config
    refuses."""
    g = GemmConfig(BLOCK_N=128, BLOCK_K=128, GROUP_M=4, num_warps=8, num_stages=3)
    assert tuner.moves(g, "HALF_MMA", 8, gemv=False) == [dataclasses.replace(g, HALF_MMA=True)]
    assert "HALF_MMA" in tuner.FIELDS
    tuner.smoke = False
    half = MoEConfig(BLOCK_M=128, gemm1=dataclasses.replace(g, HALF_MMA=True),
                     gemm2=dataclasses.replace(g, BLOCK_N=256, HALF_MMA=True))
    schemes = bench_module(monkeypatch, "moe").TIMED_SCHEMES
    assert tuner.valid([half], Scheme.from_quant(schemes["fp8_block"])) == [half]
    assert tuner.valid([half], Scheme.from_quant(schemes["fp8_tensor"])) == []


def test_persistent_moves_are_kept_without_tail_tiles_only(tuner):
    """PERSISTENT moves to each other count of programs per SM (0: one per tile); `valid` keeps a persistent config
    of whole BLOCK_M tiles and drops one with tail tiles, which check_config refuses."""
    g = GemmConfig(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    assert [m.PERSISTENT for m in tuner.moves(g, "PERSISTENT", 8, gemv=False)] == [1, 2]
    assert [m.PERSISTENT for m in tuner.moves(dataclasses.replace(g, PERSISTENT=1), "PERSISTENT", 8,
                                              gemv=False)] == [0, 2]
    assert "PERSISTENT" in tuner.FIELDS
    tuner.smoke = False
    persistent = MoEConfig(BLOCK_M=128, gemm1=dataclasses.replace(g, PERSISTENT=1), gemm2=g)
    assert tuner.valid([persistent], BF16) == [persistent]
    assert tuner.valid([dataclasses.replace(persistent, TAIL_M=32)], BF16) == []


def test_the_nearest_tuned_entries_seed_the_tuner(monkeypatch):
    moe = bench_module(monkeypatch, "moe")
    tile = dict(BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    gemv = {"BLOCK_M": 1, "gemm1": {"BLOCK_N": 16, **tile}, "gemm2": {"BLOCK_N": 16, **tile}}
    mma = {"BLOCK_M": 64, "gemm1": {"BLOCK_N": 64, **tile}, "gemm2": {"BLOCK_N": 128, **tile, "MAXNREG": 168}}
    table = {"1": gemv, "256": mma, "1024": mma, "4096": dict(mma, BLOCK_M=128)}
    got = moe.neighbour_entries(table, 1024, gemv=False)
    assert [name for _, name in got] == ["the M=256 entry", "the M=4096 entry"]
    assert got[1][0] == MoEConfig.from_dict(table["4096"]) and got[1][0].gemm2.MAXNREG == 168
    assert [name for _, name in moe.neighbour_entries(table, 16, gemv=False)] == ["the M=256 entry"]
    assert [name for _, name in moe.neighbour_entries(table, 16, gemv=True)] == ["the M=1 entry", "the M=256 entry"]
    assert moe.neighbour_entries({}, 16, gemv=True) == []


def test_other_gpus_entries_seed_the_tuner(tuner, monkeypatch, tmp_path):
    """Another GPU's tuned file for the shape and dtype seeds the tuner with the entry it gives at M (its nearest M,
    256 for 1024); this GPU's own file (cpu) gives the config in use, which keeps that name; another shape's file
    gives nothing."""
    from moerules.kernels.triton import config
    moe = bench_module(monkeypatch, "moe")
    for module in (moe, config):
        monkeypatch.setattr(module, "CONFIG_DIR", tmp_path)
    tile = GemmConfig(BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=3)
    own = MoEConfig(BLOCK_M=32, gemm1=tile, gemm2=tile)
    other_shape = MoEConfig(BLOCK_M=32, gemm1=tile, gemm2=dataclasses.replace(tile, num_stages=4))
    h200 = MoEConfig(BLOCK_M=64, gemm1=dataclasses.replace(tile, GROUP_M=8), gemm2=tile)
    for name, table in (("E=8,N=14336,device_name=NVIDIA_H200,dtype=bf16.json", {"256": h200}),
                        ("E=8,N=14336,device_name=cpu,dtype=bf16.json", {"4096": own}),
                        ("E=8,N=4096,device_name=NVIDIA_H100_80GB_HBM3,dtype=bf16.json", {"1024": other_shape})):
        (tmp_path / name).write_text(json.dumps({m: cfg.to_dict() for m, cfg in table.items()}))
    config._load_file.cache_clear()
    tuner.smoke, tuner.peers, tuner.device, tuner.in_dtype = False, None, torch.device("cpu"), Dtype.bf16
    model = moe.MODELS["mixtral-8x7b"]
    w = types.SimpleNamespace(scheme=BF16, num_experts=model.E, intermediate=model.I, in_dtype=Dtype.bf16)
    seeds = tuner.seeds(1024, model, w, "bf16", only_in_use=False)
    config._load_file.cache_clear()
    assert seeds[h200] == "NVIDIA_H200's entry" and seeds[own] == "in use" and other_shape not in seeds
    assert [name for name in seeds.values() if name.endswith("'s entry")] == ["NVIDIA_H200's entry"]


@pytest.mark.parametrize("rows_per_expert, block_m", [(2, 16), (8, 16), (12, 32), (32, 64), (64, 64), (128, 128),
                                                      (512, 128)])
def test_triton_kernels_mxfp4_seed_takes_its_block_m(tuner, rows_per_expert, block_m):
    """opt_flags.py: twice the mean rows per expert while they are at most 64 (16..64), else the mean (up to 128)."""
    assert tuner.tk_mxfp4_config(rows_per_expert, gated=True, weight_rows=256, num_warps=8).BLOCK_M == block_m


def test_triton_kernels_mxfp4_seed_is_a_swapped_wgmma_tile_that_fits(tuner):
    """256 weight rows on the MMA's M side (gated GEMM1: 128 gate + 128 up), 128-deep K steps, 8 warps; and
    valid for MXFP4 (the tuner would drop a seed that check_config or shared memory rejects)."""
    cfg = tuner.tk_mxfp4_config(32, gated=True, weight_rows=256, num_warps=8)
    tile = dict(BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=3, SWAP_AB=True)
    assert (cfg.gemm1, cfg.gemm2) == (GemmConfig(BLOCK_N=128, **tile), GemmConfig(BLOCK_N=256, **tile))
    assert tuner.tk_mxfp4_config(32, gated=False, weight_rows=128, num_warps=4).gemm1.BLOCK_N == 128
    tuner.smoke = False
    assert tuner.valid([cfg], MXFP4) == [cfg]


@pytest.mark.parametrize("M, tk_block_m, in_use_block_m", [(256, 16, 16), (1024, 64, 32), (4096, 128, 128)])
def test_mxfp4_seeds_add_the_peer_tiles(tuner, monkeypatch, M, tk_block_m, in_use_block_m):
    """gpt-oss-120b (E=128, top-4) MXFP4 without a tuned file (device cpu): triton_kernels' two tiles at their
    BLOCK_M (8, 32, 128 mean rows per expert) and, where it differs, at the one in use. The MX default is the
    4-warp tile at the BLOCK_M in use, so that seed is "in use" (a config keeps its first name)."""
    model = bench_module(monkeypatch, "moe").MODELS["gpt-oss-120b"]
    tuner.smoke, tuner.peers, tuner.device, tuner.in_dtype = False, None, torch.device("cpu"), Dtype.bf16
    w = types.SimpleNamespace(scheme=MXFP4, num_experts=model.E, intermediate=model.I, in_dtype=Dtype.bf16)
    seeds = tuner.seeds(M, model, w, "mxfp4", only_in_use=False)
    for warps, rows in ((8, 256), (4, 128)):
        tk = tuner.tk_mxfp4_config(M * model.k / model.E, gated=True, weight_rows=rows, num_warps=warps)
        assert (tk.BLOCK_M, tk.gemm1.BLOCK_N, tk.gemm2.BLOCK_N, tk.gemm2.num_warps) == (tk_block_m, rows // 2, rows,
                                                                                       warps)
        assert tk in seeds and dataclasses.replace(tk, BLOCK_M=in_use_block_m) in seeds
    assert seeds[dataclasses.replace(tk, BLOCK_M=in_use_block_m)] == "in use"


def test_mxfp4_configs_are_timed_and_recorded_as_the_gemms_run_them(tuner):
    """An unswapped GEMV tile at GEMM1 BLOCK_N 8, K 64 on 1 warp runs as fragment_tiles makes it (swapped, a whole
    16-row slab, K 128, 4 warps): the tuner keeps that form, so it times it once and records what runs."""
    tuner.smoke = False
    as_given = GemmConfig(BLOCK_N=8, BLOCK_K=64, GROUP_M=1, num_warps=1, num_stages=2, SWAP_AB=False)
    runs_as = GemmConfig(BLOCK_N=16, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2, SWAP_AB=True)
    cfgs = [MoEConfig(1, as_given, as_given), MoEConfig(1, runs_as, runs_as)]
    assert tuner.valid(cfgs, MXFP4) == [MoEConfig(1, runs_as, runs_as)]
    bf16 = Scheme.from_quant(QuantConfig(family=F.unquantized))
    assert tuner.valid(cfgs, bf16) == cfgs


def test_the_sweep_offers_the_chained_launch_at_naive_decode_points_only(tuner):
    """CHAIN (kernels/triton/chain.py): the config chained as one launch runs it (gemm2 on gemm1's warps, no TMA), at
    gemm2's width, half and double; the chained config unchained; nothing past the naive assignment or where GEMM2's
    input is quantised."""
    moe, tuner.smoke = type(tuner), False
    model = types.SimpleNamespace(E=128, k=8)
    g1 = GemmConfig(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=5)
    g2 = GemmConfig(BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=8, num_stages=5, TMA=True)
    cfg = MoEConfig(BLOCK_M=16, gemm1=g1, gemm2=g2)
    bf16, fp8 = (Scheme.from_quant(QuantConfig(family=f)) for f in (F.unquantized, F.fp8_w8a8))
    chained = [MoEConfig(16, g1, dataclasses.replace(g2, BLOCK_N=n, num_warps=4, TMA=False), CHAIN=True)
               for n in (64, 32, 128)]
    assert tuner.chain_moves(cfg, 4, model, bf16) == chained
    assert tuner.valid(chained, bf16) == chained
    assert tuner.chain_moves(chained[2], 4, model, bf16) == [dataclasses.replace(chained[2], CHAIN=False)]
    assert tuner.chain_moves(cfg, 5, model, bf16) == []   # 40 slots for 128 experts: sorted blocks
    assert tuner.chain_moves(cfg, 4, model, fp8) == []
    assert "CHAIN" in moe.MOE_FIELDS


def test_the_sweep_offers_each_other_tail_tile_below_block_m_where_runs_are_sorted(tuner):
    """TAIL_M (align.py): none, 16, 32 or 64 rows, below BLOCK_M, other than the config's; nothing under the naive
    assignment, for 16-row blocks or for a chained config."""
    moe = type(tuner)
    model = types.SimpleNamespace(E=128, k=8)
    g = GemmConfig(BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=8, num_stages=4)
    cfg = MoEConfig(BLOCK_M=64, gemm1=g, gemm2=g, TAIL_M=32)
    assert tuner.tail_moves(cfg, 4096, model) == [dataclasses.replace(cfg, TAIL_M=t) for t in (0, 16)]
    assert [c.TAIL_M for c in tuner.tail_moves(dataclasses.replace(cfg, BLOCK_M=128, TAIL_M=0), 4096, model)] == \
        [16, 32, 64]
    assert tuner.tail_moves(dataclasses.replace(cfg, BLOCK_M=16, TAIL_M=0), 4096, model) == []
    assert tuner.tail_moves(cfg, 4, model) == []  # 32 slots for 128 experts: the naive assignment
    assert tuner.tail_moves(dataclasses.replace(cfg, CHAIN=True), 4096, model) == []
    assert "TAIL_M" in moe.MOE_FIELDS


def test_the_sweep_flips_the_intermediates_layout_where_runs_are_sorted(tuner):
    """SORTED_INTER: an unsorted config sorted, GEMM2's A tiles by address and by TMA; a sorted one unsorted; nothing
    under the naive assignment (no sorted order)."""
    moe = type(tuner)
    model = types.SimpleNamespace(E=128, k=8)
    g = GemmConfig(BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=8, num_stages=4)
    cfg = MoEConfig(BLOCK_M=64, gemm1=g, gemm2=g)
    assert tuner.sorted_moves(cfg, 4096, model) == [
        dataclasses.replace(cfg, SORTED_INTER=True, gemm2=dataclasses.replace(g, TMA=tma)) for tma in (False, True)]
    assert tuner.sorted_moves(dataclasses.replace(cfg, SORTED_INTER=True), 4096, model) == [cfg]
    assert tuner.sorted_moves(cfg, 4, model) == []  # 32 slots for 128 experts: the naive assignment
    assert "SORTED_INTER" in moe.MOE_FIELDS


def test_the_sweep_offers_gemm2_its_own_row_tiles_where_runs_are_sorted(tuner):
    """GEMM2_BLOCK_M: a half or a quarter of BLOCK_M (at least 16 rows), without tails longer than those (which they
    refuse), or back to BLOCK_M; nothing under the naive assignment, for 16-row blocks or for a chained config."""
    moe = type(tuner)
    model = types.SimpleNamespace(E=128, k=8)
    g = GemmConfig(BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=8, num_stages=4)
    cfg = MoEConfig(BLOCK_M=128, gemm1=g, gemm2=g, TAIL_M=64)
    assert tuner.gemm2_rows_moves(cfg, 4096, model) == [
        dataclasses.replace(cfg, GEMM2_BLOCK_M=64), dataclasses.replace(cfg, TAIL_M=0, GEMM2_BLOCK_M=32)]
    split = dataclasses.replace(cfg, TAIL_M=32, GEMM2_BLOCK_M=64)
    assert tuner.gemm2_rows_moves(split, 4096, model) == [dataclasses.replace(split, GEMM2_BLOCK_M=r) for r in (0, 32)]
    assert [c.GEMM2_BLOCK_M for c in tuner.gemm2_rows_moves(dataclasses.replace(cfg, BLOCK_M=32), 4096, model)] == [16]
    assert tuner.gemm2_rows_moves(dataclasses.replace(cfg, BLOCK_M=16, TAIL_M=0), 4096, model) == []
    assert tuner.gemm2_rows_moves(cfg, 4, model) == []  # 32 slots for 128 experts: the naive assignment
    assert tuner.gemm2_rows_moves(dataclasses.replace(cfg, CHAIN=True), 4096, model) == []
    assert "GEMM2_BLOCK_M" in moe.MOE_FIELDS


def test_the_sweep_stops_at_the_points_time_limit_keeping_the_best_so_far(tuner, monkeypatch):
    """--point-seconds: a device call's cap kills the tuner mid-point and loses it, so the sweep stops first. Each
    config timed here takes 10 s of a fake clock and the limit falls after the second: the third and every later
    move are not timed, and the best of the two is kept."""
    clock = {"now": 0.0}
    monkeypatch.setattr(sys.modules[type(tuner).__module__], "time", types.SimpleNamespace(time=lambda: clock["now"]))
    timed = []

    def time_us(fn, *, graph, rep):
        clock["now"] += 10.0
        timed.append(fn())
        return {64: 30.0, 32: 20.0, 128: 10.0, 256: 5.0}[timed[-1]]

    tuner.smoke, tuner.sweep_until = False, 15.0
    tuner.time_us, tuner.untimed = time_us, 0
    monkeypatch.setattr(tuner, "valid", lambda cfgs, scheme: cfgs)
    best = tuner.faster(lambda n: n, (40.0, 16), [64, 32, 128], BF16)
    assert (best, timed) == ((20.0, 32), [64, 32])
    assert tuner.faster(lambda n: n, best, [256], BF16) == best
    assert (timed, tuner.untimed) == ([64, 32], 2)  # counted for the point's log line
