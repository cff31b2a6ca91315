"""External kernels through adapters: `oai_triton` -> adapter `oai.triton_kernels` -> OpenAI triton_kernels.

On CPUs (and CI): the layout conversion into triton_kernels' matmul_ogs layout and back, and every refusal
(no package, a rule file that misuses `adapter:`). On a GPU with triton_kernels importable (see
bench/results/external/README.md for how the device run carries it): numerics against our float64
reference at gpt-oss shapes, and the round trip through the package's own Hopper swizzle.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moerules import build, decide, load_rules
from moerules.activation import Activation, Dtype
from moerules.config import MoEConfig
from moerules.errors import KernelUnavailableError, RuleSetError
from moerules.kernels import KernelBuildError, build_layer, make_random_weights
from moerules.kernels.external.oai_layout import SCALE_GROUP_MULTIPLE, from_oai_layout, to_oai_layout
from moerules.kernels.scheme import quant_for_cell as quant_of
from moerules.presets import PRESETS

from kernel_helpers import random_inputs, reference64, rel_err

MXFP4 = "mxfp4_w4a16/group32"
HAS_PACKAGE = importlib.util.find_spec("triton_kernels") is not None
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_package_gpu = pytest.mark.skipif(not (HAS_PACKAGE and ON_HOPPER), reason="needs triton_kernels and an sm90 GPU")


def mx_weights(*, E=4, H=160, I=96, bias=True, device="cpu", seed=0):
    return make_random_weights(num_experts=E, hidden=H, intermediate=I, quant=quant_of(MXFP4), in_dtype=Dtype.bf16,
                               has_bias=bias, seed=seed, device=device)


def gpt_oss_decision(preset="gpt-oss-20b", family="mxfp4_w4a16"):
    return decide(MoEConfig(model={**PRESETS[preset]["model"], "in_dtype": "bf16"}, quant={"family": family},
                            platform={"vendor": "cuda", "arch": "sm_90", "packages": ["triton", "triton_kernels"]}))


# ---- layout (CPU) ------------------------------------------------------------------------------
def test_the_layout_is_k_major_with_padded_scale_groups_and_fp32_biases():
    w = mx_weights()                      # H=160: 5 scale groups for w13 (padded to 8), I=96: 3 for w2 (to 4)
    oai = to_oai_layout(w)
    assert oai.w13.shape == (4, 80, 192) and oai.w2.shape == (4, 48, 160)
    assert oai.w13.stride(1) == 1 and oai.w2.stride(1) == 1     # K packed along the stride-1 axis
    assert torch.equal(oai.w13[2, 17, 101], w.w13[2, 101, 17]) and torch.equal(oai.w2[3, 5, 7], w.w2[3, 7, 5])
    assert oai.w13_scale.shape == (4, 8, 192) and oai.w2_scale.shape == (4, 4, 160)
    assert SCALE_GROUP_MULTIPLE == 4 and not oai.w13_scale[:, 5:].any() and not oai.w2_scale[:, 3:].any()
    assert torch.equal(oai.w13_scale[1, 4, 9], w.w13_scale[1, 9, 4])
    assert oai.w13_bias.dtype == torch.float32 and torch.equal(oai.w13_bias, w.w13_bias.float())


@pytest.mark.parametrize("bias", [True, False])
def test_the_layout_round_trips_exactly(bias):
    w = mx_weights(bias=bias, H=256, I=64)
    back = from_oai_layout(to_oai_layout(w), torch.bfloat16)
    for name, value in back.items():
        ours = getattr(w, name)
        assert (value is None) == (ours is None) and (value is None or torch.equal(value, ours)), name


def test_the_layout_refuses_weights_that_are_not_packed_mxfp4():
    w = make_random_weights(num_experts=2, hidden=64, intermediate=32, quant=quant_of("mxfp8/group32/group32"),
                            in_dtype=Dtype.bf16, has_bias=False, seed=0, device="cpu")
    with pytest.raises(ValueError, match=r"^triton_kernels' MXFP4 MoE takes packed e2m1 weights with e8m0 scales, "
                                         r"not mxfp8/group32/group32$"):
        to_oai_layout(w)


# ---- decisions and refusals (CPU) ----------------------------------------------------------------
def test_the_rules_name_the_adapter_of_oai_triton_and_none_for_our_kernels():
    decision = gpt_oss_decision()
    assert (decision.backend, decision.kernel, decision.external_package, decision.adapter) == (
        "oai_triton", None, "triton_kernels", "oai.triton_kernels")
    ours = decide(decision.config.model_copy(update={"features": decision.config.features.model_copy(
        update={"backend": "triton"})}))
    assert (ours.kernel, ours.adapter) == ("triton.fused_moe", None)


def test_without_the_package_build_names_it_and_how_to_install_it(monkeypatch):
    # Absent here whatever is installed: vLLM registers its vendored copy as `triton_kernels` once imported.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "triton_kernels" else find_spec(name, *args))
    with pytest.raises(KernelUnavailableError, match=r"^experts backend 'oai_triton' runs through adapter "
                                                     r"'oai\.triton_kernels': package 'triton_kernels' is not "
                                                     r"installed; pip install sglang-kernel==0\.4\.5 .*; or pin one "
                                                     r"of our backends \(features\.backend\), e\.g\. triton"):
        build(gpt_oss_decision(), object())
    with pytest.raises(KernelBuildError, match=r"^oai\.triton_kernels: package 'triton_kernels' is not installed"):
        build_layer(kernel_id="oai.triton_kernels", prepare_finalize_id="local", quant=quant_of(MXFP4),
                    activation=Activation.swigluoai, in_dtype=Dtype.bf16, activation_format="standard",
                    weights=mx_weights(), device="cpu")


def test_an_adapter_without_an_external_package_is_a_load_error(tmp_path):
    (tmp_path / "10-components.yaml").write_text(
        "version: 1\nbackends:\n  - id: mine\n    kernel: triton.fused_moe\n    adapter: oai.triton_kernels\n")
    with pytest.raises(RuleSetError) as raised:
        load_rules(tmp_path)
    [error] = raised.value.errors
    assert error.line == 3 and error.message.endswith(
        "'adapter' runs an external package: give it together with 'external', not 'kernel'")


# ---- the package on a GPU ------------------------------------------------------------------------
@needs_package_gpu
@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_oai_triton_decisions_run_through_triton_kernels_and_match_the_reference(preset, poison_empty):
    decision = gpt_oss_decision(preset)
    m = decision.config.model
    weights = make_random_weights(num_experts=m.num_experts, hidden=m.hidden_size, intermediate=m.moe_intermediate_size,
                                  quant=decision.config.quant, in_dtype=Dtype.bf16, has_bias=True, seed=0,
                                  device="cuda")
    layer = build(decision, weights)
    assert layer.kernel_id == "oai.triton_kernels"
    for tokens in (1, 333):
        x, ids, tw = random_inputs(layer, tokens, m.top_k, device="cuda", seed=tokens)
        x = x * 4  # GEMM1 outputs past the swiglu limit (7): the clamps are exercised
        assert rel_err(layer(x, topk_ids=ids, topk_weights=tw), reference64(layer, x, ids, tw)) < 1e-2


@needs_package_gpu
def test_the_hopper_swizzle_round_trips_to_our_weights():
    w = mx_weights(E=4, H=2880, I=2880, device="cuda")
    originals = {name: getattr(w, name).clone() for name in ("w13", "w13_scale", "w2", "w2_scale")}
    layer = build_layer(kernel_id="oai.triton_kernels", prepare_finalize_id="local", quant=quant_of(MXFP4),
                        activation=Activation.swigluoai, in_dtype=Dtype.bf16, activation_format="standard",
                        weights=w, device="cuda", weight_block=32)
    back = layer.experts.converted_back(torch.bfloat16)
    for name, value in originals.items():
        assert torch.equal(back[name], value), name
    assert torch.equal(back["w13_bias"], w.w13_bias)


@needs_package_gpu
def test_the_adapter_refuses_weights_it_was_not_loaded_with():
    layer = build_layer(kernel_id="oai.triton_kernels", prepare_finalize_id="local", quant=quant_of(MXFP4),
                        activation=Activation.swigluoai, in_dtype=Dtype.bf16, activation_format="standard",
                        weights=mx_weights(device="cuda", H=256, I=128), device="cuda", weight_block=32)
    x, ids, tw = random_inputs(layer, 8, 2, device="cuda")
    with pytest.raises(ValueError, match="loaded with other weights"):
        layer.experts.apply(x, weights=mx_weights(device="cuda", H=256, I=128, seed=1), topk_ids=ids,
                            topk_weights=tw, a_scale=None)


def test_an_adapter_refuses_schemes_it_has_no_weights_for_before_any_weights_exist(monkeypatch):
    from moerules.kernels import registry
    monkeypatch.setattr(registry, "package_refusal", lambda adapter_id: None)   # as if triton_kernels were installed
    decision = gpt_oss_decision(family="mxfp4_w4a4")
    assert (decision.backend, decision.adapter) == ("oai_triton", "oai.triton_kernels")
    with pytest.raises(KernelUnavailableError, match=r"^experts backend 'oai_triton' runs through adapter "
                                                     r"'oai\.triton_kernels': quant family 'mxfp4_w4a4' has no kernel "
                                                     r"in moerules\.kernels yet"):
        build(decision, object())
    assert registry.adapter_refusal("oai.triton_kernels", quant_of("mxfp8/group32/group32")) == (
        "it runs mxfp4_w4a16/group32, not mxfp8/group32/group32")
