"""bench/vllm_triton.py: vLLM 0.33's fused_moe_kernel, run from its own fused_moe.py through the harness's
stand-ins, agrees with our GEMMs (fp16 and FP8 under the interpreter: tests/kernels/conftest.py), its config
lookup is vLLM's, and a fused_moe.py the harness cannot serve is refused by name.

vLLM's file is located as the harness does (the installed vllm package, which scripts/test.sh installs, else
carry/vllm033); the tests skip only when there is none.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types

import pytest
import torch
from kernel_helpers import bench_module, needs_interpreter, run_with_config

from moerules.kernels.triton.config import GemmConfig, MoEConfig


@pytest.fixture
def vt(monkeypatch):
    return bench_module(monkeypatch, "vllm_triton")


@pytest.fixture
def fused_moe_dir(vt):
    try:
        return vt.find_fused_moe(None)
    except vt.VllmNotFound as exc:
        pytest.skip(f"vLLM 0.33's fused_moe.py cannot be located: {exc}")


# The smoke path runs tiny fp16 shapes on CPU tensors through the Triton interpreter; on a GPU machine
# bench/vllm_triton.py itself checks both sides at every point of the real grid before timing it.
INTERPRETER_ONLY = needs_interpreter("the harness's smoke path runs in the Triton interpreter (CPU)")


def _side_by_side(vt, tmp_path):
    args = argparse.Namespace(smoke=True, models=None, out=str(tmp_path), ms=None, schemes=None, vllm_dir=None)
    return vt.SideBySide(args)


# (model, scheme, M, vLLM's SWAP_AB, naive one-slot-per-block assignment): tiny has E=8, k=2, so M=1 is naive
# (4*M*k <= E); the stand-in capability is sm_90, where vLLM swaps A and B for FP8 at BLOCK_SIZE_M < 64.
# tiny-oss has biases (HAS_BIAS) and the interleaved swigluoai.
POINTS = [("tiny", "bf16", 1, False, True), ("tiny", "bf16", 40, False, False), ("tiny", "fp8_tensor", 5, True, False),
          ("tiny", "fp8_block", 40, True, False), ("tiny-oss", "bf16", 5, False, False)]


@INTERPRETER_ONLY
@pytest.mark.parametrize("model,scheme,M,swap_ab,naive", POINTS)
def test_vllm_kernel_agrees_with_ours(vt, fused_moe_dir, tmp_path, model, scheme, M, swap_ab, naive):
    row, _, _ = _side_by_side(vt, tmp_path).compare(model, scheme, M)
    # Same inputs on both sides, so only accumulation order and output rounding differ: far inside the tolerance.
    assert max(row["gemm1_rel_err"], row["rel_err"]) <= 3e-3 and row["tol"] == (1e-2 if scheme == "bf16" else 3e-2)
    assert row["ok"]
    launched = row["vllm_config"]["launched"]
    assert (launched["SWAP_AB"], launched["naive_block_assignment"]) == (swap_ab, naive)
    assert row["vllm_config"]["source"] == "get_default_config"  # no tuned file for the CPU


@INTERPRETER_ONLY
@pytest.mark.parametrize("model,scheme,M", [("tiny", "bf16", 40), ("tiny", "fp8_tensor", 5)])
def test_a_sorted_intermediate_is_compared_and_handed_over_in_slot_order(vt, fused_moe_dir, tmp_path, monkeypatch,
                                                                          model, scheme, M):
    """With MoEConfig.SORTED_INTER our GEMM1 writes by aligned row; its output is checked against vLLM's, and handed
    to vLLM's GEMM2, in slot order (vllm_triton.in_slot_order)."""
    run_with_config(monkeypatch, lambda cfg: dataclasses.replace(cfg, SORTED_INTER=True))
    row, _, ours = _side_by_side(vt, tmp_path).compare(model, scheme, M)
    assert row["ours_config"]["SORTED_INTER"] and ours.gemm1_out.shape[0] == M * 2
    assert max(row["gemm1_rel_err"], row["rel_err"]) <= 3e-3 and row["ok"]


