"""LoRA adapters on the experts: the float64 reference against dense math, Triton against the reference,
padding, edge shapes, and the refusals.

Tolerances (relative Frobenius error against the float64 reference on the same weights):
  reference (fp32 in_dtype) vs the dense per-token formula: 1e-6 (fp32 rounding of the intermediate only)
  Triton, fp16 under the interpreter (CPU; tl.dot is wrong there for bf16): 2e-3. Beyond the base GEMMs'
      fp16 rounding (~3e-4 relative), the shrink output is rounded to fp16 before the expand dot.
  Triton, bf16 on a GPU: 1e-2 (bf16 rounds ~8x coarser, the shrink too).
Random adapters make each delta about as large as the base GEMM output (make_random_lora), so
dropping either delta moves the output far beyond these tolerances (test_each_delta_matters).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import (DEVICE, TILE_VARIANTS, TRITON_DTYPE, make_layer, quant_of, random_inputs, reference64,
                            rel_err, run_with_config)

from moerules.activation import Activation, Dtype
from moerules.kernels import KernelBuildError, LoRAWeights, build_layer, make_random_lora, make_random_weights

TRITON_TOL = 2e-3 if TRITON_DTYPE == Dtype.fp16 else 1e-2
WEIGHT_ONLY_CELLS = ["unquantized", "fp8_w8a16/tensor", "fp8_w8a16/channel", "fp8_w8a16/block128",
                     "int8_w8a16/channel"]


def _act(h: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The activations written out independently of kernels/activations.py."""
    if activation == Activation.silu:
        g, u = h.chunk(2)
        return g / (1 + torch.exp(-g)) * u
    if activation == Activation.swigluoai:
        g, u = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
        return g / (1 + torch.exp(-1.702 * g)) * (u + 1)
    assert activation == Activation.relu2_no_mul
    return F.relu(h) ** 2


def _dense(layer, x, ids, tw) -> torch.Tensor:
    """Per token and slot: h = W13 x + s B13 A13 x + b13, a = act(h), y = W2 a + s B2 A2 a + b2, weighted sum."""
    W, L = layer.weights, layer.weights.lora
    out = torch.zeros(x.shape[0], layer.hidden_size, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, xt = int(ids[t, j]), x[t].double()
            h = W.w13[e].double() @ xt + L.scaling * (L.w13_lora_b[e].double() @ (L.w13_lora_a[e].double() @ xt))
            a = _act(h + W.w13_bias[e].double(), layer.experts.activation)
            a = a.to(x.dtype).double()  # every backend keeps the intermediate in in_dtype
            y = W.w2[e].double() @ a + L.scaling * (L.w2_lora_b[e].double() @ (L.w2_lora_a[e].double() @ a))
            out[t] += tw[t, j].double() * (y + W.w2_bias[e].double())
    return out


@pytest.mark.parametrize("activation", [Activation.silu, Activation.swigluoai, Activation.relu2_no_mul])
def test_reference_lora_matches_dense_math(activation):
    layer = make_layer("torch.reference", dtype=Dtype.fp32, activation=activation, bias=True, E=4, H=48, I=40,
                       lora_rank=5)
    x, ids, tw = random_inputs(layer, 6, 2)
    expected = _dense(layer, x, ids, tw)
    assert rel_err(reference64(layer, x, ids, tw), expected) < 1e-6
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), expected) < 1e-6  # the fp32 backend itself


@pytest.mark.parametrize("activation", [Activation.silu, Activation.swigluoai])
@pytest.mark.parametrize("cell", WEIGHT_ONLY_CELLS)
def test_triton_lora_every_weight_only_cell(cell, activation, poison_empty):
    layer = make_layer("triton.fused_moe", cell, activation=activation, dtype=TRITON_DTYPE, bias=True, lora_rank=8,
                       device=DEVICE)
    x, ids, tw = random_inputs(layer, 13, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), reference64(layer, x, ids, tw)) < TRITON_TOL


@pytest.mark.parametrize("swap_ab", [False, True])
def test_triton_lora_one_row_blocks(swap_ab, poison_empty, monkeypatch):
    """BLOCK_M 1 (the GEMV path): the shrink and both expand epilogues run their one-row products too."""
    run_with_config(monkeypatch, TILE_VARIANTS["one_row_swapped" if swap_ab else "one_row"])
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, bias=True, lora_rank=8, device=DEVICE)
    x, ids, tw = random_inputs(layer, 9, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), reference64(layer, x, ids, tw)) < TRITON_TOL


