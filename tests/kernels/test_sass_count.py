"""bench/sass_count.py: the fused-MoE GEMMs compiled for sm_90 on this CPU machine and counted, not timed.

It runs in a subprocess: the tests run Triton interpreted (tests/conftest.py), and compiling needs it not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_helpers import bench_module

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sass_count.py"


def _run(out: Path, *args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | ({"TRITON_INTERPRET": "1"} if interpret
                                                                               else {})
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=900)


def _gemm1_counts(out: Path, model: str, scheme: str, M: int, config: dict) -> dict:
    """GEMM1's row of one point compiled with `config`."""
    done = _run(out, "--models", model, "--schemes", scheme, "--ms", str(M), "--config", json.dumps(config))
    assert done.returncode == 0, done.stderr
    gemm1 = json.loads((out / "results.json").read_text())[0]
    assert gemm1["gemm"] == 1, gemm1
    return gemm1


def test_mxfp4_fragment_order_feeds_wgmma_from_registers(tmp_path):
    """gpt-oss-20b at M=16 on the MXFP4 default tiles (triton_kernels' 4-warp shape: 128 weight rows on wgmma's M
    side, 128-deep K): in fragment order each lane reads its packed words with 64- or 128-bit LDS (checkpoint order:
    64 LDS.U8 of values per step), the scales arrive through the same pipeline (no byte loads from global memory in the
    loop), nothing is stored, and the loop issues at most 3.9 instructions per weight (3.77 and 3.85 with
    Triton 3.6.0: scales group-major in their slabs, weight copies masked by K alone)."""
    tile = {"BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SWAP_AB": True}
    config = {"BLOCK_M": 16, "gemm1": {"BLOCK_N": 64, **tile}, "gemm2": {"BLOCK_N": 128, **tile}}
    done = _run(tmp_path, "--models", "gpt-oss-20b", "--ms", "16", "--config", json.dumps(config))
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [row["gemm"] for row in rows] == [1, 2]
    for row in rows:
        assert (row["BLOCK_M"], row["swap_ab"], row["mma"], row["stack_bytes"]) == (16, True, ["HGMMA"], 0)
        memory = row["loop_memory"]
        assert {"LDS.64", "LDS.128"} & set(memory), memory  # the values; scales come as LDS.U8/U16
        assert not {op for op in memory if op.startswith(("STS", "LDG.E.U8"))}, memory  # scales pipelined too
        assert 0 < row["per_weight"] <= 3.9


def test_gemm1_epilogue_amax_is_computed_once(tmp_path):
    """gpt-oss-120b FP8 per tensor at M=4096 on the H200 file's tiles: GEMM1 writes its tile's amax for GEMM2's
    dynamic scale (fused_moe.gemm1_gated_kernel, AMAX). Reduced from the stored values themselves, Triton gave
    the reduction another layout and computed the whole epilogue twice: 254 registers against 114 without the
    amax, one CTA per SM, GEMM1 26% slower on the H200 (bench/results/s30). Read back after the store: 120."""
    tile = {"BLOCK_K": 128, "GROUP_M": 1, "num_warps": 8, "num_stages": 3}
    config = {"BLOCK_M": 128, "gemm1": {"BLOCK_N": 64, "SWAP_AB": True, **tile}, "gemm2": {"BLOCK_N": 128, **tile}}
    gemm1 = _gemm1_counts(tmp_path, "gpt-oss-120b", "fp8_tensor", 4096, config)
    assert (gemm1["gemm"], gemm1["mma"], gemm1["stack_bytes"]) == (1, ["QGMMA"], 0)
    assert gemm1["registers"] <= 128


@pytest.mark.parametrize("cap", [None, 128])
def test_the_register_cap_keeps_two_programs_per_sm(tmp_path, cap):
    """gpt-oss-120b bf16 M=4096, the H200 file's GEMM1 tile (8 warps, 98 KB shared: room for two programs per SM):
    with the PTX sigmoid it compiled to 130 registers, one program per SM, and ran 1.32x slower on the H200; the
    file's MAXNREG 128 makes ptxas fit it in 128 with nothing spilled (bench/results/s33)."""
    tile = {"BLOCK_K": 64, "GROUP_M": 1, "num_warps": 8, "num_stages": 3}
    config = {"BLOCK_M": 128, "gemm1": {"BLOCK_N": 64, "TMA": True, **tile, **({"MAXNREG": cap} if cap else {})},
              "gemm2": {"BLOCK_N": 128, **tile}}
    gemm1 = _gemm1_counts(tmp_path, "gpt-oss-120b", "bf16", 4096, config)
    assert gemm1["stack_bytes"] == 0
    assert (gemm1["registers"] > 128) == (cap is None), gemm1["registers"]