@INTERPRETER_ONLY
@pytest.mark.parametrize("caught_by", ["rel_err", "gemm1_rel_err"])
def test_disagreement_fails_the_point(vt, fused_moe_dir, tmp_path, monkeypatch, caught_by):
    """A wrong vLLM launch is caught by its check and left out of the geomeans: GEMM2 without the router
    weight (mul_routed_weight False), GEMM1 with the experts' weights in reverse order (a wrong expert index)."""
    sbs = _side_by_side(vt, tmp_path)
    real = sbs.vllm.invoke_fused_moe_triton_kernel
    k = sbs.bench.models["tiny"].k

    def wrong(*args, **kwargs):
        args = list(args)
        if caught_by == "rel_err" and args[10] == 1:  # GEMM2 (top_k 1)
            args[9] = False
        if caught_by == "gemm1_rel_err" and args[10] == k:  # GEMM1
            args[1] = args[1].flip(0).contiguous()
        return real(*args, **kwargs)
    monkeypatch.setattr(sbs.vllm, "invoke_fused_moe_triton_kernel", wrong)
    sbs.rows = [sbs.point("tiny", "bf16", 5)]
    assert not sbs.rows[0]["ok"] and sbs.rows[0][caught_by] > 0.1
    assert sbs.geomeans() == {}


def test_config_lookup_reads_vllms_tuned_file(vt, fused_moe_dir):
    """gpt-oss-120b bf16 on an H100: vLLM's tuned file, nearest M; DeepSeek-V3 block FP8: no file, its default."""
    v = vt.load_vllm(fused_moe_dir, vt._VllmStandIns((9, 0), "NVIDIA_H100_80GB_HBM3"))
    name = "E=128,N=2880,device_name=NVIDIA_H100_80GB_HBM3.json"
    table = {int(m): c for m, c in json.loads((fused_moe_dir / "configs" / name).read_text()).items()
             if m != "triton_version"}
    nearest = min(table, key=lambda m: abs(m - 300))
    assert v.try_get_optimal_moe_config((128, 5760, 2880), (128, 2880, 2880), 4, None, 300) == table[nearest]
    assert v.get_config_file_name(128, 2880, None, None) == name
    cfg = v.try_get_optimal_moe_config((256, 4096, 7168), (256, 7168, 2048), 8, "fp8_w8a8", 16,
                                       block_shape=[128, 128])
    assert cfg == v.get_default_config(16, 256, 2048, 7168, 8, "fp8_w8a8", [128, 128])
    assert (cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["GROUP_SIZE_M"]) == (16, 128, 1)


def test_peer_seed_is_vllms_launched_config_in_our_tiles(vt, fused_moe_dir):
    """DeepSeek-V3 block FP8 at M=16 on an H100: vLLM launches its default M16 N128 K128 G1 w4 s3 with SWAP_AB
    (sm_90, BLOCK_M < 64, BLOCK_N >= 64); as ours, GEMM1 takes 64 gate + 64 up rows, GEMM2 128 columns."""
    v, stand_ins = vt.load_vllm_for_device(str(fused_moe_dir), smoke=True)
    w = type("W", (), {"w13": torch.empty(256, 4096, 7168, device="meta"),
                       "w2": torch.empty(256, 7168, 2048, device="meta")})()
    config, launched = vt.vllm_config(v, stand_ins, w, "fp8_block", 16, 8)
    assert config == v.get_default_config(16, 256, 2048, 7168, 8, "fp8_w8a8", [128, 128])
    assert launched["SWAP_AB"] is True and launched["BLOCK_SIZE_K"] == 128
    gemm = dict(BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3, SWAP_AB=True)
    assert vt.as_our_config(launched) == MoEConfig(BLOCK_M=16, gemm1=GemmConfig(BLOCK_N=64, **gemm),
                                                   gemm2=GemmConfig(BLOCK_N=128, **gemm))


def test_unknown_vllm_names_are_refused(vt, fused_moe_dir, tmp_path):
    """A fused_moe.py referencing a name with no stand-in, or lacking a function, is refused by name."""
    (tmp_path / "configs").mkdir()
    stubs = [f"def {n}():\n    return None\n" for n in vt.VLLM_FUNCTIONS if n != "get_default_config"]
    (tmp_path / "fused_moe.py").write_text("\n".join(stubs) + "\ndef get_default_config():\n    return mystery()\n")
    with pytest.raises(vt.VllmNotFound, match=r"references \['mystery'\], which bench/vllm_triton.py has no stand-in"):
        vt.load_vllm(tmp_path, vt._VllmStandIns((9, 0), "cpu"))
    (tmp_path / "fused_moe.py").write_text("\n".join(stubs))
    with pytest.raises(vt.VllmNotFound, match=r"has no get_default_config: not vLLM 0.33's fused_moe.py\?"):
        vt.load_vllm(tmp_path, vt._VllmStandIns((9, 0), "cpu"))