@pytest.mark.parametrize("rank", [1, 8, 16, 20])  # 20: the rank pads to 32 inside the kernels
def test_triton_lora_ranks(rank, poison_empty):
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, bias=True, lora_rank=rank, device=DEVICE)
    x, ids, tw = random_inputs(layer, 9, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), reference64(layer, x, ids, tw)) < TRITON_TOL


@pytest.mark.parametrize("kernel_id", ["triton.fused_moe", "torch.reference"])
def test_lora_edge_shapes(kernel_id, poison_empty):
    dtype = TRITON_DTYPE if kernel_id == "triton.fused_moe" else Dtype.fp32
    tol = TRITON_TOL if kernel_id == "triton.fused_moe" else 1e-6
    layer = make_layer(kernel_id, dtype=dtype, E=4, lora_rank=8, device=DEVICE)
    x, ids, tw = random_inputs(layer, 0, 2, device=DEVICE)
    out = layer(x, topk_ids=ids, topk_weights=tw)
    assert out.shape == (0, layer.hidden_size) and out.dtype == x.dtype
    x, ids, tw = random_inputs(layer, 1, 2, device=DEVICE)  # M=1: two of four experts get no token
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), reference64(layer, x, ids, tw)) < tol
    # 12 tokens x top-2 through the sorted (not the one-block-per-slot) path; expert 2 gets no token.
    x, _, tw = random_inputs(layer, 12, 2, device=DEVICE)
    ids = torch.tensor([[0, 1], [1, 3], [3, 0]] * 4, dtype=torch.int32, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), reference64(layer, x, ids, tw)) < tol


def _with(layer, **tensors) -> LoRAWeights:
    return dataclasses.replace(layer.weights.lora, **tensors)


@pytest.mark.parametrize("kernel_id", ["triton.fused_moe", "torch.reference"])
def test_zero_b_gives_exactly_the_base_output(kernel_id):
    dtype = TRITON_DTYPE if kernel_id == "triton.fused_moe" else Dtype.fp16
    layer = make_layer(kernel_id, dtype=dtype, activation=Activation.swigluoai, bias=True, lora_rank=8, device=DEVICE)
    x, ids, tw = random_inputs(layer, 7, 2, device=DEVICE)
    lora = layer.weights.lora
    layer.set_lora(None)
    base = layer(x, topk_ids=ids, topk_weights=tw)
    layer.set_lora(dataclasses.replace(lora, w13_lora_b=torch.zeros_like(lora.w13_lora_b),
                                       w2_lora_b=torch.zeros_like(lora.w2_lora_b)))
    assert torch.equal(layer(x, topk_ids=ids, topk_weights=tw), base)


@pytest.mark.parametrize("kernel_id", ["triton.fused_moe", "torch.reference"])
def test_each_delta_matters(kernel_id):
    """Without either GEMM's delta the output is far outside the tolerance: a lost LoRA path fails the tests."""
    dtype = TRITON_DTYPE if kernel_id == "triton.fused_moe" else Dtype.fp16
    layer = make_layer(kernel_id, dtype=dtype, lora_rank=8, device=DEVICE)
    x, ids, tw = random_inputs(layer, 7, 2, device=DEVICE)
    full = reference64(layer, x, ids, tw)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), full) < TRITON_TOL
    lora = layer.weights.lora
    for gemm in ("w13_lora_b", "w2_lora_b"):
        layer.set_lora(dataclasses.replace(lora, **{gemm: torch.zeros_like(getattr(lora, gemm))}))
        assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), full) > 50 * TRITON_TOL, gemm