def test_the_ptx_sigmoid_shortens_gemm1s_epilogue(tmp_path):
    """Mixtral-8x7B FP8 per tensor M=1024 on the H200 file's tiles of session 33 (one 8-warp program per SM,
    nothing to overlap its epilogue): with tl.sigmoid and two scale multiplies 2719 instructions lay outside the K
    loop, with the PTX sigmoid and one scale factor 2079 (Triton 3.6.0); GEMM1 ran 1.02-1.035x faster on the H200
    (bench/results/s33)."""
    tile = {"BLOCK_K": 128, "GROUP_M": 16, "num_warps": 8, "num_stages": 4}
    config = {"BLOCK_M": 128, "gemm1": {"BLOCK_N": 128, "TMA": True, **tile}, "gemm2": {"BLOCK_N": 256, **tile}}
    gemm1 = _gemm1_counts(tmp_path, "mixtral-8x7b", "fp8_tensor", 1024, config)
    assert gemm1["gemm"] == 1 and gemm1["outside_loop"] <= 2200, gemm1


CARRIED_TK = Path(__file__).resolve().parents[2] / "carry" / "triton_kernels"


@pytest.mark.skipif(not (CARRIED_TK / "triton_kernels" / "matmul_ogs.py").is_file(),
                    reason="no carried triton_kernels (bench/get_triton_kernels.sh; its code is never committed)")
def test_triton_kernels_gemms_are_counted_beside_ours(tmp_path):
    """gpt-oss-20b at M=256 with --triton-kernels: after our two GEMMs, triton_kernels' two, captured from its own
    launcher as vLLM 0.33 calls it (the 64x256x128 tile ncu profiled, at the 173 and 175 registers ncu counted):
    wgmma fed the decoded weights from registers, the packed weights read 16 bytes at a time, nothing stored, one
    wgmma wait per 16 of K, under 4 instructions per weight."""
    done = _run(tmp_path, "--models", "gpt-oss-20b", "--ms", "256", "--triton-kernels", str(CARRIED_TK))
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(row["side"], row["gemm"]) for row in rows] == [("moerules", 1), ("moerules", 2), ("triton_kernels", 1),
                                                           ("triton_kernels", 2)]
    assert [row["registers"] for row in rows[2:]] == [173, 175]
    for row in rows[2:]:
        assert "64x256x128" in row["kernel"] and (row["mma"], row["stack_bytes"]) == (["HGMMA"], 0)
        assert not [op for op in row["loop_memory"] if op.startswith("STS")] and row["loop_memory"]["LDS.128"] == 4
        assert row["loop_syncs"]["WARPGROUP.DEPBAR.LE"] == row["BLOCK_K"] // 16 and row["per_weight"] < 4


def test_a_missing_triton_kernels_folder_is_refused(tmp_path):
    done = _run(tmp_path, "--triton-kernels", str(tmp_path / "nowhere"))
    assert done.returncode == 2
    assert done.stderr.startswith("sass_count.py: no triton_kernels package (triton_kernels/matmul_ogs.py) in ")


def test_interpreted_triton_is_refused(tmp_path):
    done = _run(tmp_path, interpret=True)
    assert done.returncode == 2
    assert done.stderr == "sass_count.py: compiles for sm_90 and cannot under TRITON_INTERPRET=1; run it without\n"


def test_the_main_loop_is_the_longest_backward_branch(monkeypatch):
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;",
        "        /*0020*/               @P0 BRA 0x10 ;",                   # a 2-instruction loop
        "        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
        "        /*0040*/                   LDS.128 R8, [R2] ;",
        "        /*0050*/              @!P1 BRA 0x30 ;",                   # the 3-instruction loop
        "        /*0060*/                   BRA 0x70 ;",                   # a forward branch
        "        /*0070*/                   EXIT ;",
    ])
    assert bench_module(monkeypatch, "sass_count").main_loop(sass) == ["HMMA.16816.F32.BF16", "LDS.128", "BRA"]


def test_block_scales_fold_into_one_ffma_per_accumulator_element(tmp_path):
    """DeepSeek-V3 FP8 block-128 at M=4096 on the H200 file's tiles (64 x 64 gated / 64 x 128, 4 warps, K 128, at most
    168 registers): each tile's weight rows lie in one 128-row scale block (GEMM2) or each half of them does (GEMM1),
    so each K step's promotion of the MMA's result is one FFMA per accumulator element (64 per thread), and the FMULs
    are the factors of a thread's 2 rows (x 2 halves in GEMM1). With a scale per column it was an FMUL and an FFMA per
    element, 257 and 254 instructions per K step, and GEMM1 spilled 24 bytes (189 and 182 now; bench/results/s40)."""
    done = _run(tmp_path, "--models", "deepseek-v3", "--schemes", "fp8_block", "--ms", "4096")
    assert done.returncode == 0, done.stderr
    for row in json.loads((tmp_path / "results.json").read_text()):
        assert (row["BLOCK_M"], row["stack_bytes"], row["mma"]) == (64, 0, ["QGMMA"]), row
        ops = row["loop_opcodes"]
        assert (ops["FFMA"], ops["FMUL"]) == (64, 4 if row["gemm"] == 1 else 2), ops
        assert row["loop_instructions"] <= 195, row["loop_instructions"]
