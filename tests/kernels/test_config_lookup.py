"""Which tuned entry a batch runs (`triton.config.get_config`): the nearest M, but no GEMV rows past one row per
expert (1/8 for the MX formats)."""

from __future__ import annotations

import pytest

from moerules.kernels.scheme import Scheme, quant_for_cell
from moerules.kernels.triton import config
from moerules.kernels.triton.config import GemmConfig, MoEConfig, default_config
from moerules.quant import QuantConfig, QuantFamily

BF16 = Scheme.from_quant(QuantConfig())
MXFP4 = Scheme.from_quant(QuantConfig(family=QuantFamily.mxfp4_w4a16))
MXFP8 = Scheme.from_quant(QuantConfig(family=QuantFamily.mxfp8))
GEMV = MoEConfig(BLOCK_M=1, gemm1=GemmConfig(16, 256, 1, 4, 4), gemm2=GemmConfig(16, 512, 1, 8, 4))
MMA16 = MoEConfig(BLOCK_M=16, gemm1=GemmConfig(32, 256, 16, 4, 5), gemm2=GemmConfig(64, 128, 1, 4, 4))
MMA128 = MoEConfig(BLOCK_M=128, gemm1=GemmConfig(128, 64, 16, 8, 4), gemm2=GemmConfig(256, 64, 16, 8, 4))


def lookup(monkeypatch, table, *, num_tokens, num_experts, top_k, scheme=BF16):
    monkeypatch.setattr(config, "_load_file", lambda name: table)
    return config.get_config(num_tokens=num_tokens, num_experts=num_experts, intermediate=14336, top_k=top_k,
                             scheme=scheme, in_dtype_name="bf16", device_name="NVIDIA H200")


@pytest.mark.parametrize("num_tokens, num_experts, top_k, expected", [
    (1, 8, 2, GEMV),         # 0.25 rows per expert: the nearest entry, GEMV rows
    (4, 8, 2, GEMV),         # one row per expert: still GEMV
    (5, 8, 2, MMA16),        # 1.25 rows: the nearest entry with MMA tiles (M=64), not M=1's GEMV rows
    (16, 8, 2, MMA16),       # Mixtral-8x7B at M=16 on the H200's file before its M=16 entry (bench/results/s27)
    (16, 128, 4, GEMV),      # 0.5 rows per expert (gpt-oss-120b)
    (600, 8, 2, MMA128),     # nearest M, as before
])
def test_gemv_rows_serve_at_most_one_row_per_expert(monkeypatch, num_tokens, num_experts, top_k, expected):
    table = {1: GEMV, 64: MMA16, 1024: MMA128}
    assert lookup(monkeypatch, table, num_tokens=num_tokens, num_experts=num_experts, top_k=top_k) == expected


def test_a_file_of_gemv_rows_alone_leaves_larger_batches_to_the_heuristic(monkeypatch):
    got = lookup(monkeypatch, {1: GEMV}, num_tokens=64, num_experts=8, top_k=2)
    assert got == default_config(num_tokens=64, num_experts=8, top_k=2, scheme=BF16)
    assert got.BLOCK_M > 1


@pytest.mark.parametrize("scheme", [MXFP4, MXFP8], ids=["mxfp4", "mxfp8"])
@pytest.mark.parametrize("num_tokens, expected", [(4, GEMV), (8, MMA16)])
def test_mx_gemv_rows_serve_at_most_an_eighth_of_a_row_per_expert(monkeypatch, num_tokens, expected, scheme):
    """gpt-oss-120b (E=128, top-4) on a file with M=1 GEMV rows and an M=16 MMA entry: M=4 (1/8 row per expert) is
    GEMV rows' still, M=8 (1/4) is nearer M=1 but runs the MMA tiles (at 1/2 row GEMV rows ran 1.67x slower in MXFP4,
    1.14x in MXFP8)."""
    table = {1: GEMV, 16: MMA16}
    assert lookup(monkeypatch, table, num_tokens=num_tokens, num_experts=128, top_k=4, scheme=scheme) == expected


FILE_SCHEMES = {"bf16": "unquantized", "fp8_w8a8": "fp8_w8a8/tensor/tensor",
                "fp8_w8a8_block128": "fp8_w8a8/block128/group128", "mxfp4_w4a16": "mxfp4_w4a16/group32",
                "mxfp8": "mxfp8/group32/group32"}


@pytest.mark.parametrize("path", sorted(config.CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_committed_data_file_passes_check_config(path):
    """A tuned file the kernels cannot run must fail here, not at a user's first forward."""
    scheme = Scheme.from_quant(quant_for_cell(FILE_SCHEMES[path.stem.rsplit("dtype=", 1)[1]]))
    table = config._load_file(path.name)
    assert table
    for cfg in table.values():
        config.check_config(cfg, scheme)
