"""MXFP4 weights in MMA fragment order (kernels/fp4_fragments.py): the layout, the build's rewrite, and the Triton
GEMMs reading it at every tile kind (fp16 under the interpreter; bf16 and the PTX decode on the GPU, test_mx.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, make_layer, random_inputs, reference64, rel_err, run_with_config

from moerules.activation import Activation, Dtype
from moerules.errors import KernelInputError
from moerules.kernels import fp4_fragments, make_random_weights
from moerules.kernels.ep.placement import Placement, PlacementError
from moerules.kernels.ep.sharding import shard_weights
from moerules.kernels.scheme import quant_for_cell
from moerules.kernels.triton.config import GemmConfig, MoEConfig
from moerules.kernels.triton.launch import fused_moe

MXFP4 = "mxfp4_w4a16/group32"
TOL = 2e-3  # test_mx.py's MXFP4 bound (fp16 out against the float64 reference)


def _nibble(packed: torch.Tensor, n: int, k: int) -> int:
    byte = int(packed[n, k // 2])
    return byte >> 4 if k % 2 else byte & 0xF


@pytest.mark.parametrize("pairs", [False, True])
def test_every_value_sits_where_the_layout_doc_says(pairs):
    """Each (row, k) of a [64, 96] tensor, looked up by the formulas of fp4_fragments' doc, and the round trip."""
    packed = torch.randint(0, 256, (64, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    frag = fp4_fragments.to_fragment_order(packed, pairs=pairs)
    assert frag.shape == packed.shape
    assert torch.equal(fp4_fragments.to_checkpoint_order(frag, pairs=pairs), packed)
    for n in range(64):
        for k in range(96):
            b, j, q, c, p = k // 32, k % 32 // 16, k % 16 // 8, k % 8 // 2, k % 2
            if pairs:
                s, col, u = n // 32, n % 32 // 2, n % 2
                h, g = col // 8, col % 8
                byte, run = 512 * b + 16 * (4 * g + c) + 4 * (2 * u + j) + 2 * h + p, frag[32 * s:32 * s + 32]
            else:
                s, h, g = n // 16, n % 16 // 8, n % 8
                byte, run = 256 * b + 8 * (4 * g + c) + 4 * j + 2 * h + p, frag[16 * s:16 * s + 16]
            stored = int(run.reshape(-1)[byte])
            assert (stored >> 4 if q else stored & 0xF) == _nibble(packed, n, k), (n, k)


@pytest.mark.parametrize("pairs", [False, True])
def test_scales_are_group_major_within_each_slab(pairs):
    scales = torch.randint(0, 256, (2, 64, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    frag = fp4_fragments.scales_to_fragment_order(scales, pairs=pairs)
    assert torch.equal(fp4_fragments.scales_to_checkpoint_order(frag, pairs=pairs), scales)
    r = 32 if pairs else 16
    for n in range(64):
        for group in range(5):
            s, row = divmod(n, r)
            assert frag[1, s * r:(s + 1) * r].reshape(-1)[group * r + row] == scales[1, n, group], (n, group)


@pytest.mark.parametrize("rows,k,pairs,message", [
    (24, 64, False, "fragment order needs whole 16-row slabs and K % 32 == 0, got [24, 64]"),
    (48, 64, True, "fragment order (paired) needs whole 32-row slabs and K % 32 == 0, got [48, 64]"),
])
def test_shapes_without_whole_slabs_are_refused(rows, k, pairs, message):
    assert not fp4_fragments.fits(rows, k, pairs=pairs)
    with pytest.raises(ValueError) as err:
        fp4_fragments.to_fragment_order(torch.zeros(rows, k // 2, dtype=torch.uint8), pairs=pairs)
    assert str(err.value) == message


@pytest.mark.parametrize("activation,order", [
    (Activation.swigluoai, fp4_fragments.PAIRS),   # gpt-oss: interleaved gate/up rows, 32-row slabs
    (Activation.silu, fp4_fragments.ROWS),         # gate then up halves, each whole 16-row slabs
])
def test_the_triton_build_rewrites_and_reads_back_the_checkpoint(activation, order, poison_empty):
    """The build pads MX sizes to whole groups of 32, so every Triton MXFP4 layer's weights fit the layout."""
    I = 96
    layer = make_layer("triton.fused_moe", MXFP4, activation=activation, dtype=Dtype.fp16, E=4, H=128, I=I,
                       device=DEVICE, bias=True)
    w = layer.weights
    assert w.fp4_fragment_order == order
    reference = make_layer("torch.reference", MXFP4, activation=activation, dtype=Dtype.fp16, E=4, H=128, I=I,
                           device=DEVICE, bias=True).weights
    assert reference.fp4_fragment_order is None
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        assert torch.equal(w.in_checkpoint_order(name), getattr(reference, name)), name
    assert not torch.equal(w.w13, reference.w13) and not torch.equal(w.w2, reference.w2)
    x, ids, topw = random_inputs(layer, 37, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=topw), reference64(layer, x, ids, topw)) < TOL


def test_sharding_refuses_weights_a_build_rewrote(poison_empty):
    """Slicing w2's K columns of fragment-order bytes would mix groups: shards are cut from checkpoint order."""
    layer = make_layer("triton.fused_moe", MXFP4, activation=Activation.swigluoai, dtype=Dtype.fp16, E=4, H=64,
                       I=64, device=DEVICE)
    with pytest.raises(PlacementError, match=r"rewritten in fragment order\) by a layer build"):
        shard_weights(layer.weights, Placement.tensor(num_experts=4, num_ranks=2), 0, activation=Activation.swigluoai)


def test_the_gemms_refuse_checkpoint_order_and_halves_that_split_a_slab(poison_empty):
    def weights(I):
        return make_random_weights(num_experts=2, hidden=64, intermediate=I, quant=quant_for_cell(MXFP4),
                                   in_dtype=Dtype.fp16, has_bias=False, seed=0, device=DEVICE)
    w = weights(64)
    x = torch.zeros(3, 64, dtype=torch.float16, device=DEVICE)
    ids = torch.zeros(3, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelInputError) as err:
        fused_moe(x, a_scale=None, weights=w, topk_ids=ids, topk_weights=torch.ones(3, 1, device=DEVICE),
                  activation=Activation.silu, quantize_intermediate=lambda t, _: (t, None), out_dtype=torch.float16)
    assert str(err.value) == ("the Triton GEMMs read MXFP4 weights in fp4_fragments' order and these are in the "
                              "checkpoint's: call weights.use_fragment_order(interleaved=...) once first (the "
                              "build of a triton.fused_moe layer does)")
    with pytest.raises(KernelInputError) as err:
        weights(40).use_fragment_order(interleaved=False)
    assert str(err.value) == ("MXFP4 fragment order: gate and up halves of I=40 rows are not whole 16-row slabs; "
                              "pad I to a multiple of 32 (MX groups)")


TILES = [  # (BLOCK_M, BLOCK_N gemm1, BLOCK_N gemm2, BLOCK_K, SWAP_AB): GEMV rows, mma.sync, wgmma-shaped, masked K
    (1, 8, 16, 64, False), (1, 16, 32, 128, True), (16, 16, 32, 32, False), (16, 32, 64, 64, True),
    (64, 32, 64, 128, False), (16, 16, 16, 256, True),
]


@pytest.mark.parametrize("activation", [Activation.swigluoai, Activation.silu])
@pytest.mark.parametrize("block_m,bn1,bn2,block_k,swap", TILES)
def test_fragment_order_at_every_tile_kind(activation, block_m, bn1, bn2, block_k, swap, poison_empty, monkeypatch):
    """H=160 and I=96: K is five and three MX groups (partial last K steps at BLOCK_K 64-256), columns past N in the
    last tiles. As `launch.fragment_tiles` runs them: swapped, GEMM1's BLOCK_N 8 widened to a whole slab, GEMV
    rows on 4 warps and K steps >= 128."""
    def tile(n):
        return GemmConfig(BLOCK_N=n, BLOCK_K=block_k, GROUP_M=1, num_warps=4, num_stages=2, SWAP_AB=swap)
    run_with_config(monkeypatch, lambda cfg: MoEConfig(BLOCK_M=block_m, gemm1=tile(bn1), gemm2=tile(bn2)))
    layer = make_layer("triton.fused_moe", MXFP4, activation=activation, dtype=Dtype.fp16, E=4, H=160, I=96,
                       device=DEVICE, bias=True)
    assert layer.weights.fp4_fragment_order is not None
    x, ids, w = random_inputs(layer, 11, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the wrong GEMV tiles were wrong on the H200 only")
@pytest.mark.parametrize("dtype", [Dtype.fp16, Dtype.bf16])
def test_every_gemv_tile_runs_as_a_right_one(dtype, poison_empty, monkeypatch):
    """bench/fp4_gemv_probe.py's grid (BLOCK_K x GEMM1 BLOCK_N x warps x SWAP_AB): without `fragment_tiles`' GEMV
    floor, 4 warps at BLOCK_K 32/64 with BLOCK_N 16 (both dtypes) and bf16 on 1 warp at 128 were wrong on the H200
    (rel. err 1.1-12.6); through it, every one is right."""
    forced = {}
    run_with_config(monkeypatch, lambda cfg: forced["config"])
    layer = make_layer("triton.fused_moe", MXFP4, activation=Activation.swigluoai, dtype=dtype, E=4, H=160, I=96,
                       device=DEVICE, bias=True)
    x, ids, w = random_inputs(layer, 11, 2, device=DEVICE)
    reference = reference64(layer, x, ids, w)
    for block_k in (32, 64, 128, 256):
        for bn1, warps, swap in ((16, 1, False), (16, 4, False), (32, 1, True), (16, 4, True)):
            def tile(n):
                return GemmConfig(BLOCK_N=n, BLOCK_K=block_k, GROUP_M=1, num_warps=warps, num_stages=2,
                                  SWAP_AB=swap)
            forced["config"] = MoEConfig(BLOCK_M=1, gemm1=tile(bn1), gemm2=tile(16))
            err = rel_err(layer(x, topk_ids=ids, topk_weights=w), reference)
            assert err < (TOL if dtype == Dtype.fp16 else 8e-3), (block_k, bn1, warps, swap, err)