@pytest.mark.parametrize("activation", [Activation.silu, Activation.swigluoai, Activation.relu2_no_mul])
def test_lora_padding_is_exact(activation):
    kw = dict(dtype=Dtype.fp32, activation=activation, bias=True, E=4, H=64, I=40, lora_rank=8)
    plain = make_layer("torch.reference", **kw)
    padded = make_layer("torch.reference", **kw, hidden_pad=32, intermediate_pad=24)
    W, L = padded.weights, padded.weights.lora
    rows13 = 2 * 64 if activation.gated else 64
    assert (L.w13_lora_a.shape, L.w13_lora_b.shape, L.w2_lora_a.shape, L.w2_lora_b.shape) == (
        (4, 8, 96), (4, rows13, 8), (4, 8, 64), (4, 96, 8))
    # Adapter rows/columns are zero exactly where the base weights' padding is (random values are never 0).
    assert torch.equal(L.w13_lora_b.eq(0).all(2), W.w13.eq(0).all(2))
    assert torch.equal(L.w13_lora_a.eq(0).all(1), W.w13.eq(0).all(1))
    assert torch.equal(L.w2_lora_a.eq(0).all(1), W.w2.eq(0).all(1))
    assert torch.equal(L.w2_lora_b.eq(0).all(2), W.w2.eq(0).all(2))
    x, ids, tw = random_inputs(plain, 7, 2)
    expected = plain(x, topk_ids=ids, topk_weights=tw).double()
    assert rel_err(padded(x, topk_ids=ids, topk_weights=tw), expected) < 1e-6
    # Adapters that arrive after the padded build are padded the same way.
    late = make_layer("torch.reference", **dict(kw, lora_rank=0), hidden_pad=32, intermediate_pad=24)
    late.set_lora(make_random_lora(num_experts=4, hidden=64, intermediate=40, rank=8, in_dtype=Dtype.fp32,
                                   gated=activation.gated, seed=100, device="cpu"))
    assert torch.equal(late(x, topk_ids=ids, topk_weights=tw), padded(x, topk_ids=ids, topk_weights=tw))


def test_triton_lora_with_padding(poison_empty):
    kw = dict(activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True, lora_rank=8, device=DEVICE)
    plain = make_layer("triton.fused_moe", **kw)
    padded = make_layer("triton.fused_moe", **kw, hidden_pad=16, intermediate_pad=32)
    x, ids, tw = random_inputs(plain, 9, 2, device=DEVICE)
    # Against the reference of the unpadded layer: padding must not change the logical result.
    assert rel_err(padded(x, topk_ids=ids, topk_weights=tw), reference64(plain, x, ids, tw)) < TRITON_TOL


def _lora_weights(cell="unquantized", *, dtype=Dtype.fp16, gated=True, rank=4, H=64, I=32):
    w = make_random_weights(num_experts=4, hidden=64, intermediate=32, quant=quant_of(cell), in_dtype=dtype,
                            has_bias=False, seed=0, device="cpu", gated=gated)
    w.lora = make_random_lora(num_experts=4, hidden=H, intermediate=I, rank=rank, in_dtype=dtype, gated=gated,
                              seed=1, device="cpu")
    return w


def _build(kernel_id, weights, cell="unquantized", activation=Activation.silu, **kw):
    return build_layer(kernel_id=kernel_id, prepare_finalize_id="local", quant=quant_of(cell), activation=activation,
                       in_dtype=weights.in_dtype, activation_format="standard", weights=weights, device="cpu", **kw)


@pytest.mark.parametrize("kernel_id", ["triton.fused_moe", "torch.reference"])
@pytest.mark.parametrize("cell,qdtype", [("fp8_w8a8/channel/token", "fp8_e4m3"), ("int8_w8a8/channel/token", "int8")])
def test_lora_refused_with_quantised_activations(kernel_id, cell, qdtype):
    with pytest.raises(KernelBuildError) as info:
        _build(kernel_id, _lora_weights(cell), cell)
    assert str(info.value) == (f"{kernel_id}: LoRA deltas must see unquantised activations, but scheme {cell} "
                               f"quantises them to {qdtype}; use unquantized or a weight-only scheme (fp8_w8a16, "
                               "int8_w8a16)")


GROUPED_MM_REFUSAL = ("torch.grouped_mm: the weights carry LoRA adapters, which these experts cannot apply; use "
                      "triton.fused_moe or torch.reference (decide with features.lora)")


