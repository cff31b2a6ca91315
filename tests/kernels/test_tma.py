"""Weight tiles copied by TMA (GemmConfig.TMA, fused_moe._tma_tile) compute the same layer as address loads.

Every cell (MX included), both MMA orientations, the three weight layouts the boxes read: gated halves (silu: two
planes of [2E, I, K]), interleaved pairs (swigluoai: 2 * BLOCK_N consecutive rows, accumulator columns alternating;
MXFP4's paired slabs) and non-gated rows; H=160 and I=96 are not multiples of the boxes, so the copy engine's zero
fill past N and K is in every point. Tolerances are test_fused_moe.py's.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from kernel_helpers import (DEVICE, TRITON_DTYPE, _both_gemms, bench_module, make_layer, needs_interpreter, random_inputs,
                            reference64, rel_err)
from test_fused_moe import triton_tol

from moerules.activation import Activation
from moerules.errors import KernelInputError
from moerules.kernels.scheme import Scheme, scheme_cells
from moerules.kernels.triton import launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config
from moerules.quant import QuantConfig

CELLS = list(scheme_cells())
_TILE = GemmConfig(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2, TMA=True)
INTERPRETER_ONLY = needs_interpreter("the probe's smoke path runs in the Triton interpreter (CPU)")


def _run(layer, M, top_k, monkeypatch, **fields):
    cfg = _both_gemms(MoEConfig(BLOCK_M=16, gemm1=_TILE, gemm2=_TILE), **fields)
    monkeypatch.setattr(launch, "get_config", lambda **kwargs: cfg)
    x, ids, w = random_inputs(layer, M, top_k, device=DEVICE)
    return layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("activation", [Activation.silu, Activation.swigluoai, Activation.silu_no_mul])
@pytest.mark.parametrize("cell", CELLS)
def test_tma_tiles_every_cell(cell, activation, swap, poison_empty, monkeypatch):
    layer = make_layer("triton.fused_moe", cell, activation=activation, dtype=TRITON_DTYPE, bias=True, device=DEVICE)
    out, ref = _run(layer, 13, 2, monkeypatch, SWAP_AB=swap)
    assert rel_err(out, ref) < triton_tol(cell)


def test_tma_block_scales_follow_the_interleaved_rows(poison_empty, monkeypatch):
    """Block-128 weight scales of interleaved rows: I = 192 puts gate/up pairs of two scale blocks in one box."""
    layer = make_layer("triton.fused_moe", "fp8_w8a8/block128/group128", activation=Activation.swigluoai,
                       dtype=TRITON_DTYPE, I=192, device=DEVICE)
    out, ref = _run(layer, 9, 2, monkeypatch, BLOCK_N=128, BLOCK_K=128)
    assert rel_err(out, ref) < triton_tol("fp8_w8a8/block128/group128")


def test_tma_refuses_rows_the_copy_engine_cannot_read(monkeypatch):
    """K = 100 fp16 values is 200 bytes a row, not a multiple of 16: the config's TMA cannot be honoured."""
    layer = make_layer("triton.fused_moe", "unquantized", dtype=TRITON_DTYPE, H=100, device=DEVICE)
    with pytest.raises(KernelInputError, match=r"gemm1: the config asks for TMA weight copies, which cannot read "
                                               r"these weights \(rows of 100 x 2 bytes"):
        _run(layer, 4, 2, monkeypatch)


def test_tma_config_on_gemv_rows_is_refused():
    with pytest.raises(ValueError, match=r"gemm1: TMA weight copies serve MMA tiles, not GEMV rows \(BLOCK_M 1\)"):
        check_config(MoEConfig(BLOCK_M=1, gemm1=_TILE, gemm2=_TILE), Scheme.from_quant(QuantConfig()))


