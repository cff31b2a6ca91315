"""MX formats (MXFP4 W4A16, MXFP8): utilities, the reference, the Triton kernels, padding and build checks.

Tolerances (relative Frobenius error against the float64 reference on the same quantised data, so
they bound the kernels' arithmetic, not the quantisation noise):
  MXFP4 W4A16, fp16 out (interpreter):  2e-3  (fp16 rounding ~3e-4; dequantised weights are exact in fp16)
  MXFP8, fp16 out:                      1e-2  (a 1-ulp difference in the fp16 intermediate can flip one
                                               fp8 rounding of the GEMM2 input, as for W8A8)
  bf16 out (GPU only):                  8e-3 / 2e-2 for the same two cases (bf16 rounding is ~8x coarser)
  padded vs unpadded reference, fp32:   1e-6  (padding adds exact zeros only)
CPU runs of Triton go through the interpreter, whose tl.dot is wrong for bf16: they use fp16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from decision_helpers import config, cuda
from kernel_helpers import (DEVICE, TRITON_DTYPE, make_layer, quant_of, random_inputs, reference64, rel_err,
                            run_with_config)

from moerules import build, decide
from moerules.activation import Activation, Dtype
from moerules.errors import KernelUnavailableError
from moerules.kernels import KernelBuildError, build_layer, make_random_weights
from moerules.kernels.mx import (E2M1_VALUES, E4M3_EMAX, E2M1_EMAX, E8M0_FOLD_MAX, dequantize_mx, e2m1_decode,
                                 e2m1_encode, e8m0_decode, e8m0_encode, pack_fp4, quantize_mx, unpack_fp4)
from moerules.kernels.quantize import dequantize_activation, quantize_activation
from moerules.kernels.scheme import Scheme
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config, default_config
from moerules.kernels.triton.quant import dequantize_mx as dequantize_mx_triton
from moerules.quant import Granularity as G

MXFP4 = "mxfp4_w4a16/group32"
MXFP8 = "mxfp8/group32/group32"
MX_CELLS = [MXFP4, MXFP8]


def tol(cell: str) -> float:
    if TRITON_DTYPE == Dtype.fp16:
        return 2e-3 if cell == MXFP4 else 1e-2
    return 8e-3 if cell == MXFP4 else 2e-2


# ---- formats ------------------------------------------------------------------------------------

def test_every_e2m1_value_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values[:8].tolist() == list(E2M1_VALUES) and values[8:].tolist() == [-v for v in E2M1_VALUES]
    back = e2m1_encode(values)
    assert torch.equal(e2m1_decode(back), values)
    assert torch.equal(back, torch.where(codes == 8, 0, codes).to(torch.uint8))  # -0 is stored as +0


def test_e2m1_rounds_to_nearest_even_and_saturates():
    y = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 1e9, -0.3, -2.9, 0.1, -0.2])
    expected = [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.5, -3.0, 0.0, 0.0]
    assert e2m1_decode(e2m1_encode(y)).tolist() == expected
    # Against brute force: nearest grid value; on a tie the code with mantissa 0 (an even code).
    r = torch.linspace(-7.5, 7.5, 6001, dtype=torch.float32)
    grid = torch.tensor(E2M1_VALUES)
    dist = (r.abs()[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tie_break = torch.arange(8) % 2 * 1e-3      # prefer even codes among the equally near ones
    code = torch.where(dist == best, tie_break, 1.0).argmin(dim=1)
    expect = torch.where(r < 0, -grid[code], grid[code])
    assert torch.equal(e2m1_decode(e2m1_encode(r)), expect + 0.0)


def test_fp4_packing_is_lossless_low_nibble_even_k():
    assert pack_fp4(torch.tensor([1, 2, 15, 8], dtype=torch.uint8)).tolist() == [0x21, 0x8F]
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and torch.equal(unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="even K"):
        pack_fp4(codes[..., :63])


@pytest.mark.parametrize("emax", [E2M1_EMAX, E4M3_EMAX])
def test_e8m0_is_a_power_of_two_bounding_the_amax(emax):
    amax = torch.cat([torch.logspace(-30, 30, 997, base=2.0), torch.tensor([1.0, 6.0, 448.0, 3.0e-3])])
    s = e8m0_encode(amax, emax=emax)
    scale = e8m0_decode(s, torch.float64)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()                                    # exact powers of two
    ratio = amax.double() / scale                                     # OCP: amax / 2^X in [2^emax, 2^(emax+1))
    assert (ratio >= 2 ** emax).all() and (ratio < 2 ** (emax + 1)).all()
    assert e8m0_encode(torch.zeros(1), emax=emax).item() == 127 and e8m0_decode(torch.tensor([127])).item() == 1.0
    assert e8m0_encode(torch.tensor([1e-38]), emax=emax).item() == 1  # clamped, never 0 (subnormal scale)


@pytest.mark.parametrize("fp4", [True, False])
def test_representable_groups_round_trip_exactly(fp4):
    """Groups that are exactly element * 2^X, with the element maximum present, quantise without loss."""
    g = torch.Generator().manual_seed(1)
    if fp4:
        elems = e2m1_decode(torch.randint(0, 16, (4, 6, 32), dtype=torch.uint8, generator=g))
        elems[..., 5] = 6.0
    else:
        elems = torch.randn(4, 6, 32, generator=g).mul(60).to(torch.float8_e4m3fn).float()
        elems[..., 5] = -448.0
    exps = torch.randint(-20, 20, (4, 6, 1), generator=g)
    x = torch.ldexp(elems, exps).reshape(4, 192)
    q, s = quantize_mx(x, fp4=fp4)
    assert q.shape == ((4, 96) if fp4 else (4, 192)) and s.shape == (4, 6) and s.dtype == torch.uint8
    assert torch.equal(dequantize_mx(q, s), x.double())


@pytest.mark.parametrize("fp4,bound", [(True, 0.15), (False, 0.04)])
def test_quantize_mx_partial_group_and_error(fp4, bound):
    x = torch.randn(5, 80, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 3, 5)[:, None]
    q, s = quantize_mx(x, fp4=fp4)
    assert s.shape == (5, 3)                                          # 80 = 2 groups + a partial one
    assert torch.equal(s[:, 2], e8m0_encode(x[:, 64:].abs().amax(dim=1), emax=E2M1_EMAX if fp4 else E4M3_EMAX))
    back = dequantize_mx(q, s)
    assert back.shape == x.shape
    # e2m1 keeps 1 mantissa bit (12% rms here on Gaussian rows), e4m3 keeps 3 (~3%).
    assert ((back - x.double()).norm() / x.double().norm()).item() < bound


def test_mx_activation_quant_is_the_mx_rule():
    x = (torch.randn(7, 96, generator=torch.Generator().manual_seed(3)) * 4).half()
    x[2] = 0
    q, s = quantize_activation(x, dtype=torch.float8_e4m3fn, granularity=G.group32)
    q_ref, s_ref = quantize_mx(x, fp4=False)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())
    assert (s[2] == 127).all() and torch.isfinite(dequantize_activation(q, s, granularity=G.group32)).all()
    with pytest.raises(ValueError, match="fp8 e4m3 only"):
        quantize_activation(x, dtype=torch.int8, granularity=G.group32)


def test_triton_mx_activation_quant_matches_torch():
    from moerules.kernels.triton.quant import quantize_activation_triton
    x = torch.randn(9, 200, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 2, 9)[:, None]
    x[3] = 0
    x = x.half()
    q, s = quantize_mx(x, fp4=False)
    qt, st = quantize_activation_triton(x.to(DEVICE), dtype=torch.float8_e4m3fn, granularity=G.group32)
    assert torch.equal(st.cpu(), s)
    # The interpreter's fp32->fp8 cast mishandles a rounding carry into the next exponent (see
    # test_routing_align_quant.py), so the elements are compared where the cast is the hardware's.
    if torch.cuda.is_available():
        assert torch.equal(qt.cpu().float(), q.float())


# ---- the reference ------------------------------------------------------------------------------

@pytest.mark.parametrize("cell", MX_CELLS)
def test_reference_matches_dequantised_float64_math(cell):
    """The yardstick against a per-token formula on the dequantised weights (and QDQ'd activations)."""
    layer = make_layer("torch.reference", cell, dtype=Dtype.fp32, activation=Activation.swigluoai, bias=True,
                       H=96, I=64)
    x, ids, w = random_inputs(layer, 5, 2)
    W = layer.weights
    w13, w2 = dequantize_mx(W.w13, W.w13_scale), dequantize_mx(W.w2, W.w2_scale)

    def qdq(t):  # MXFP8 activations: e4m3 elements with an e8m0 scale per 32 along K
        return dequantize_mx(*quantize_mx(t, fp4=False)) if cell == MXFP8 else t.double()

    expected = torch.zeros(5, 96, dtype=torch.float64)
    xq = qdq(x)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            h = w13[e] @ xq[t] + W.w13_bias[e].double()
            gate, up = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)  # swigluoai: interleaved, clamped
            inter = (gate * torch.sigmoid(1.702 * gate) * (up + 1)).float()
            expected[t] += w[t, j].double() * (w2[e] @ qdq(inter[None])[0] + W.w2_bias[e].double())
    assert rel_err(reference64(layer, x, ids, w), expected) < 1e-6


