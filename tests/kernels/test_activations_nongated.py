"""Non-gated activations (silu_no_mul, gelu_no_mul, relu2_no_mul): w13 holds I rows, act applied elementwise.

Tolerances are those of test_fused_moe.py (relative Frobenius error against the float64 reference
on the same prepared input): fp16 Triton under the interpreter 2e-3 (bf16 on a GPU 8e-3), W8A8
1e-2, the fp32 reference against dense math 1e-6, padded vs unpadded fp32 reference 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import DEVICE, TRITON_DTYPE, make_layer, quant_of, random_inputs, reference64, rel_err

from moerules.activation import Activation, Dtype
from moerules.kernels import KernelBuildError, MoEWeights, build_layer, make_random_weights, supported_cells
from moerules.kernels.activations import NON_GATED_ACTIVATIONS
from moerules.kernels.scheme import Scheme
from moerules.quant import QuantFamily

NON_GATED = sorted(NON_GATED_ACTIVATIONS, key=lambda a: a.value)
CELLS = ["unquantized", "fp8_w8a8/tensor/tensor", "fp8_w8a8/block128/group128", "int8_w8a8/channel/token"]


def triton_tol(cell: str) -> float:
    if "w8a8" in cell:
        return 1e-2
    return 2e-3 if TRITON_DTYPE == Dtype.fp16 else 8e-3


def _scalar_act(v: float, activation: Activation) -> float:
    """The three functions from their definitions, one float at a time."""
    if activation == Activation.silu_no_mul:
        return v / (1 + math.exp(-v))
    if activation == Activation.gelu_no_mul:
        return 0.5 * v * (1 + math.erf(v / math.sqrt(2)))
    return max(v, 0.0) ** 2


@pytest.mark.parametrize("activation", NON_GATED)
def test_reference_matches_dense_math(activation):
    layer = make_layer("torch.reference", dtype=Dtype.fp32, activation=activation, bias=True, E=4, H=32, I=24)
    assert layer.weights.w13.shape == (4, 24, 32) and not layer.weights.gated
    x, ids, tw = random_inputs(layer, 4, 2)
    W = layer.weights
    expected = torch.zeros(4, 32, dtype=torch.float64)
    for t in range(4):
        for j in range(2):
            e = int(ids[t, j])
            h = (W.w13[e].double() @ x[t].double() + W.w13_bias[e].double()).tolist()
            a = torch.tensor([_scalar_act(v, activation) for v in h], dtype=torch.float32).double()
            expected[t] += tw[t, j].double() * (W.w2[e].double() @ a + W.w2_bias[e].double())
    assert rel_err(reference64(layer, x, ids, tw), expected) < 1e-6


@pytest.mark.parametrize("activation", NON_GATED)
@pytest.mark.parametrize("cell", CELLS)
def test_triton_non_gated(cell, activation, poison_empty):
    # I=160: two 128-row scale blocks for block128 (the second one partial), N1 = I.
    layer = make_layer("triton.fused_moe", cell, activation=activation, dtype=TRITON_DTYPE, bias=True, I=160,
                       device=DEVICE)
    x, ids, tw = random_inputs(layer, 11, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), reference64(layer, x, ids, tw)) < triton_tol(cell)


@pytest.mark.parametrize("activation", NON_GATED)
def test_grouped_mm_non_gated(activation):
    layer = make_layer("torch.grouped_mm", dtype=Dtype.fp32, activation=activation, bias=True, device=DEVICE)
    x, ids, tw = random_inputs(layer, 9, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), reference64(layer, x, ids, tw)) < 1e-5


@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a16/channel", "fp8_w8a16/block128"])
def test_non_gated_padding_is_exact(cell):
    """Rows padded once at the end (not per half): the padded layer computes the unpadded one."""
    dtype = Dtype.fp32 if cell == "unquantized" else Dtype.bf16
    kw = dict(dtype=dtype, activation=Activation.relu2_no_mul, bias=True, E=4, H=64, I=96)
    plain = make_layer("torch.reference", cell, **kw)
    padded = make_layer("torch.reference", cell, **kw, hidden_pad=32, intermediate_pad=48)
    W = padded.weights
    assert W.w13.shape == (4, 144, 96) and W.w2.shape == (4, 96, 144) and W.w13_bias.shape == (4, 144)
    assert W.w13[:, 96:].eq(0).all() and not W.w13[:, :96].eq(0).all(2).any()  # the pad is the last 48 rows
    if cell == "fp8_w8a16/block128":
        assert W.w13_scale.shape == (4, 2, 1)  # cdiv(144, 128) row blocks, cdiv(96, 128) column blocks
    x, ids, tw = random_inputs(plain, 7, 2)
    assert rel_err(padded(x, topk_ids=ids, topk_weights=tw), plain(x, topk_ids=ids, topk_weights=tw).double()) < 1e-6


@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a8/block128/group128"])
def test_triton_non_gated_with_padding(cell, poison_empty):
    kw = dict(activation=Activation.gelu_no_mul, dtype=TRITON_DTYPE, bias=True, device=DEVICE)
    plain = make_layer("triton.fused_moe", cell, **kw)
    padded = make_layer("triton.fused_moe", cell, **kw, hidden_pad=16, intermediate_pad=32)
    x, ids, tw = random_inputs(plain, 9, 2, device=DEVICE)
    assert rel_err(padded(x, topk_ids=ids, topk_weights=tw), reference64(padded, x, ids, tw)) < triton_tol(cell)
    if cell == "unquantized":  # exact padding: the unpadded layer's reference is the same function
        assert rel_err(padded(x, topk_ids=ids, topk_weights=tw), reference64(plain, x, ids, tw)) < triton_tol(cell)


def test_weights_shape_must_match_gating():
    w13, w2 = torch.zeros(4, 64, 32), torch.zeros(4, 32, 32)
    scheme = Scheme(family=QuantFamily.unquantized)
    with pytest.raises(ValueError, match=r"^w13 \(4, 64, 32\) and w2 \(4, 32, 32\) do not form a \[E, I, H\] / "
                                         r"\[E, H, I\] pair \(non-gated\); gated=False must match the activation"):
        MoEWeights(w13=w13, w2=w2, scheme=scheme, in_dtype=Dtype.fp32, gated=False)
    with pytest.raises(ValueError, match=r"do not form a \[E, 2I, H\] / \[E, H, I\] pair \(gated\); gated=True"):
        MoEWeights(w13=w13[:, :32], w2=w2, scheme=scheme, in_dtype=Dtype.fp32)
    assert MoEWeights(w13=w13[:, :32], w2=w2, scheme=scheme, in_dtype=Dtype.fp32, gated=False).intermediate == 32


@pytest.mark.parametrize("activation,gated,message", [
    (Activation.relu2_no_mul, True, r"^torch\.reference: activation 'relu2_no_mul' needs w13 with I rows, but the "
                                    r"weights are gated \(w13 \(4, 64, 64\), w2 \(4, 64, 32\)\); make them with "
                                    r"gated=False$"),
    (Activation.silu, False, r"^torch\.reference: activation 'silu' needs w13 with 2I \(gate and up\) rows, but the "
                             r"weights are non-gated \(w13 \(4, 32, 64\), w2 \(4, 64, 32\)\); make them with "
                             r"gated=True$"),
])
def test_build_refuses_weights_gated_unlike_the_activation(activation, gated, message):
    w = make_random_weights(num_experts=4, hidden=64, intermediate=32, quant=quant_of("unquantized"),
                            in_dtype=Dtype.fp32, has_bias=False, seed=0, device="cpu", gated=gated)
    with pytest.raises(KernelBuildError, match=message):
        build_layer(kernel_id="torch.reference", prepare_finalize_id="local", quant=quant_of("unquantized"),
                    activation=activation, in_dtype=Dtype.fp32, activation_format="standard", weights=w,
                    device="cpu")


def test_registry_lists_the_non_gated_activations():
    """The standard-format experts take them; the batched ones are gated-only (rule batched_triton.gated_activations)."""
    names = {a.value for a in NON_GATED}
    for kernel_id, entry in supported_cells().items():
        if entry["activation_format"] == "batched":
            assert not names & set(entry["activations"]), kernel_id
        else:
            assert names <= set(entry["activations"]), kernel_id


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is only right on a GPU")
@pytest.mark.parametrize("activation", NON_GATED)
@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a8/channel/token", "fp8_w8a8/block128/group128"])
def test_triton_non_gated_bf16_gpu(cell, activation, poison_empty):
    layer = make_layer("triton.fused_moe", cell, activation=activation, dtype=Dtype.bf16, bias=True, H=256, I=320,
                       device="cuda")
    x, ids, tw = random_inputs(layer, 70, 2, device="cuda")
    tol = 3e-2 if "w8a8" in cell else 8e-3
    assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), reference64(layer, x, ids, tw)) < tol