@INTERPRETER_ONLY
def test_tma_probe_installs_each_gemms_faster_load(monkeypatch, tmp_path):
    """bench/tma_probe.py --gemms --install: TMA goes into the tuned entry of a GEMM only where it timed at least
    INSTALL_MARGIN faster (GEMM1 5% here; GEMM2's 0.5% is inside the margin), and both loads give one output."""
    from moerules.kernels.triton import config
    probe, moe = bench_module(monkeypatch, "tma_probe"), bench_module(monkeypatch, "moe")
    for module in (moe, config):
        monkeypatch.setattr(module, "CONFIG_DIR", tmp_path / "configs")
    config._load_file.cache_clear()
    times = {"address_gemm1_us": 100.0, "tma_gemm1_us": 95.0, "address_gemm2_us": 100.0, "tma_gemm2_us": 99.5}
    monkeypatch.setattr(probe, "fastest_interleaved", lambda time_us, rounds, sides: dict(times))
    probe.main(["--smoke", "--gemms", "--install", "--points", "tiny:fp8_tensor:40", "--out", str(tmp_path / "out")])
    config._load_file.cache_clear()
    row, = json.loads((tmp_path / "out" / "tma_probe.json").read_text())
    assert (row["installed_tma"], row["tma_diff"], row["gemm1 tma/address"]) == ([True, False], 0.0, 1.053)
    written = tmp_path / "configs" / "E=8,N=128,device_name=cpu,dtype=fp8_w8a8.json"
    entry = json.loads(written.read_text())["40"]
    assert (entry["gemm1"]["TMA"], entry["gemm2"]["TMA"]) == (True, False)
    # Measured again to the same decision, the entry stays byte for byte as written (no rewrite, no new fields).
    written.write_text(written.read_text().replace(' "TMA": false', ' "TMA": false '))
    before = written.read_text()
    probe.main(["--smoke", "--gemms", "--install", "--points", "tiny:fp8_tensor:40", "--out", str(tmp_path / "out")])
    assert written.read_text() == before


def test_tma_probe_installs_only_from_gemm_timings(monkeypatch, capsys):
    probe = bench_module(monkeypatch, "tma_probe")
    with pytest.raises(SystemExit) as exc:
        probe.main(["--smoke", "--install", "--out", "unused"])
    assert exc.value.code == 2 and "--install needs --gemms, --tile or --from-device" in capsys.readouterr().err


def test_a_tile_variant_changes_only_the_fields_it_names(monkeypatch):
    probe = bench_module(monkeypatch, "tma_probe")
    in_use = MoEConfig(BLOCK_M=64, gemm1=_TILE, gemm2=GemmConfig(BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8,
                                                                  num_stages=3))
    name, change = probe.tile_variant('n64w4={"BLOCK_M": 128, "gemm1": {"BLOCK_N": 64, "num_warps": 4}}')
    assert name == "n64w4"
    assert change(in_use, {}) == MoEConfig(BLOCK_M=128, gemm1=GemmConfig(BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4,
                                                                      num_stages=2, TMA=True), gemm2=in_use.gemm2)


