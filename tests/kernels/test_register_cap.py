"""GemmConfig.MAXNREG: a data file's cap on registers per thread reaches ptxas, is validated, and is written back only
where it is set. Under the interpreter the cap does nothing, so the layer must compute as without it; on a GPU the
same test runs the capped compile. What the cap does to a compile: tests/kernels/test_sass_count.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from triton.runtime.errors import PTXASError
from kernel_helpers import DEVICE, TRITON_DTYPE, make_layer, random_inputs, reference64, rel_err
from test_fused_moe import triton_tol

from moerules.activation import Activation
from moerules.errors import KernelInputError
from moerules.kernels.scheme import Scheme
from moerules.kernels.triton import launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config
from moerules.quant import QuantConfig

_TILE = GemmConfig(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2)
BF16 = Scheme.from_quant(QuantConfig())


@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a8/tensor/tensor"])
def test_a_capped_config_computes_the_layer(cell, poison_empty, monkeypatch):
    capped = replace(_TILE, MAXNREG=96)
    cfg = MoEConfig(BLOCK_M=16, gemm1=capped, gemm2=capped)
    monkeypatch.setattr(launch, "get_config", lambda **kwargs: cfg)
    layer = make_layer("triton.fused_moe", cell, activation=Activation.silu, dtype=TRITON_DTYPE, device=DEVICE)
    x, ids, w = random_inputs(layer, 13, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < triton_tol(cell)


def test_the_cap_is_a_launch_option_only_where_set():
    assert launch._launch_kwargs(replace(_TILE, MAXNREG=128))["maxnreg"] == 128
    assert "maxnreg" not in launch._launch_kwargs(_TILE)


@pytest.mark.parametrize("value", [8, 23, 256])
def test_a_cap_ptxas_cannot_honour_is_refused(value):
    cfg = MoEConfig(BLOCK_M=16, gemm1=_TILE, gemm2=replace(_TILE, MAXNREG=value))
    with pytest.raises(ValueError, match=rf"^gemm2: MAXNREG={value} must be a register count from 24 to 255 "
                                         r"\(ptxas's per-thread cap\), or absent$"):
        check_config(cfg, BF16)


def test_files_hold_the_cap_only_where_it_is_set():
    cfg = MoEConfig(BLOCK_M=128, gemm1=replace(_TILE, MAXNREG=128), gemm2=_TILE)
    d = cfg.to_dict()
    assert d["gemm1"]["MAXNREG"] == 128 and "MAXNREG" not in d["gemm2"]
    assert MoEConfig.from_dict(json.loads(json.dumps(d))) == cfg


class _FailingCompile:
    """Stands for a GEMM kernel whose compile ptxas stops, with the message ptxas gives for too low a cap."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise PTXASError("ptxas fatal   : (C7602) Insufficient registers (128) to compile instruction at line 932 "
                             "in function gemm1_gated_kernel. Try to compile with register target of 154 or higher.")
        return launch


@pytest.mark.parametrize("gemm, kernel", [(1, "gemm1_gated_kernel"), (2, "gemm2_weighted_kernel")])
def test_a_cap_too_low_for_the_tile_is_a_typed_error(gemm, kernel, monkeypatch):
    """ptxas refuses a cap below what the tile needs (seen on the H200 for MAXNREG 128 on Mixtral FP8's 8-warp
    128x128x128 GEMM1): the layer raises KernelInputError with ptxas's figure, not Triton's compile error."""
    capped = MoEConfig(BLOCK_M=16, gemm1=replace(_TILE, MAXNREG=128 if gemm == 1 else None),
                       gemm2=replace(_TILE, MAXNREG=128 if gemm == 2 else None))
    monkeypatch.setattr(launch, "get_config", lambda **kwargs: capped)
    monkeypatch.setattr(launch, kernel, _FailingCompile())
    layer = make_layer("triton.fused_moe", "unquantized", activation=Activation.silu, dtype=TRITON_DTYPE, device=DEVICE)
    x, ids, w = random_inputs(layer, 13, 2, device=DEVICE)
    with pytest.raises(KernelInputError, match=rf"^gemm{gemm}: MAXNREG=128 is too few registers for this tile \(ptxas "
                                               r"needs at least 154\); raise the cap or remove it from the tuned "
                                               r"config$"):
        layer(x, topk_ids=ids, topk_weights=w)


def test_a_compile_error_without_a_cap_is_not_blamed_on_one(monkeypatch):
    cfg = MoEConfig(BLOCK_M=16, gemm1=_TILE, gemm2=_TILE)
    monkeypatch.setattr(launch, "get_config", lambda **kwargs: cfg)
    monkeypatch.setattr(launch, "gemm1_gated_kernel", _FailingCompile())
    layer = make_layer("triton.fused_moe", "unquantized", activation=Activation.silu, dtype=TRITON_DTYPE, device=DEVICE)
    x, ids, w = random_inputs(layer, 13, 2, device=DEVICE)
    with pytest.raises(PTXASError):
        layer(x, topk_ids=ids, topk_weights=w)