def test_vllm_imports_are_refused(vt):
    guarded = vt._VllmStandIns._builtins()["__import__"]
    with pytest.raises(ImportError, match=r"does not load vllm modules \(vllm._custom_ops\)"):
        guarded("vllm._custom_ops", None, None, ("moe_sum",), 0)
    assert guarded("vllm.model_executor.layers.fused_moe", None, None, ("get_config",), 0).get_config() is None


def test_rounds_time_the_sides_in_turn_and_keep_each_fastest(vt):
    """Each round times every part of both sides in one interleaved loop; the rounds keep each part's minimum."""
    rounds = iter([{"vllm": 10.0, "ours": 20.0, "vllm_gemm1": 6.0, "vllm_gemm2": 5.0, "ours_gemm1": 9.0, "ours_gemm2": 8.0},
                   {"vllm": 12.0, "ours": 7.0, "vllm_gemm1": 4.0, "vllm_gemm2": 6.0, "ours_gemm1": 11.0, "ours_gemm2": 3.0}])
    asked = []
    sbs = object.__new__(vt.SideBySide)
    sbs.rounds, sbs.per_gemm = 2, True
    sbs.bench = types.SimpleNamespace(interleaved_us=lambda fns: (asked.append(list(fns)), next(rounds))[1])
    side = {who: vt.Side(gemm1=lambda: None, gemm2=lambda: None, out=None, gemm1_out=None, config={})
            for who in ("vllm", "ours")}
    assert sbs.timings(side["vllm"], side["ours"]) == {
        "vllm_us": 10.0, "ours_us": 7.0, "vllm_gemm1_us": 4.0, "vllm_gemm2_us": 5.0, "ours_gemm1_us": 9.0,
        "ours_gemm2_us": 3.0, "rounds": 2}
    assert asked == [["vllm", "vllm_gemm1", "vllm_gemm2", "ours", "ours_gemm1", "ours_gemm2"]] * 2