@pytest.mark.parametrize("arg, message", [
    ('n64', "expected NAME=JSON"),
    ('n64={"gemm3": {}}', "expected NAME=JSON"),
    ('n64={"gemm1": {"BLOKN": 64}}', "gemm1 has no field BLOKN"),
    ('n64={"gemm1": ', "Expecting value"),
])
def test_a_malformed_tile_variant_is_refused_with_its_reason(monkeypatch, capsys, arg, message):
    probe = bench_module(monkeypatch, "tma_probe")
    with pytest.raises(SystemExit) as exc:
        probe.main(["--smoke", "--gemms", "--tile", arg, "--out", "unused"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("arg", ["NVIDIA_H200", "h200=", "=NVIDIA_H200"])
def test_a_malformed_device_variant_is_refused_with_its_form(monkeypatch, capsys, arg):
    probe = bench_module(monkeypatch, "tma_probe")
    with pytest.raises(SystemExit) as exc:
        probe.main(["--smoke", "--gemms", "--from-device", arg, "--out", "unused"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--from-device {arg!r}: expected NAME=DEVICE" in err


@INTERPRETER_ONLY
def test_tile_probe_rows_hold_each_variant_against_the_config_in_use(monkeypatch, tmp_path):
    """--tile: the config in use and each named variant timed in turn; ratios are in_use µs / the variant's."""
    probe = bench_module(monkeypatch, "tma_probe")
    times = {"in_use_gemm1_us": 100.0, "in_use_gemm2_us": 50.0, "n16_gemm1_us": 80.0, "n16_gemm2_us": 50.0}
    monkeypatch.setattr(probe, "fastest_interleaved", lambda time_us, rounds, sides: dict(times))
    probe.main(["--smoke", "--gemms", "--points", "tiny:fp8_tensor:40", "--tile", 'n16={"gemm1": {"BLOCK_N": 16}}',
                "--out", str(tmp_path)])
    row, = json.loads((tmp_path / "tile_probe.json").read_text())
    assert (row["gemm1 n16/in_use"], row["gemm2 n16/in_use"]) == (1.25, 1.0)
    assert row["n16_diff"] < 1e-2 and "n16_error" not in row


TINY_FP8_FILE = "E=8,N=128,device_name={},dtype=fp8_w8a8.json"   # the smoke model's tuned file on a device
# An entry of another device's file (and of the cpu's at another M), unlike the heuristic's config at M=40.
OTHER_ENTRY = MoEConfig(BLOCK_M=32, gemm1=GemmConfig(BLOCK_N=32, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=3),
                        gemm2=GemmConfig(BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2))


def _configs_in(monkeypatch, tmp_path, files: dict[str, dict[int, MoEConfig]]):
    """CONFIG_DIR (the launcher's and the tuner's) -> tmp_path/configs, holding `files` ({device: {M: entry}})."""
    from moerules.kernels.triton import config
    for module in (bench_module(monkeypatch, "moe"), config):
        monkeypatch.setattr(module, "CONFIG_DIR", tmp_path / "configs")
    (tmp_path / "configs").mkdir()
    for device, table in files.items():
        (tmp_path / "configs" / TINY_FP8_FILE.format(device)).write_text(
            json.dumps({str(m): cfg.to_dict() for m, cfg in table.items()}))
    config._load_file.cache_clear()


@INTERPRETER_ONLY
@pytest.mark.parametrize("n16_gemm1_us, cpu_file, installed", [
    (90.0, {}, "n16"), (99.0, {}, "in_use"), (90.0, {1: OTHER_ENTRY}, "n16"), (99.0, {1: OTHER_ENTRY}, None)])
@pytest.mark.parametrize("gemms", [True, False])
def test_tile_probe_installs_the_fastest_variant_past_the_margin(monkeypatch, tmp_path, n16_gemm1_us, cpu_file,
                                                                 installed, gemms):
    """--tile --install: the fastest variant (both GEMMs summed, or the forward without --gemms: n16 beats w8 here)
    replaces the tuned entry only where it is TILE_INSTALL_MARGIN faster than the config in use; 1% faster leaves
    an existing file untouched, and writes the config in use into a file the probe creates (the GPU ran the
    heuristic), so M=40 keeps what won there."""
    from moerules.kernels.triton import config
    probe, moe = bench_module(monkeypatch, "tma_probe"), bench_module(monkeypatch, "moe")
    _configs_in(monkeypatch, tmp_path, {"cpu": cpu_file} if cpu_file else {})
    times = {"in_use_gemm1_us": 100.0, "in_use_gemm2_us": 50.0, "n16_gemm1_us": n16_gemm1_us, "n16_gemm2_us": 50.0,
             "w8_gemm1_us": 100.0, "w8_gemm2_us": 49.0}
    if not gemms:  # the forward: each variant's GEMMs plus the same 30 us of the rest
        times = {f"{v}_us": times[f"{v}_gemm1_us"] + times[f"{v}_gemm2_us"] + 30.0 for v in ("in_use", "n16", "w8")}
    monkeypatch.setattr(probe, "fastest_interleaved", lambda time_us, rounds, sides: dict(times))
    probe.main(["--smoke", "--install", "--points", "tiny:fp8_tensor:40", "--out", str(tmp_path / "out"),
                "--tile", 'n16={"gemm1": {"BLOCK_N": 16}}', "--tile", 'w8={"gemm2": {"num_warps": 8}}']
               + ["--gemms"] * gemms)
    config._load_file.cache_clear()
    row, = json.loads((tmp_path / "out" / "tile_probe.json").read_text())
    assert row.get("installed") == installed
    path = tmp_path / "configs" / TINY_FP8_FILE.format("cpu")
    before = {str(m): cfg.to_dict() for m, cfg in cpu_file.items()}
    in_use = cpu_file.get(1) or config.default_config(
        num_tokens=40, num_experts=8, top_k=2, scheme=Scheme.from_quant(moe.TIMED_SCHEMES["fp8_tensor"]))
    chosen = {"n16": replace(in_use, gemm1=replace(in_use.gemm1, BLOCK_N=16)), "in_use": in_use}.get(installed)
    assert (json.loads(path.read_text()) if path.exists() else None) == (
        before | {"40": chosen.to_dict()} if chosen else before or None)


@INTERPRETER_ONLY
@pytest.mark.parametrize("h200_gemm1_us, installed", [(80.0, "h200"), (99.0, None)])
def test_device_probe_times_and_installs_another_devices_entry(monkeypatch, tmp_path, h200_gemm1_us, installed):
    """--from-device h200=other: the entry the other device's file gives at the point (its nearest M) is what runs
    for that variant, and it replaces this device's entry only past the margin."""
    probe = bench_module(monkeypatch, "tma_probe")
    cpu_entry = replace(OTHER_ENTRY, BLOCK_M=16)
    _configs_in(monkeypatch, tmp_path, {"cpu": {1: cpu_entry}, "other": {32: OTHER_ENTRY}})
    checked = []
    monkeypatch.setattr(probe, "check_config", lambda cfg, scheme: checked.append(cfg))
    times = {"in_use_gemm1_us": 100.0, "in_use_gemm2_us": 50.0, "h200_gemm1_us": h200_gemm1_us, "h200_gemm2_us": 50.0}
    monkeypatch.setattr(probe, "fastest_interleaved", lambda time_us, rounds, sides: dict(times))
    probe.main(["--smoke", "--gemms", "--install", "--points", "tiny:fp8_tensor:40", "--from-device", "h200=other",
                "--rounds", "1", "--out", str(tmp_path / "out")])
    row, = json.loads((tmp_path / "out" / "tile_probe.json").read_text())
    assert set(checked) == {cpu_entry, OTHER_ENTRY} and row["h200_diff"] < 1e-2
    assert row.get("installed") == installed
    written = json.loads((tmp_path / "configs" / TINY_FP8_FILE.format("cpu")).read_text())
    assert written == {"1": cpu_entry.to_dict()} | ({"40": OTHER_ENTRY.to_dict()} if installed else {})


@INTERPRETER_ONLY
def test_a_file_the_device_probe_creates_times_every_point_against_the_heuristic(monkeypatch, tmp_path):
    """No file for this device: the other device's entry wins at M=40 and is written; at M=8 it loses, and what is
    written there is the heuristic this GPU ran before, not the M=40 entry the lookup would now give."""
    from moerules.kernels.triton import config
    probe, moe = bench_module(monkeypatch, "tma_probe"), bench_module(monkeypatch, "moe")
    _configs_in(monkeypatch, tmp_path, {"other": {32: OTHER_ENTRY}})
    h200_us = iter([80.0, 99.0])
    monkeypatch.setattr(probe, "fastest_interleaved", lambda time_us, rounds, sides: {"in_use_us": 100.0,
                                                                                      "h200_us": next(h200_us)})
    probe.main(["--smoke", "--install", "--points", "tiny:fp8_tensor:40", "tiny:fp8_tensor:8", "--from-device",
                "h200=other", "--rounds", "1", "--out", str(tmp_path / "out")])
    rows = json.loads((tmp_path / "out" / "tile_probe.json").read_text())
    assert [row["installed"] for row in rows] == ["h200", "in_use"]
    heuristic = config.default_config(num_tokens=8, num_experts=8, top_k=2,
                                      scheme=Scheme.from_quant(moe.TIMED_SCHEMES["fp8_tensor"]))
    assert heuristic != OTHER_ENTRY
    assert json.loads((tmp_path / "configs" / TINY_FP8_FILE.format("cpu")).read_text()) == {
        "40": OTHER_ENTRY.to_dict(), "8": heuristic.to_dict()}


@INTERPRETER_ONLY
def test_a_tile_variant_the_kernels_cannot_run_is_the_points_error(monkeypatch, tmp_path):
    """A variant is checked as a file entry is: TAIL_M at BLOCK_M is recorded as its error, nothing launched for
    it, and the other variants still timed (on the H200 it had crashed the probe, s42)."""
    probe = bench_module(monkeypatch, "tma_probe")
    probe.main(["--smoke", "--gemms", "--points", "tiny:fp8_tensor:40", "--tile", 't_big={"TAIL_M":1024}',
                "--tile", 'n16={"gemm1": {"BLOCK_N": 16}}', "--rounds", "1", "--out", str(tmp_path)])
    row, = json.loads((tmp_path / "tile_probe.json").read_text())
    assert row["t_big_error"].startswith("ValueError: TAIL_M=1024 must be a power of two from 16")
    assert "t_big_gemm1_us" not in row and row["n16_gemm1_us"] > 0 and row["n16_diff"] < 1e-2
