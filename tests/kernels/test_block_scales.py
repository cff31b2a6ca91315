"""Block-128 weight scales per tile (launch._weight_blocks, fused_moe W_BLOCKS): where a tile's weight rows lie in one
128-row scale block, or each of GEMM1's gate and up halves does, each K step loads one or two scales and folds them
into the row scales (one FFMA per accumulator element); elsewhere a scale per row. Either way the output is the
float64 reference's within the W8A8 bound."""

from __future__ import annotations

import pytest
from kernel_helpers import DEVICE, RecordingKernel, make_layer, random_inputs, reference64, rel_err

from moerules.activation import Activation
from moerules.kernels.triton import launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig
from moerules.kernels.triton.launch import fused_moe

BLOCK = "fp8_w8a8/block128/group128"
TOL = 1e-2  # test_fused_moe.py's W8A8 bound (triton_tol)


def _tile(block_n: int, swap: bool) -> GemmConfig:
    return GemmConfig(BLOCK_N=block_n, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2, SWAP_AB=swap)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("cell, activation, I, n1, n2, expected", [
    (BLOCK, Activation.silu, 256, 64, 64, (2, 1)),               # gate and up halves, each in one block
    (BLOCK, Activation.silu, 192, 64, 128, (2, 1)),              # up rows start at 192: 64-row halves stay inside
    (BLOCK, Activation.silu, 160, 64, 256, (0, 0)),              # 160 % 64: an up half spans two blocks; GEMM2 256 rows
    (BLOCK, Activation.swigluoai, 192, 64, 64, (1, 1)),          # interleaved pairs: 128 consecutive rows
    (BLOCK, Activation.swigluoai, 192, 128, 64, (0, 1)),         # 256 consecutive rows: two blocks
    (BLOCK, Activation.silu_no_mul, 192, 128, 32, (1, 1)),       # non-gated
    ("fp8_w8a8/tensor/tensor", Activation.silu, 256, 64, 64, (0, 0)),  # no block scales
])
def test_each_tile_reads_the_fewest_weight_scales_its_rows_allow(cell, activation, I, n1, n2, expected, swap,
                                                                 monkeypatch):
    g1, g2 = (RecordingKernel(launch.gemm1_gated_kernel), RecordingKernel(launch.gemm2_weighted_kernel))
    monkeypatch.setattr(launch, "gemm1_gated_kernel", g1)
    monkeypatch.setattr(launch, "gemm2_weighted_kernel", g2)
    layer = make_layer("triton.fused_moe", cell, activation=activation, E=4, H=256, I=I, device=DEVICE)
    x, ids, w = random_inputs(layer, 9, 2, device=DEVICE)
    pf = layer.prepare_finalize
    p = pf.prepare(x, topk_ids=ids, topk_weights=w, defer_input_quant=False, a13_scale=layer.weights.a13_scale)
    out = fused_moe(p.hidden_q, a_scale=p.a_scale, weights=layer.weights, topk_ids=ids, topk_weights=w,
                    activation=activation, quantize_intermediate=layer.experts.quantize_intermediate(layer.weights),
                    out_dtype=x.dtype, config=MoEConfig(BLOCK_M=16, gemm1=_tile(n1, swap), gemm2=_tile(n2, swap)),
                    swiglu=layer.experts.swiglu)
    assert (g1.launches[0]["W_BLOCKS"], g2.launches[0]["W_BLOCKS"]) == expected
    assert rel_err(pf.finalize(out, prepared=p, hidden_size=layer.hidden_size), reference64(layer, x, ids, w)) < TOL
