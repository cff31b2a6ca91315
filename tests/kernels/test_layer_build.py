"""build_layer's refusals, the keyword-only contract, quantise-once, padding and idempotent conversion."""

from __future__ import annotations

import inspect

import pytest
import torch
from kernel_helpers import DEVICE, TRITON_DTYPE, make_layer, quant_of, random_inputs, reference64, rel_err

from moerules.activation import Activation, Dtype
from moerules.kernels import KernelBuildError, RoutingConfig, build_layer, make_random_weights
from moerules.kernels.example import run_forward
from moerules.kernels.interfaces import Experts, PrepareFinalize
from moerules.kernels.prepare_finalize import LocalPrepareFinalize
from moerules.kernels.weights import pad_weights
from moerules.quant import QuantConfig, QuantFamily


def _weights(cell="unquantized", dtype=Dtype.bf16, **kw):
    return make_random_weights(num_experts=4, hidden=64, intermediate=32, quant=quant_of(cell), in_dtype=dtype,
                               has_bias=kw.pop("bias", False), seed=0, device="cpu")


def _build(**overrides):
    args = dict(kernel_id="torch.reference", prepare_finalize_id="local", quant=QuantConfig(),
                activation=Activation.silu, in_dtype=Dtype.bf16, activation_format="standard",
                weights=_weights(), device="cpu")
    args.update(overrides)
    return build_layer(**args)


@pytest.mark.parametrize("overrides,message", [
    (dict(kernel_id="cutlass.nope"), r"^cutlass\.nope: unknown kernel id; registered: .*torch\.grouped_mm"),
    (dict(prepare_finalize_id="deepep"), r"^torch\.reference: unknown prepare/finalize id 'deepep'"),
    (dict(activation_format="batched"), r"activation format 'batched' requested"),
    (dict(quant=QuantConfig(family=QuantFamily.nvfp4)), r"'nvfp4' has no kernel"),
    (dict(activation=Activation.relu2_no_mul), r"activation 'relu2_no_mul' needs w13 with I rows, but the weights "
                                               r"are gated"),
    (dict(kernel_id="torch.grouped_mm", quant=quant_of("int8_w8a8/channel/token"),
          weights=_weights("int8_w8a8/channel/token")), r"scheme 'int8_w8a8/channel/token' is not supported"),
    (dict(quant=quant_of("fp8_w8a8/channel/token")), r"weights are unquantized/bf16 but the layer asks for "
                                                     r"fp8_w8a8/channel/token"),
    (dict(device="meta"), r"weights are on cpu, the layer is for meta"),
])
def test_build_refusals_name_kernel_and_reason(overrides, message):
    with pytest.raises(KernelBuildError, match=message):
        _build(**overrides)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only refusals")
def test_build_refuses_what_this_cpu_cannot_run(monkeypatch):
    with pytest.raises(KernelBuildError, match="interpreter computes tl.dot wrongly for bf16"):
        _build(kernel_id="triton.fused_moe")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(KernelBuildError, match="TRITON_INTERPRET=1"):
        _build(kernel_id="triton.fused_moe", in_dtype=Dtype.fp16, weights=_weights(dtype=Dtype.fp16))
    with pytest.raises(KernelBuildError, match="_scaled_grouped_mm"):
        _build(kernel_id="torch.grouped_mm", quant=quant_of("fp8_w8a8/channel/token"),
               weights=_weights("fp8_w8a8/channel/token"))


def test_missing_triton_package_is_named(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_triton(name, *a, **kw):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton'")
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_triton)
    with pytest.raises(KernelBuildError, match=r"^triton\.fused_moe: package 'triton' is not importable.*pip install"):
        _build(kernel_id="triton.fused_moe", in_dtype=Dtype.fp16, weights=_weights(dtype=Dtype.fp16))


def test_interfaces_are_keyword_only():
    for fn in (Experts.apply, PrepareFinalize.prepare, PrepareFinalize.finalize, build_layer):
        params = list(inspect.signature(fn).parameters.values())
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert positional in ([], ["self"], ["self", "hidden_q"], ["self", "x"], ["self", "expert_out"]), positional
    layer = _build()
    x, ids, w = random_inputs(layer, 3, 2)
    with pytest.raises(TypeError):
        layer(x, None, ids, w)  # positional topk_ids/topk_weights
    with pytest.raises(TypeError):
        layer.experts.apply(x, layer.weights, ids, w, None)
    with pytest.raises(TypeError):
        layer.prepare_finalize.prepare(x, ids, w, False, None)