def test_each_part_goes_first_in_as_many_turns(monkeypatch):
    moe = bench_module(monkeypatch, "moe")
    assert [moe.turn_order(["a", "b", "c"], t) for t in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def _point(ratio: float, cap: float, ok: bool = True) -> dict:
    return {"scheme": "bf16", "ok": ok, "ratio": ratio, "vllm_over_floor": cap}


def test_headroom_splits_the_points_at_the_bar_by_their_cap(vt):
    """Two points capped below 1.10 (vLLM / floor 1.02, 1.05) at 1.00 and 1.02, two free ones (cap 1.5) at 1.10 and
    1.20, a failing point left out: the free two would need exp((4 ln 1.1 - ln 1.00 - ln 1.02) / 2) = 1.1981."""
    rows = [_point(1.00, 1.02), _point(1.02, 1.05), _point(1.10, 1.5), _point(1.20, 1.5), _point(0.5, 2.0, ok=False)]
    got = vt.headroom(rows)
    assert (got["bar"], got["capped"], got["uncapped"]) == (1.10, 2, 2)
    assert got["capped_geomean"] == pytest.approx(1.02 ** 0.5)
    assert got["uncapped_geomean"] == pytest.approx((1.10 * 1.20) ** 0.5)
    assert got["uncapped_needed"] == pytest.approx(1.1981, abs=1e-4)


def test_headroom_needs_an_uncapped_point(vt):
    assert vt.headroom([_point(1.0, 1.05)]) is None
    assert vt.headroom([_point(1.2, 1.3)])["capped_geomean"] is None


def _run_point(model: str, M: int, ratio: float, block_m: int, ok: bool = True) -> dict:
    g = {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}
    return {"model": model, "scheme": "bf16", "M": M, "ok": ok, "ratio": ratio,
            "ours_config": {"BLOCK_M": block_m, "gemm1": g, "gemm2": g}}


def test_against_a_baseline_the_changed_points_are_told_from_the_drift(vt):
    """--baseline: a point whose config changed (BLOCK_M 64 -> 128) against two that kept theirs, whose drift
    1.00 -> 1.05 and 1.10 -> 1.10 shows what a change must clear. A config written with its defaults spelled out is
    the same config; a point failing in either run, or in only one of them, is left out."""
    then = [_run_point("a", 1, 1.00, 64), _run_point("a", 16, 1.10, 64), _run_point("a", 64, 1.20, 64),
            _run_point("a", 256, 1.0, 64), _run_point("b", 1, 1.0, 64)]
    spelled = _run_point("a", 16, 1.10, 64)
    spelled["ours_config"]["gemm1"] = dict(spelled["ours_config"]["gemm1"], TMA=False, MAXNREG=None)
    spelled["ours_config"]["TAIL_M"] = 0
    now = [_run_point("a", 1, 1.05, 64), spelled, _run_point("a", 64, 1.32, 128),
           _run_point("a", 256, 2.0, 128, ok=False), _run_point("c", 1, 3.0, 128)]
    got = vt.against_baseline(now, then)
    assert got["changed"] == {"points": 1, "before": pytest.approx(1.20), "after": pytest.approx(1.32),
                              "each": [{"point": "a bf16 M=64", "before": 1.20, "after": 1.32}]}
    assert (got["unchanged"]["points"], got["unchanged"]["before"], got["unchanged"]["after"]) == \
        (2, pytest.approx((1.00 * 1.10) ** 0.5), pytest.approx((1.05 * 1.10) ** 0.5))
    assert vt.against_baseline(now, [_run_point("d", 1, 1.0, 64)]) is None


def test_the_table_reports_the_baseline_split(vt):
    sbs = object.__new__(vt.SideBySide)
    sbs.rows = [_run_point("a", 1, 1.05, 64), _run_point("a", 64, 1.32, 128)]
    sbs.baseline = ("old/results.json", [_run_point("a", 1, 1.00, 64), _run_point("a", 64, 1.20, 64)])
    assert sbs.baseline_lines() == [
        "", "Against old/results.json: the 1 points whose config changed went 1.200 -> 1.320; the 1 others "
            "1.000 -> 1.050 (the drift between the runs).",
        "", "| changed point | vLLM / ours then | now |", "|---|---|---|", "| a bf16 M=64 | 1.200 | 1.320 |"]
    sbs.baseline = None
    assert sbs.baseline_lines() == []


@pytest.mark.parametrize("content,error", [
    (None, "cannot read {path}: No such file or directory"),
    ("{not json", "{path} is not a results.json of bench/vllm_triton.py (no \"rows\")"),
    ('{"geomean": 1.0}', "{path} is not a results.json of bench/vllm_triton.py (no \"rows\")"),
    ('{"rows": [{"ok": true, "model": "a", "scheme": "bf16", "M": 1}]}',
     "{path}: row 0 has no ratio, ours_config; a side-by-side's rows hold model, scheme, M, ratio, ours_config")])
def test_a_baseline_that_is_not_a_side_by_side_is_refused_by_name(vt, tmp_path, capsys, content, error):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        vt.main(["--baseline", str(path), "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert f"argument --baseline: {error.format(path=path)}" in capsys.readouterr().err


def test_the_table_names_every_field_our_entry_sets(vt):
    """The side-by-side's "our config" column: row-tile fields and each GEMM's flags, as the data file holds them."""
    from moerules.kernels.triton.config import GemmConfig, MoEConfig
    g1 = GemmConfig(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, TMA=True, MAXNREG=168)
    g2 = GemmConfig(BLOCK_N=256, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=3, SWAP_AB=True, HALF_MMA=True,
                    PERSISTENT=1)
    entry = MoEConfig(BLOCK_M=128, gemm1=g1, gemm2=g2, TAIL_M=32, SORTED_INTER=True, GEMM2_BLOCK_M=64).to_dict()
    assert vt._our_tiles(entry) == ("M128 tail 32 gemm2 rows 64 sorted; 1: N128 K64 G8 w8 s4 tma maxnreg 168; "
                                    "2: N256 K128 G1 w8 s3 swap half persistent 1")
    assert vt._our_tiles(MoEConfig(BLOCK_M=16, gemm1=g1, gemm2=g1).to_dict()).startswith("M16; 1: ")
