"""The layer's input contract (MoELayer.forward, MoEWeights): every breach is a KernelInputError naming the
argument and what was expected, and a strided view of x computes exactly what its contiguous copy does.

Non-contiguous x: a transposed buffer (column-major [M, H]) and a column slice with step 2 of a wider
buffer; before the contract the Triton kernels read both with the wrong strides and returned wrong values
without an error. Every scheme cell of every experts kernel that runs here (Triton under the interpreter,
fp16) is compared bit for bit with its contiguous input.
"""

from __future__ import annotations

import re

import pytest
import torch
from kernel_helpers import DEVICE, TRITON_DTYPE, make_layer, random_inputs

from moerules.activation import Activation, Dtype
from moerules.errors import KernelInputError
from moerules.kernels import MoEWeights, build_layer, make_random_weights
from moerules.kernels.registry import EXPERTS
from moerules.kernels.scheme import quant_for_cell as quant_of
from moerules.kernels.triton.launch import fused_moe

STANDARD_KERNELS = [("triton.fused_moe", TRITON_DTYPE), ("torch.reference", Dtype.fp16)]
BATCHED_KERNELS = [("triton.batched_moe", TRITON_DTYPE), ("torch.batched_reference", Dtype.fp16)]


def strided_views(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same values as x in layouts a serving engine hands over: transposed, and every other column."""
    transposed = x.t().contiguous().t()
    wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype, device=x.device)
    wide[:, ::2] = x
    views = {"transposed": transposed, "column slice": wide[:, ::2]}
    assert all(not v.is_contiguous() and torch.equal(v, x) for v in views.values())
    return views


def _cells(kernel_id: str) -> list[str]:
    return sorted(EXPERTS[kernel_id].cells)


@pytest.mark.parametrize("kernel_id,dtype,cell", [(k, d, c) for k, d in STANDARD_KERNELS for c in _cells(k)])
def test_a_strided_x_gives_the_output_of_its_contiguous_copy(kernel_id, dtype, cell):
    layer = make_layer(kernel_id, cell, dtype=dtype, H=128, I=64, device=DEVICE)
    x, ids, w = random_inputs(layer, 9, 2, device=DEVICE)
    expected = layer(x, topk_ids=ids, topk_weights=w)
    for name, view in strided_views(x).items():
        assert torch.equal(layer(view, topk_ids=ids, topk_weights=w), expected), name


@pytest.mark.parametrize("kernel_id,dtype,cell", [(k, d, c) for k, d in BATCHED_KERNELS
                                                  for c in _cells("triton.batched_moe")])
def test_batched_experts_take_a_strided_x_too(kernel_id, dtype, cell):
    w = make_random_weights(num_experts=8, hidden=128, intermediate=64, quant=quant_of(cell), in_dtype=dtype,
                            has_bias=False, seed=0, device=DEVICE)
    layer = build_layer(kernel_id=kernel_id, prepare_finalize_id="local_batched", quant=quant_of(cell),
                        activation=Activation.silu, in_dtype=dtype, activation_format="batched",
                        weights=w, device=DEVICE)
    x, ids, tw = random_inputs(layer, 9, 2, device=DEVICE)
    expected = layer(x, topk_ids=ids, topk_weights=tw)
    for name, view in strided_views(x).items():
        assert torch.equal(layer(view, topk_ids=ids, topk_weights=tw), expected), name


def test_the_triton_launcher_itself_copies_a_strided_input():
    """`fused_moe` is called directly by the tuner and benchmarks, behind no layer."""
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, H=128, I=64, device=DEVICE)
    x, ids, w = random_inputs(layer, 9, 2, device=DEVICE)
    kwargs = dict(a_scale=None, weights=layer.weights, topk_ids=ids, topk_weights=w,
                  activation=layer.experts.activation, quantize_intermediate=lambda t, _: (t, None),
                  out_dtype=x.dtype)
    expected = fused_moe(x, **kwargs)
    for name, view in strided_views(x).items():
        assert torch.equal(fused_moe(view, **kwargs), expected), name


@pytest.fixture(scope="module")
def layer():
    return make_layer("torch.reference", dtype=Dtype.fp32, E=4, H=32, I=16)


def _inputs(layer, M=3):
    return random_inputs(layer, M, 2)


@pytest.mark.parametrize("change,message", [
    (lambda x, ids, w: dict(x=x[:, :31]), r"x must be [tokens, 32], got (3, 31)"),
    (lambda x, ids, w: dict(x=x[None]), r"x must be [tokens, 32], got (1, 3, 32)"),
    (lambda x, ids, w: dict(x=x.double()), r"x is torch.float64, this layer computes in fp32; convert it with "
                                           r"x.to(torch.float32)"),
    (lambda x, ids, w: dict(x=x.tolist()), r"x must be a torch.Tensor, got list"),
    (lambda x, ids, w: dict(x=x.to("meta")), r"x is on meta, the layer's weights are on cpu; move it with .to()"),
    (lambda x, ids, w: dict(topk_ids=ids.to("meta")), r"topk_ids is on meta, the layer's weights are on cpu"),
    (lambda x, ids, w: dict(topk_ids=ids[:2], topk_weights=w[:2]),
     r"topk_ids (2, 2) and topk_weights (2, 2) must both be [num_tokens=3, top_k]"),
    (lambda x, ids, w: dict(topk_ids=w, topk_weights=ids), r"topk_ids must be an integer tensor, got torch.float32 "
                                                          r"(were topk_ids and topk_weights swapped?)"),
    (lambda x, ids, w: dict(topk_ids=ids + 4), r"topk_ids out of range: found ids in ["),
    (lambda x, ids, w: dict(topk_ids=None), r"forward needs router_logits, or both topk_ids and topk_weights"),
])
def test_every_breach_of_the_input_contract_is_a_typed_error_naming_the_argument(layer, change, message):
    x, ids, w = _inputs(layer)
    args = dict(x=x, topk_ids=ids, topk_weights=w)
    args.update(change(x, ids, w))
    with pytest.raises(KernelInputError, match="^" + re.escape(message)):
        layer(args.pop("x"), **args)


def test_router_logits_must_be_floating_on_the_layers_device(layer):
    layer.routing = None
    x, _, _ = _inputs(layer)
    with pytest.raises(KernelInputError, match=re.escape("router_logits must be [3, 4], got [3, 5]")):
        layer(x, router_logits=torch.zeros(3, 5))
    with pytest.raises(KernelInputError, match=re.escape("router_logits must be a floating tensor, got torch.int64")):
        layer(x, router_logits=torch.zeros(3, 4, dtype=torch.int64))


def test_weights_whose_last_dimension_is_strided_are_refused_naming_the_tensor():
    w = make_random_weights(num_experts=2, hidden=32, intermediate=16, quant=quant_of("unquantized"),
                            in_dtype=Dtype.fp32, has_bias=True, seed=0, device="cpu")
    transposed = w.w2.transpose(1, 2).contiguous().transpose(1, 2)   # [E, H, I] values, I not contiguous
    with pytest.raises(KernelInputError, match=re.escape(
            "MoEWeights.w2 (2, 32, 16) has strides (512, 1, 32): its last dimension must be contiguous (stride 1)")):
        MoEWeights(w13=w.w13, w2=transposed, scheme=w.scheme, in_dtype=w.in_dtype)
    with pytest.raises(KernelInputError, match=re.escape("MoEWeights.w2_bias is on meta, w13 on cpu")):
        MoEWeights(w13=w.w13, w2=w.w2, w2_bias=w.w2_bias.to("meta"), w13_bias=w.w13_bias, scheme=w.scheme,
                   in_dtype=w.in_dtype)


def test_kernel_input_errors_are_value_errors_and_moerules_errors():
    """Callers that caught ValueError before the contract keep working; the CLI's boundary catches it as ours."""
    from moerules.errors import MoeRulesError
    assert issubclass(KernelInputError, ValueError) and issubclass(KernelInputError, MoeRulesError)