def test_swapped_topk_is_detected():
    layer = _build()
    x, ids, w = random_inputs(layer, 5, 2)
    with pytest.raises(ValueError, match="swapped"):
        layer(x, topk_ids=w, topk_weights=ids)
    # Same experts, weights swapped between the two slots: with asymmetric weights the output must change,
    # so an implementation that mixed up slot order (or ignored the weights) would be caught.
    w = torch.tensor([[0.9, 0.1]] * 5)
    assert not torch.allclose(layer(x, topk_ids=ids, topk_weights=w), layer(x, topk_ids=ids, topk_weights=w.flip(1)))


def test_topk_out_of_range_raises_before_any_kernel():
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, device=DEVICE)
    x, ids, w = random_inputs(layer, 4, 2, device=DEVICE)
    ids[2, 1] = layer.weights.num_experts
    with pytest.raises(ValueError, match="topk_ids out of range"):
        layer(x, topk_ids=ids, topk_weights=w)


def test_router_logits_path_matches_explicit_topk():
    layer = make_layer("torch.reference", dtype=Dtype.fp32, routing=RoutingConfig(top_k=2))
    x, _, _ = random_inputs(layer, 6, 2)
    logits = torch.randn(6, layer.weights.num_experts)
    ids, w = layer.route(logits)
    torch.testing.assert_close(layer(x, router_logits=logits), layer(x, topk_ids=ids, topk_weights=w))
    with pytest.raises(ValueError, match="not both"):
        layer(x, router_logits=logits, topk_ids=ids, topk_weights=w)


@pytest.mark.parametrize("cell", ["fp8_w8a8/channel/token", "fp8_w8a8/tensor/tensor-static"])
def test_activations_quantised_exactly_once(cell, monkeypatch):
    """Local dispatcher quantises, experts must not; a deferring dispatcher flips both, same result."""
    from moerules.kernels import interfaces, prepare_finalize, reference
    calls = []
    for mod in (interfaces, prepare_finalize, reference):
        real = mod.quantize_activation
        monkeypatch.setattr(mod, "quantize_activation",
                            lambda x, _real=real, _m=mod.__name__, **kw: calls.append(_m) or _real(x, **kw))
    results = {}
    for defer in (False, True):
        layer = make_layer("torch.reference", cell, dtype=Dtype.bf16, defer_input_quant=defer)
        assert layer.experts.expects_unquantized_inputs is defer
        x, ids, w = random_inputs(layer, 5, 2)
        calls.clear()
        results[defer] = layer(x, topk_ids=ids, topk_weights=w)
        # input: once, by the dispatcher or by the experts; intermediate: once, inside the reference experts
        expected_input_quant = "moerules.kernels.interfaces" if defer else "moerules.kernels.prepare_finalize"
        assert calls == [expected_input_quant, "moerules.kernels.reference"]
    torch.testing.assert_close(results[False], results[True])


def test_expects_unquantized_inputs_depends_on_dispatcher():
    layer = make_layer("torch.reference", "fp8_w8a8/channel/token", dtype=Dtype.bf16)
    experts = layer.experts
    assert experts.expects_unquantized_inputs is False
    experts.bind(LocalPrepareFinalize(scheme=experts.scheme, quantizes_inputs=False))
    assert experts.expects_unquantized_inputs is True
    bf16 = make_layer("torch.reference", dtype=Dtype.bf16)
    bf16.experts.bind(LocalPrepareFinalize(scheme=bf16.experts.scheme, quantizes_inputs=False))
    assert bf16.experts.expects_unquantized_inputs is False  # nothing to quantise


