"""Block-128 weight scales per tile (launch._weight_blocks, fused_moe W_BLOCKS): where a tile's weight rows lie in one
128-row scale block, or each of GEMM1's gate and up halves does, each K step loads one or two scales and folds them
into the row scales (one FFMA per accumulator element); elsewhere a scale per row. Either way the output is the
float64 reference's within the W8A8 bound."""

from __future__ import annotations

import dataclasses
import os

import pytest
from kernel_helpers import DEVICE, RecordingKernel, make_layer, random_inputs, reference64, rel_err

from moerules.activation import Activation
from moerules.errors import KernelInputError
from moerules.kernels.triton import launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config
from moerules.kernels.triton.launch import fused_moe

BLOCK = "fp8_w8a8/block128/group128"
TOL = 1e-2  # test_fused_moe.py's W8A8 bound (triton_tol)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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


def _half_mma_run(monkeypatch, *, n1: int, n2: int, half: bool, swap: bool = False, tma: bool = False,
                  tail: int = 0, activation: Activation = Activation.silu, I: int = 256, M: int = 23):
    """The block-scaled layer's output with these tiles, one MMA per K step or two promoted halves (HALF_MMA), and
    the kernels' launch keywords."""
    g1, g2 = (RecordingKernel(launch.gemm1_gated_kernel), RecordingKernel(launch.gemm2_weighted_kernel))
    monkeypatch.setattr(launch, "gemm1_gated_kernel", g1)
    monkeypatch.setattr(launch, "gemm2_weighted_kernel", g2)
    layer = make_layer("triton.fused_moe", BLOCK, activation=activation, E=4, H=512, I=I, device=DEVICE)
    x, ids, w = random_inputs(layer, M, 2, device=DEVICE)

    def tile(block_n):
        return GemmConfig(BLOCK_N=block_n, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2, SWAP_AB=swap,
                          TMA=tma, HALF_MMA=half)
    cfg = MoEConfig(BLOCK_M=32, gemm1=tile(n1), gemm2=tile(n2), TAIL_M=tail)
    monkeypatch.setattr(launch, "get_config", lambda **kwargs: cfg)
    return layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w), g1.launches[0], g2.launches[0]


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("n1, n2, tail", [(64, 128, 0), (128, 256, 0), (32, 64, 0), (64, 128, 16)])
def test_half_mma_gives_the_one_mma_layer(n1, n2, tail, swap, tma, monkeypatch):
    """HALF_MMA: the gate and up halves of GEMM1's tiles, and the two column halves of GEMM2's, each promoted into
    their own accumulator, give the float64 reference's layer within the W8A8 bound, and in the interpreter, whose
    sums run in one order, the single-MMA tiles' layer within fp32 rounding (GEMM2 at 256 columns takes a scale per
    row there); with 16-row tail tiles too (swapped, in the same launches). On the GPU narrower MMAs may sum K in another order (a 32-row half of a swapped tile is no wgmma), and
    GEMM2's FP8 input then rounds a few values one step apart (H100: 5e-3 between the two layers at 32-row halves)."""
    out, ref, l1, l2 = _half_mma_run(monkeypatch, n1=n1, n2=n2, half=True, swap=swap, tma=tma, tail=tail)
    one, _, o1, o2 = _half_mma_run(monkeypatch, n1=n1, n2=n2, half=False, swap=swap, tma=tma, tail=tail)
    assert (l1["HALF_MMA"], l2["HALF_MMA"], o1["HALF_MMA"], o2["HALF_MMA"]) == (True, True, False, False)
    assert (l1["W_BLOCKS"], o2["W_BLOCKS"], l1["TAIL_M"], l2["TAIL_M"]) == (2, 1 if n2 <= 128 else 0, tail, tail)
    assert rel_err(out, ref) < TOL
    if INTERPRETED:
        assert rel_err(out, one) < 1e-5


def test_half_mma_needs_each_gemm1_half_in_one_block(monkeypatch):
    """I = 160 is no multiple of BLOCK_N 64, so an up half straddles two scale blocks: refused by the launch."""
    with pytest.raises(KernelInputError, match=r"^gemm1: HALF_MMA needs the gate and up rows of each tile in one "
                                               r"block of 128 rows each \(gated weights as halves, BLOCK_N=64 at most "
                                               r"128 and dividing I=160\); remove HALF_MMA from gemm1 or change "
                                               r"BLOCK_N$"):
        _half_mma_run(monkeypatch, n1=64, n2=128, half=True, I=160)


@pytest.mark.parametrize("cell, gemm2_n, block_m, message", [
    ("fp8_w8a8/tensor/tensor", 128, 32, r"^gemm1: HALF_MMA promotes block-scaled products, and fp8_w8a8/tensor/tensor "
                                        r"has no 128x128 weight blocks; remove HALF_MMA from this config$"),
    (BLOCK, 512, 32, r"^gemm2: HALF_MMA takes MMA tiles \(BLOCK_M >= 16, not chained\) whose halves hold 16 to 128 "
                     r"weight rows \(here 256: BLOCK_N=512\); remove HALF_MMA or change BLOCK_N$"),
    (BLOCK, 128, 1, r"^gemm1: HALF_MMA takes MMA tiles \(BLOCK_M >= 16, not chained\) whose halves hold 16 to 128 "
                    r"weight rows \(here 64: BLOCK_N=64\); remove HALF_MMA or change BLOCK_N$"),
])
def test_half_mma_configs_the_kernels_cannot_run_are_refused(cell, gemm2_n, block_m, message):
    scheme = make_layer("triton.fused_moe", cell, device=DEVICE).weights.scheme
    tile = GemmConfig(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2, HALF_MMA=True)
    cfg = MoEConfig(BLOCK_M=block_m, gemm1=tile, gemm2=dataclasses.replace(tile, BLOCK_N=gemm2_n))
    with pytest.raises(ValueError, match=message):
        check_config(cfg, scheme)


def test_half_mma_is_written_only_where_set():
    tile = GemmConfig(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=3)
    d = MoEConfig(BLOCK_M=128, gemm1=dataclasses.replace(tile, HALF_MMA=True), gemm2=tile).to_dict()
    assert d["gemm1"]["HALF_MMA"] is True and "HALF_MMA" not in d["gemm2"]
    assert MoEConfig.from_dict(d).gemm1.HALF_MMA