@pytest.mark.parametrize("cell", MX_CELLS)
def test_reference_backend_bf16(cell):
    layer = make_layer("torch.reference", cell, dtype=Dtype.bf16, activation=Activation.swigluoai, bias=True)
    x, ids, w = random_inputs(layer, 7, 2)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < 2e-2


# ---- the Triton kernels -------------------------------------------------------------------------

@pytest.mark.parametrize("activation,bias", [(Activation.swigluoai, True), (Activation.silu, False)])
@pytest.mark.parametrize("cell", MX_CELLS)
def test_triton_mx_matches_reference(cell, activation, bias, poison_empty):
    # swigluoai + biases on mxfp4 is exactly gpt-oss; shapes are not multiples of the tiles (H=160, I=96).
    layer = make_layer("triton.fused_moe", cell, activation=activation, dtype=TRITON_DTYPE, bias=bias, device=DEVICE)
    x, ids, w = random_inputs(layer, 13, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < tol(cell)


@pytest.mark.parametrize("cell", MX_CELLS)
@pytest.mark.parametrize("M,top_k,E", [
    (1, 2, 8),      # M=1: six of eight experts get no token
    (1, 1, 8),      # top_k=1
    (21, 1, 4),     # top_k=1 through the sorted path, several blocks
])
def test_triton_mx_edge_shapes(cell, M, top_k, E, poison_empty):
    layer = make_layer("triton.fused_moe", cell, activation=Activation.swigluoai, bias=True, dtype=TRITON_DTYPE,
                       E=E, H=96, I=64, device=DEVICE)
    x, ids, w = random_inputs(layer, M, top_k, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < tol(cell)


@pytest.mark.parametrize("cell", MX_CELLS)
def test_triton_mx_expert_without_tokens_and_zero_tokens(cell, poison_empty):
    layer = make_layer("triton.fused_moe", cell, dtype=TRITON_DTYPE, E=4, H=96, I=64, bias=True, device=DEVICE)
    x, _, _ = random_inputs(layer, 6, 2, device=DEVICE)
    ids = torch.tensor([[0, 2]] * 3 + [[2, 3]] * 3, dtype=torch.int32, device=DEVICE)   # expert 1 gets nothing
    w = torch.full((6, 2), 0.5, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < tol(cell)
    empty = layer(x[:0], topk_ids=ids[:0], topk_weights=w[:0])
    assert empty.shape == (0, 96) and empty.dtype == x.dtype


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("block_k", [32, 64, 256])
def test_triton_mxfp8_k_steps_of_several_groups(block_k, swap, poison_empty, monkeypatch):
    """MXFP8 K steps of any whole number of 32-groups (the inputs dequantised once, the weight tile in the K loop),
    each weight with its own group's scale: K = 320 (GEMM1) and 192 (GEMM2) end in a partial step at 64 and 256;
    each weight group's scale moved by a random power of two in 2^-3..2^3, so a scale applied to the wrong group
    shows."""
    run_with_config(monkeypatch, lambda cfg: MoEConfig(
        16, *(GemmConfig(BLOCK_N=32, BLOCK_K=block_k, GROUP_M=1, num_warps=4, num_stages=2, SWAP_AB=swap),) * 2))
    layer = make_layer("triton.fused_moe", MXFP8, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True,
                       E=4, H=320, I=192, device=DEVICE)
    g = torch.Generator().manual_seed(5)
    for name in ("w13_scale", "w2_scale"):
        scale = getattr(layer.weights, name)
        scale += torch.randint(-3, 4, scale.shape, generator=g).to(scale.dtype).to(scale.device)
    x, ids, w = random_inputs(layer, 19, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < tol(MXFP8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_mx_dequantize_is_exact(dtype):
    """quant.dequantize_mx: the MX values of the quantised activations, bit for bit (K = 200: a partial group)."""
    x = torch.randn(7, 200, generator=torch.Generator().manual_seed(3)) * 4
    q, scale = quantize_mx(x, fp4=False)
    out = dequantize_mx_triton(q.to(DEVICE), scale.to(DEVICE), dtype)
    assert out.dtype == dtype and torch.equal(out.cpu(), dequantize_mx(q, scale).to(dtype))


def test_mx_k_steps_are_whole_groups():
    scheme = Scheme.from_quant(quant_of(MXFP8))
    cfg = MoEConfig(16, GemmConfig(BLOCK_N=32, BLOCK_K=48, GROUP_M=1, num_warps=4, num_stages=2),
                    GemmConfig(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2))
    with pytest.raises(ValueError) as info:
        check_config(cfg, scheme)
    assert str(info.value) == "gemm1: BLOCK_K=48 must be a multiple of 32 for MX weights (whole e8m0 groups per K step)"


# ---- padding ------------------------------------------------------------------------------------

def _mx_layer(kernel_id, cell, *, dtype, H=160, I=80, **kw):
    return make_layer(kernel_id, cell, activation=Activation.swigluoai, bias=True, dtype=dtype, H=H, I=I, **kw)


@pytest.mark.parametrize("cell", MX_CELLS)
def test_padding_equals_the_unpadded_reference(cell, poison_empty):
    """I=80 ends in a partial MX group; padding I to 96 (and H 160 -> 192) adds exact zeros only."""
    plain = _mx_layer("torch.reference", cell, dtype=TRITON_DTYPE, device=DEVICE)
    x, ids, w = random_inputs(plain, 9, 2, device=DEVICE)
    ref = reference64(plain, x, ids, w)
    padded_ref = _mx_layer("torch.reference", cell, dtype=TRITON_DTYPE, device=DEVICE, hidden_pad=32,
                           intermediate_pad=16)
    assert padded_ref.weights.hidden == 192 and padded_ref.weights.intermediate == 96
    assert rel_err(reference64(padded_ref, x, ids, w), ref) < 1e-12
    padded = _mx_layer("triton.fused_moe", cell, dtype=TRITON_DTYPE, device=DEVICE, hidden_pad=32,
                       intermediate_pad=16)
    out = padded(x, topk_ids=ids, topk_weights=w)
    assert out.shape == (9, 160)                                      # the unpadded hidden size
    assert rel_err(out, ref) < tol(cell)


@pytest.mark.parametrize("cell", MX_CELLS)
def test_mx_padding_and_build_are_idempotent(cell):
    """Building twice over one MoEWeights (two decisions, two backends) pads and converts nothing twice."""
    weights = make_random_weights(num_experts=4, hidden=96, intermediate=48, quant=quant_of(cell),
                                  in_dtype=Dtype.fp32, has_bias=True, seed=0, device="cpu")
    args = dict(kernel_id="torch.reference", prepare_finalize_id="local", quant=quant_of(cell),
                activation=Activation.swigluoai, in_dtype=Dtype.fp32, activation_format="standard", weights=weights,
                device="cpu", hidden_pad=32, intermediate_pad=16, weight_block=32)
    first = build_layer(**args)
    pack = 2 if cell == MXFP4 else 1
    assert weights.w13.shape == (4, 128, 128 // pack) and weights.w13_scale.shape == (4, 128, 4)
    assert weights.w2.shape == (4, 128, 64 // pack) and weights.w2_scale.shape == (4, 128, 2)
    assert (weights.w13_scale[:, 96:] == 127).all() and (weights.w13[:, 96:].float() == 0).all()
    snapshot = {k: v.clone() for k, v in vars(weights).items() if isinstance(v, torch.Tensor)}
    second = build_layer(**args)
    for k, v in snapshot.items():
        assert torch.equal(getattr(weights, k), v), k
    x, ids, w = random_inputs(first, 5, 2)
    torch.testing.assert_close(first(x, topk_ids=ids, topk_weights=w), second(x, topk_ids=ids, topk_weights=w),
                               rtol=0, atol=0)


# ---- build checks -------------------------------------------------------------------------------

def _weights(cell, H=96, I=64, device="cpu"):
    return make_random_weights(num_experts=4, hidden=H, intermediate=I, quant=quant_of(cell), in_dtype=Dtype.fp16,
                               has_bias=False, seed=0, device=device)


def _build(cell, weight_block, *, kernel_id="torch.reference", H=96, I=64, weights=None, **kw):
    device = DEVICE if kernel_id == "triton.fused_moe" else "cpu"
    return build_layer(kernel_id=kernel_id, prepare_finalize_id="local", quant=quant_of(cell),
                       activation=Activation.silu, in_dtype=Dtype.fp16, activation_format="standard",
                       weights=weights or _weights(cell, H, I, device), device=device, weight_block=weight_block, **kw)


@pytest.mark.parametrize("cell,weight_block,expected", [
    (MXFP8, 0, 32),                               # the seed: block size unset when MXFP8 is converted
    (MXFP8, 128, 32),
    (MXFP4, 128, 32),
    ("fp8_w8a8/block128/group128", 32, 128),
    ("fp8_w8a8/channel/token", 128, 0),
])
def test_wrong_weight_block_is_refused_before_conversion(cell, weight_block, expected):
    what = f"K-block {expected}" if expected else "no K-block, 0"
    message = (f"torch.reference: weight_block={weight_block} disagrees with the weights' scheme {cell} ({what}); "
               f"the block must be fixed before the weights are converted: pass weight_block={expected} (the "
               "decision's quant.weight_block), or quantise the weights for the scheme the decision names")
    weights = _weights(cell)
    with pytest.raises(KernelBuildError) as info:
        _build(cell, weight_block, weights=weights, hidden_pad=32)
    assert str(info.value) == message
    assert weights.padding is None and weights.hidden == 96          # refused before anything touched the weights


def test_right_weight_blocks_build():
    assert _build(MXFP8, 32).weights.scheme.cell == MXFP8
    assert _build(MXFP4, 32).weights.scheme.cell == MXFP4
    with pytest.raises(KernelBuildError, match=r"weight_block=0 disagrees with the weights' scheme mxfp4_w4a16/group32"):
        _build(MXFP4, 0)  # the rules set 32 for every MX family (mxfp4.weight_block_32)


@pytest.mark.parametrize("cell", MX_CELLS)
def test_triton_refuses_partial_mx_groups_without_padding(cell):
    message = ("triton.fused_moe: MX weights need hidden (96) and intermediate (80) to be multiples of 32 after "
               "padding (hidden_pad=0, intermediate_pad=0); pad them up to the next multiple of 32 with "
               "hidden_pad/intermediate_pad")
    with pytest.raises(KernelBuildError) as info:
        _build(cell, 32, kernel_id="triton.fused_moe", I=80)
    assert str(info.value) == message
    assert _build(cell, 32, kernel_id="triton.fused_moe", I=80, intermediate_pad=16).weights.intermediate == 96
    assert _build(cell, 32, I=80).weights.intermediate == 80  # the reference takes the partial group as is


def test_fp4_shapes_that_cannot_be_packed():
    with pytest.raises(KernelBuildError, match=r"multiples of 2, got \(1, 0\)"):
        _build(MXFP4, 32, hidden_pad=1)
    with pytest.raises(ValueError, match="MXFP4 needs an even K"):
        make_random_weights(num_experts=2, hidden=95, intermediate=64, quant=quant_of(MXFP4), in_dtype=Dtype.fp16,
                            has_bias=False, seed=0, device="cpu")


# ---- decisions ----------------------------------------------------------------------------------

def test_gpt_oss_style_decision_pads_and_builds_triton():
    """triton.mxfp4_round_up: intermediate 80 is padded to 128 (the TP-aware per-partition round-up is
    decided in tests/engine; a tp>1 decision builds only over a process group, see tests/ep)."""
    cfg = config({"num_experts": 8, "top_k": 2, "hidden_size": 96, "moe_intermediate_size": 80,
                  "activation": "swigluoai", "has_bias": True, "in_dtype": TRITON_DTYPE.value},
                 quant={"family": "mxfp4_w4a16"}, platform=cuda("sm_90"))
    decision = decide(cfg)
    assert decision.kernel == "triton.fused_moe" and decision.padding.intermediate_pad == 48
    weights = make_random_weights(num_experts=8, hidden=96, intermediate=80, quant=cfg.quant, in_dtype=TRITON_DTYPE,
                                  has_bias=True, seed=0, device=DEVICE)
    plain = make_layer("torch.reference", MXFP4, activation=Activation.swigluoai, bias=True, dtype=TRITON_DTYPE,
                       H=96, I=80, device=DEVICE)                   # same seed: the same weights, unpadded
    layer = build(decision, weights, device=DEVICE)
    assert layer.weights.intermediate == 128
    x, ids, w = random_inputs(plain, 7, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(plain, x, ids, w)) < tol(MXFP4)


def test_mxfp8_decision_carries_its_block_to_the_build():
    cfg = config({"num_experts": 4, "top_k": 2, "hidden_size": 64, "moe_intermediate_size": 64, "in_dtype": "bf16"},
                 quant={"family": "mxfp8"}, platform={"vendor": "cpu", "arch": "x86_64", "packages": []})
    decision = decide(cfg)
    assert decision.kernel == "torch.reference" and decision.quant.weight_block == 32
    weights = make_random_weights(num_experts=4, hidden=64, intermediate=64, quant=cfg.quant, in_dtype=Dtype.bf16,
                                  has_bias=False, seed=0, device="cpu")
    assert build(decision, weights).weights.scheme.cell == MXFP8
    unset = decision.model_copy(update={"quant": decision.quant.model_copy(update={"weight_block": 0})})
    with pytest.raises(KernelUnavailableError, match=r"weight_block=0 disagrees with the weights' scheme "
                                                     r"mxfp8/group32/group32 \(K-block 32\)"):
        build(unset, weights)


def _mxfp4_weights_with_scale(top: int, *, device=DEVICE):
    """Random gpt-oss-style MXFP4 weights whose largest w2 scale byte is `top` (w2 times 2^(top - max))."""
    w = make_random_weights(num_experts=8, hidden=96, intermediate=64, quant=quant_of(MXFP4), in_dtype=TRITON_DTYPE,
                            has_bias=True, seed=3, device=device)
    w2_scale = w.w2_scale + (top - int(w.w2_scale.max()))
    return dataclasses.replace(w, w2_scale=w2_scale.to(torch.uint8))


@pytest.mark.parametrize("top,folds", [(E8M0_FOLD_MAX, True), (E8M0_FOLD_MAX + 1, False)])
def test_fp4_scales_fold_up_to_the_fold_limit(top, folds):
    assert _mxfp4_weights_with_scale(top, device="cpu").fp4_scales_fold is folds
    assert not make_random_weights(num_experts=2, hidden=64, intermediate=32, quant=quant_of(MXFP8),
                                   in_dtype=Dtype.fp16, has_bias=False, seed=0, device="cpu").fp4_scales_fold


@pytest.mark.parametrize("top", [E8M0_FOLD_MAX, E8M0_FOLD_MAX + 3])
def test_triton_mxfp4_large_scales_match_reference(top, poison_empty):
    """Scales past the fold limit take the two-multiply decode (on the GPU; the interpreter's decode is Triton
    code for both). Past it, w2's groups reach 2^4 * 6: outputs near 2^7, still finite in fp16."""
    weights = _mxfp4_weights_with_scale(top)
    layer = make_layer("triton.fused_moe", MXFP4, activation=Activation.swigluoai, dtype=TRITON_DTYPE,
                       weights=weights, device=DEVICE)
    assert layer.weights.fp4_scales_fold is (top <= E8M0_FOLD_MAX)
    x, ids, w = random_inputs(layer, 21, 4, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < tol(MXFP4)


@pytest.mark.parametrize("weight_rows,num_warps,block_m,swap", [
    (128, 4, 32, True), (256, 8, 64, True),   # triton_kernels' Hopper tile (bench/moe.py TK_MXFP4_TILES)
    (128, 4, 64, False), (128, 8, 128, False),  # tokens on wgmma's M side: one dot over the interleaved nibbles
])
def test_triton_mxfp4_wgmma_tiles(weight_rows, num_warps, block_m, swap, poison_empty, monkeypatch):
    """The tiles that run wgmma on sm_90 (the MMA's M side a multiple of 64): weight rows there (swapped), the
    decoded weights fed from registers, or tokens there, the decoded tile stored once per K step (`_fp4_mma`);
    128-deep K steps, masked past K=288; several column tiles."""
    tile = dict(BLOCK_K=128, GROUP_M=1, num_warps=num_warps, num_stages=3, SWAP_AB=swap)
    forced = MoEConfig(BLOCK_M=block_m, gemm1=GemmConfig(BLOCK_N=weight_rows // 2, **tile),
                       gemm2=GemmConfig(BLOCK_N=weight_rows, **tile))
    run_with_config(monkeypatch, lambda cfg: forced)
    layer = make_layer("triton.fused_moe", MXFP4, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True,
                       E=8, H=288, I=192, device=DEVICE)
    x, ids, w = random_inputs(layer, 77, 4, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < tol(MXFP4)


# ---- GPU only (bf16) ----------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only (bf16 tl.dot is wrong under the interpreter)")
@pytest.mark.parametrize("dtype", [Dtype.bf16, Dtype.fp16])
@pytest.mark.parametrize("cell", MX_CELLS)
def test_triton_mx_gpu(cell, dtype, poison_empty):
    """bf16 (wrong under the interpreter) and fp16 on the GPU; M=300 takes the 128-row blocks of the MX defaults."""
    layer = make_layer("triton.fused_moe", cell, activation=Activation.swigluoai, dtype=dtype, bias=True,
                       E=8, H=288, I=192, device="cuda")
    for M, k in ((1, 4), (77, 4), (300, 2)):
        x, ids, w = random_inputs(layer, M, k, device="cuda")
        bound = tol(cell) if dtype == Dtype.bf16 else (2e-3 if cell == MXFP4 else 1e-2)
        assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < bound


@pytest.mark.parametrize("M,block_m,k_steps", [(1, 1, (512, 512)), (4, 1, (512, 512)), (5, 16, (128, 128)),
                                               (512, 16, (128, 128)), (513, 32, (64, 64)), (4096, 128, (64, 64))])
def test_mxfp8_default_follows_the_rows_per_expert(M, block_m, k_steps):
    """gpt-oss-120b (E=128, top-4) MXFP8 without a tuned file: GEMV rows up to 1/8 row per expert, then the smallest
    MMA block that holds the mean rows; 128-deep K steps at 16-row blocks, 64-deep from 32 (the H200 tuner's)."""
    cfg = default_config(num_tokens=M, num_experts=128, top_k=4, scheme=Scheme.from_quant(quant_of(MXFP8)))
    assert (cfg.BLOCK_M, (cfg.gemm1.BLOCK_K, cfg.gemm2.BLOCK_K)) == (block_m, k_steps)


@pytest.mark.parametrize("M,block_m", [(1, 1), (4, 1), (5, 16), (32, 16), (33, 16), (2048, 64)])
def test_mxfp4_default_block_follows_the_rows_per_expert(M, block_m):
    """gpt-oss-120b (E=128, top-4) without a tuned file: at most 1/8 row per expert runs GEMV rows (at 1/2 they ran
    1.67x slower than 16-row MMA blocks on the H200), more rows the smallest MMA block that holds their mean (each
    block decodes the expert's weights once)."""
    scheme = Scheme.from_quant(quant_of("mxfp4_w4a16/group32"))
    assert default_config(num_tokens=M, num_experts=128, top_k=4, scheme=scheme).BLOCK_M == block_m