def test_lora_refused_by_grouped_mm():
    with pytest.raises(KernelBuildError) as info:
        _build("torch.grouped_mm", _lora_weights(dtype=Dtype.fp32))
    assert str(info.value) == GROUPED_MM_REFUSAL
    weights = _lora_weights(dtype=Dtype.fp32)
    lora, weights.lora = weights.lora, None
    layer = _build("torch.grouped_mm", weights)
    with pytest.raises(KernelBuildError) as info:
        layer.set_lora(lora)
    assert str(info.value) == GROUPED_MM_REFUSAL
    # Assigned behind the layer's back, the adapters are still not dropped silently.
    weights.lora = lora
    x, ids, tw = random_inputs(layer, 3, 2)
    with pytest.raises(ValueError) as info:
        layer(x, topk_ids=ids, topk_weights=tw)
    assert str(info.value) == GROUPED_MM_REFUSAL


@pytest.mark.parametrize("weights_kw,message", [
    (dict(H=48), r"^torch\.reference: LoRA adapters do not fit the expert weights \(w13 rows, hidden, intermediate "
                 r"= 64, 64, 32\): w13_lora_a is \(4, 4, 48\), expected \(4, 4, 64\); w2_lora_b is \(4, 48, 4\), "
                 r"expected \(4, 64, 4\)"),
    (dict(I=16), r"w13_lora_b is \(4, 32, 4\), expected \(4, 64, 4\); w2_lora_a is \(4, 4, 16\), expected"),
])
def test_lora_shape_mismatch_is_refused(weights_kw, message):
    with pytest.raises(KernelBuildError, match=message):
        _build("torch.reference", _lora_weights(**weights_kw))


def test_gated_adapters_on_non_gated_weights_are_refused():
    weights = _lora_weights(gated=False)
    weights.lora = make_random_lora(num_experts=4, hidden=64, intermediate=32, rank=4, in_dtype=Dtype.fp16,
                                    gated=True, seed=1, device="cpu")
    with pytest.raises(KernelBuildError, match=r"w13_lora_b is \(4, 64, 4\), expected \(4, 32, 4\)"):
        _build("torch.reference", weights, activation=Activation.relu2_no_mul)


def test_adapters_in_another_dtype_are_refused():
    weights = _lora_weights()
    weights.lora = make_random_lora(num_experts=4, hidden=64, intermediate=32, rank=4, in_dtype=Dtype.fp32,
                                    seed=1, device="cpu")
    with pytest.raises(KernelBuildError, match=r"^torch\.reference: LoRA w13_lora_a is torch\.float32 on cpu; the "
                                               r"layer computes in torch\.float16 on cpu$"):
        _build("torch.reference", weights)


def test_unpadded_adapters_assigned_after_a_padded_build_are_caught():
    weights = _lora_weights()
    lora, weights.lora = weights.lora, None
    layer = _build("torch.reference", weights, hidden_pad=16)
    weights.lora = lora  # bypasses set_lora, which would have padded it
    x, ids, tw = random_inputs(layer, 3, 2)
    with pytest.raises(ValueError, match=r"w13_lora_a is \(4, 4, 64\), expected \(4, 4, 80\).*MoELayer\.set_lora"):
        layer(x, topk_ids=ids, topk_weights=tw)


def test_inconsistent_adapters_are_rejected():
    lora = make_random_lora(num_experts=4, hidden=64, intermediate=32, rank=4, in_dtype=Dtype.fp16, seed=1,
                            device="cpu")
    with pytest.raises(ValueError, match=r"w13_lora_a \(4, 4, 64\) sets \(experts, rank\) = \(4, 4\), but w2_lora_b "
                                         r"has \(experts, rank\) \(4, 3\)"):
        dataclasses.replace(lora, w2_lora_b=lora.w2_lora_b[:, :, :3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is only right on a GPU")
@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a16/channel", "fp8_w8a16/block128", "int8_w8a16/channel"])
@pytest.mark.parametrize("activation", [Activation.silu, Activation.swigluoai, Activation.relu2_no_mul])
def test_triton_lora_bf16_gpu(cell, activation, poison_empty):
    layer = make_layer("triton.fused_moe", cell, activation=activation, dtype=Dtype.bf16, bias=True, H=256, I=128,
                       lora_rank=16, device="cuda", hidden_pad=64, intermediate_pad=128)
    x, ids, tw = random_inputs(layer, 70, 2, device="cuda")
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), reference64(layer, x, ids, tw)) < 1e-2
