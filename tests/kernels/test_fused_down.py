"""MoEConfig.FUSED_DOWN: GEMM2 and the top-k sum inside GEMM1's launch (fused_moe._down_partials, _arrive).

The intermediate is never re-quantised there, so the reference is moe_reference with quantized_intermediate=False;
the tolerances are test_fused_moe's for unquantised GEMM2 inputs (fp16 out 2e-3, bf16 out 8e-3)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_helpers import (DEVICE, TRITON_DTYPE, make_layer, random_inputs, reference64, rel_err,
                            run_with_config)

from moerules.activation import Activation, Dtype
from moerules.errors import KernelInputError
from moerules.kernels.scheme import Scheme, quant_for_cell
from moerules.kernels.triton import launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config

FUSED_CELLS = ["unquantized", "fp8_w8a8/tensor/tensor", "fp8_w8a8/channel/token", "fp8_w8a8/tensor/tensor-static",
               "int8_w8a8/channel/token", "fp8_w8a16/tensor", "int8_w8a16/channel"]
TOL = 2e-3 if TRITON_DTYPE == Dtype.fp16 else 8e-3


def fused(cfg: MoEConfig, **fields) -> MoEConfig:
    return dataclasses.replace(cfg, FUSED_DOWN=True, **fields)


@pytest.mark.parametrize("cell", FUSED_CELLS)
@pytest.mark.parametrize("M,top_k,E,block_m", [
    (1, 2, 64, None),    # the naive assignment: one slot per block (decode)
    (13, 2, 8, None),    # sorted blocks, several per expert, padding rows and past-end blocks that still arrive
    (3, 4, 64, 1),       # GEMV rows: the partial products on CUDA cores
])
def test_fused_down_computes_the_layer(cell, M, top_k, E, block_m, poison_empty, monkeypatch):
    run_with_config(monkeypatch, lambda cfg: fused(cfg, BLOCK_M=block_m or cfg.BLOCK_M))
    layer = make_layer("triton.fused_moe", cell, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True,
                       E=E, device=DEVICE)
    x, ids, w = random_inputs(layer, M, top_k, device=DEVICE)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert out.shape == (M, layer.hidden_size) and out.dtype == x.dtype
    assert rel_err(out, reference64(layer, x, ids, w, quantized_intermediate=False)) < TOL


def test_fused_down_with_8_bit_activations_skips_the_intermediates_quantisation(poison_empty, monkeypatch):
    """W8A8: the fused output is the unquantised-intermediate reference's, measurably not the re-quantised one's."""
    run_with_config(monkeypatch, fused)
    layer = make_layer("triton.fused_moe", "fp8_w8a8/tensor/tensor", dtype=TRITON_DTYPE, E=64, device=DEVICE)
    x, ids, w = random_inputs(layer, 1, 2, device=DEVICE)
    out = layer(x, topk_ids=ids, topk_weights=w)
    exact = rel_err(out, reference64(layer, x, ids, w, quantized_intermediate=False))
    assert exact < TOL < rel_err(out, reference64(layer, x, ids, w))


def test_fused_down_equals_the_two_launches_on_unquantised_weights(poison_empty, monkeypatch):
    """The same products as GEMM1, GEMM2 and the top-k sum launched apart: only the summation order differs."""
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, E=64, device=DEVICE, bias=True)
    x, ids, w = random_inputs(layer, 2, 4, device=DEVICE)
    apart = layer(x, topk_ids=ids, topk_weights=w).double()
    run_with_config(monkeypatch, fused)
    together = layer(x, topk_ids=ids, topk_weights=w).double()
    assert ((together - apart).norm() / apart.norm()).item() < TOL  # the apart path rounds each slot's row too


def test_the_last_program_writes_every_row_once_per_call(poison_empty, monkeypatch):
    """Each call starts from zeroed sums: a second call gives the first call's output, not twice it."""
    run_with_config(monkeypatch, fused)
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, E=8, device=DEVICE)
    x, ids, w = random_inputs(layer, 5, 2, device=DEVICE)
    first = layer(x, topk_ids=ids, topk_weights=w)
    torch.testing.assert_close(layer(x, topk_ids=ids, topk_weights=w), first, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("cell", ["fp8_w8a8/block128/group128", "fp8_w8a16/block128", "mxfp4_w4a16/group32"])
def test_fused_down_refuses_block_and_mx_scales(cell):
    g = GemmConfig(BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    with pytest.raises(ValueError, match=r"^FUSED_DOWN: GEMM2 inside GEMM1 reads w2 with per-tensor or per-channel "
                                         rf"scales only, not {cell}'s; remove FUSED_DOWN from this config$"):
        check_config(MoEConfig(BLOCK_M=16, gemm1=g, gemm2=g, FUSED_DOWN=True), Scheme.from_quant(quant_for_cell(cell)))


def test_fused_down_refuses_lora(monkeypatch):
    run_with_config(monkeypatch, fused)
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, device=DEVICE, lora_rank=4)
    x, ids, w = random_inputs(layer, 3, 2, device=DEVICE)
    with pytest.raises(KernelInputError, match="FUSED_DOWN runs GEMM2 inside GEMM1, which has no place for LoRA's "
                                               "GEMM2 shrink"):
        layer(x, topk_ids=ids, topk_weights=w)


def test_fused_down_round_trips_through_a_data_file_entry():
    g = GemmConfig(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=5)
    cfg = MoEConfig(BLOCK_M=16, gemm1=g, gemm2=g, FUSED_DOWN=True)
    assert cfg.to_dict()["FUSED_DOWN"] is True
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    plain = dataclasses.replace(cfg, FUSED_DOWN=False)
    assert "FUSED_DOWN" not in plain.to_dict() and MoEConfig.from_dict(plain.to_dict()) == plain


def test_fused_down_is_one_launch(monkeypatch):
    """No GEMM2 kernel and no top-k sum run: the forward's Triton launches are GEMM1's alone (bf16, naive)."""
    run_with_config(monkeypatch, fused)
    launched = []
    for name in ("gemm2_weighted_kernel",):
        monkeypatch.setattr(launch, name, None)
    monkeypatch.setattr(launch, "topk_sum", lambda *a, **k: launched.append("topk_sum"))
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, E=64, device=DEVICE)
    x, ids, w = random_inputs(layer, 1, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < TOL
    assert launched == []
