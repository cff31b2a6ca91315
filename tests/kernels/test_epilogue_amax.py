"""GEMM1's epilogue amax (launch.gemm1, AMAX): GEMM2's dynamic per-tensor scale without an amax pass over the
intermediate. The partial amaxes must give exactly the scale that pass gives, non-finite values left out."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, make_layer, random_inputs, reference64, rel_err

from moerules.kernels.qrange import scale_from_amax
from moerules.kernels.quantize import finite_amax
from moerules.kernels.triton.config import GemmConfig, MoEConfig
from moerules.kernels.triton.launch import fused_moe
from moerules.kernels.triton.quant import needs_amax_pass, scale_of_partials

FP8 = torch.float8_e4m3fn
TOL = 1e-2  # test_fused_moe.py's W8A8 bound (triton_tol)


def _forward(layer, M: int, k: int, *, poison_row: bool = False, config: MoEConfig | None = None):
    """fused_moe on the layer's weights (with `config`, else the tuned one), recording what quantize_intermediate
    received."""
    x, ids, w = random_inputs(layer, M, k, device=DEVICE)
    if poison_row:
        x[3] = float("inf")
    seen = {}
    quantize = layer.experts.quantize_intermediate(layer.weights)

    def recording(inter, amaxes):
        seen.update(inter=inter.clone(), amaxes=amaxes)
        return quantize(inter, amaxes)
    pf = layer.prepare_finalize
    p = pf.prepare(x, topk_ids=ids, topk_weights=w, defer_input_quant=False, a13_scale=layer.weights.a13_scale)
    out = fused_moe(p.hidden_q, a_scale=p.a_scale, weights=layer.weights, topk_ids=ids, topk_weights=w,
                    activation=layer.experts.activation, quantize_intermediate=recording,
                    out_dtype=x.dtype, config=config)
    return out, seen, (x, ids, w)


def _tile(swap: bool) -> MoEConfig:
    gemm = GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2, SWAP_AB=swap)
    return MoEConfig(BLOCK_M=16, gemm1=gemm, gemm2=gemm)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("poison_row", [False, True])
def test_gemm1_amaxes_give_exactly_the_scale_of_an_amax_pass(poison_row, swap, poison_empty):
    """70 tokens x top-2 x I=128 = 17,920 intermediate elements, past one quantiser program: GEMM1 writes one
    finite amax per program (the early-returning ones 0, in NaN-poisoned memory), and their scale is the one
    quantize_activation's amax pass computes, bit for bit; with a token of Inf (its rows NaN/Inf) too. Both ways
    GEMM1 takes its amax: from the registers, and read back from memory (swapped tiles, fused_moe._stored_amax)."""
    layer = make_layer("triton.fused_moe", "fp8_w8a8/tensor/tensor", E=4, H=160, I=128, device=DEVICE)
    out, seen, (x, ids, w) = _forward(layer, 70, 2, poison_row=poison_row, config=_tile(swap))
    inter, amaxes = seen["inter"], seen["amaxes"]
    assert needs_amax_pass(inter.numel()) and amaxes is not None
    assert torch.isfinite(amaxes).all() and (amaxes >= 0).all()
    assert amaxes.max() == finite_amax(inter.float())
    assert torch.equal(scale_of_partials(amaxes, FP8), scale_from_amax(finite_amax(inter.float()), FP8).reshape(1))
    if not poison_row:
        assert rel_err(out, reference64(layer, x, ids, w)) < TOL


@pytest.mark.parametrize("cell, M", [
    ("fp8_w8a8/tensor/tensor", 11),          # 2,112 elements: the quantiser's single program reads them once
    ("fp8_w8a8/tensor/tensor-static", 70),   # a static scale: no amax at all
    ("fp8_w8a8/channel/token", 70),          # per-token scales
    ("unquantized", 70),                     # no quantisation
])
def test_no_amaxes_where_no_amax_pass_would_run(cell, M, poison_empty):
    layer = make_layer("triton.fused_moe", cell, E=4, H=160, I=128, device=DEVICE)
    _, seen, _ = _forward(layer, M, 2)
    assert seen["amaxes"] is None