def test_padding_is_exact_and_idempotent():
    for cell, act in (("unquantized", Activation.silu), ("fp8_w8a16/channel", Activation.swigluoai)):
        plain = make_layer("torch.reference", cell, dtype=Dtype.fp32 if cell == "unquantized" else Dtype.bf16,
                           activation=act, bias=True)
        w = plain.weights
        padded_weights = make_random_weights(num_experts=8, hidden=160, intermediate=96, quant=quant_of(cell),
                                             in_dtype=w.in_dtype, has_bias=True, seed=0, device="cpu")
        padded = build_layer(kernel_id="torch.reference", prepare_finalize_id="local", quant=quant_of(cell),
                             activation=act, in_dtype=w.in_dtype, activation_format="standard",
                             weights=padded_weights, device="cpu", hidden_pad=32, intermediate_pad=16)
        assert padded_weights.w13.shape[1:] == (2 * 112, 192) and padded_weights.padding == (32, 16)
        snapshot = {k: v.clone() for k, v in vars(padded_weights).items() if isinstance(v, torch.Tensor)}
        # Building again on the same object (as a second decision would) must not pad twice.
        again = build_layer(kernel_id="torch.reference", prepare_finalize_id="local", quant=quant_of(cell),
                            activation=act, in_dtype=w.in_dtype, activation_format="standard",
                            weights=padded_weights, device="cpu", hidden_pad=32, intermediate_pad=16)
        pad_weights(padded_weights, hidden_pad=32, intermediate_pad=16, interleaved=act == Activation.swigluoai)
        for k, v in snapshot.items():
            assert torch.equal(getattr(padded_weights, k), v), k
        with pytest.raises(ValueError, match="already padded"):
            pad_weights(padded_weights, hidden_pad=0, intermediate_pad=16, interleaved=False)
        x, ids, tw = random_inputs(plain, 7, 2)
        ref = plain(x, topk_ids=ids, topk_weights=tw)
        for layer in (padded, again):
            out = layer(x, topk_ids=ids, topk_weights=tw)
            assert out.shape == ref.shape
            assert rel_err(out, ref.double()) < 1e-6


def test_triton_with_padding_matches_reference(poison_empty):
    layer = make_layer("triton.fused_moe", "fp8_w8a8/channel/token", dtype=TRITON_DTYPE, device=DEVICE,
                       hidden_pad=16, intermediate_pad=32)
    x, ids, w = random_inputs(layer, 9, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < 1e-2


def test_run_forward_reports_small_error():
    layer = make_layer("triton.fused_moe", "fp8_w8a8/block128/group128", dtype=TRITON_DTYPE, device=DEVICE,
                       H=256, I=128, routing=RoutingConfig(top_k=2))
    r = run_forward(layer, num_tokens=6, seed=3, device=DEVICE)
    assert r["kernel_id"] == "triton.fused_moe" and r["all_finite"]
    assert r["rel_err_vs_reference"] < 1e-2
    assert r == run_forward(layer, num_tokens=6, seed=3, device=DEVICE)  # seeded: the same summary again


@pytest.mark.parametrize("intermediate,pad", [(96, 32), (128, 64)])
def test_block128_halves_padding_keeps_scale_blocks(intermediate, pad):
    """Padding moves the up half from row I to I + pad; both must sit on 128-row scale blocks."""
    w = make_random_weights(num_experts=2, hidden=64, intermediate=intermediate, quant=quant_of("fp8_w8a16/block128"),
                            in_dtype=Dtype.bf16, has_bias=False, seed=0, device="cpu")
    with pytest.raises(KernelBuildError, match=rf"^torch\.reference: block128 weights with intermediate {intermediate} "
                                               rf"cannot be padded by {pad}: the up half would move from row "
                                               rf"{intermediate} to row {intermediate + pad} and straddle a 128-row "
                                               r"scale block \(both must be multiples of 128\)$"):
        build_layer(kernel_id="torch.reference", prepare_finalize_id="local", quant=quant_of("fp8_w8a16/block128"),
                    activation=Activation.silu, in_dtype=Dtype.bf16, activation_format="standard", weights=w,
                    device="cpu", intermediate_pad=pad, weight_block=128)


def test_block128_halves_padding_by_whole_blocks_is_exact():
    kw = dict(activation=Activation.silu, dtype=Dtype.bf16, E=4, H=64, I=128)
    plain = make_layer("torch.reference", "fp8_w8a16/block128", **kw)
    padded = make_layer("torch.reference", "fp8_w8a16/block128", **kw, intermediate_pad=128)
    assert padded.weights.w13_scale.shape == (4, 4, 1)  # gate block, its pad block, up block, its pad block
    x, ids, tw = random_inputs(plain, 7, 2)
    assert rel_err(padded(x, topk_ids=ids, topk_weights=tw), plain(x, topk_ids=ids, topk_weights=tw).double()) < 1e-6
