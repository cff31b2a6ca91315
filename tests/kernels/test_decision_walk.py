"""Nothing the default rules select on Hopper or on a CPU is unbuildable.

`decision_walk` decides presets x schemes x LoRA x packages x TP x pins (plus the non-gated
activations) with the real shapes; every distinct layer among those decisions is built here
with `moerules.build` on tiny weights of the same alignment class and run against the float64
reference. Decisions naming an external kernel must refuse to build with an error naming the
package, never run something else.

On a CPU the sm_90 walk runs the Triton kernels under the interpreter, in fp16 (the
interpreter's bf16 tl.dot is wrong), on one case per (kernel, scheme, gating, LoRA, padded):
the interpreter needs ~10-50 s per MX layer. On a GPU every case runs, in bf16 and fp16.
"""

from __future__ import annotations

import pytest
import torch

from moerules import build
from moerules.errors import KernelUnavailableError
from moerules.kernels import make_random_lora, make_random_weights
from moerules.kernels.routing import fused_topk
from moerules.kernels.scheme import TORCH_DTYPE

from decision_walk import BuildCase, build_cases, representatives, tiny_dims
from kernel_helpers import reference64, rel_err

HOPPER = {"vendor": "cuda", "arch": "sm_90"}
CPU = {"vendor": "cpu", "arch": "x86_64"}
ON_GPU = torch.cuda.is_available()
# Relative Frobenius error against float64 on the same quantised input: fp16/bf16 rounding of
# the output and intermediate (8e-3 bf16), plus re-quantisation of the intermediate where the
# scheme quantises activations (the reference re-quantises too, so only rounding differs; with
# 3 tokens and K ~ 128-200 one flipped fp8 rounding moves the norm by ~1e-2). A broken kernel is O(1).
TOLERANCE = {False: 1e-2, True: 5e-2}
TOKENS = 3


def _walks():
    walks = [("cpu", CPU, "bf16", "cpu"), ("cpu", CPU, "fp32", "cpu"), ("sm_90", HOPPER, "fp16", "cpu")]
    if ON_GPU:
        walks = [("sm_90", HOPPER, "bf16", "cuda"), ("sm_90", HOPPER, "fp16", "cuda")]
    return walks


WALKS = {f"{name}-{dtype}": (platform, dtype, device) for name, platform, dtype, device in _walks()}
CASES = {key: build_cases(platform, dtype) for key, (platform, dtype, _) in WALKS.items()}


def _params():
    for key, (ours, _) in CASES.items():
        interpreted = WALKS[key][0] == HOPPER and not ON_GPU
        for index, case in enumerate(representatives(ours) if interpreted else ours):
            yield pytest.param(key, case, id=f"{key}-{index}-{case}")


def tiny_layer(case: BuildCase, device: str):
    config = case.decision.config
    model = config.model
    experts, hidden, intermediate = tiny_dims(config)
    common = dict(num_experts=experts, hidden=hidden, intermediate=intermediate, in_dtype=model.in_dtype,
                  gated=model.activation.gated, device=device)
    weights = make_random_weights(quant=config.quant, has_bias=model.has_bias, seed=1, **common)
    if config.features.lora:
        weights.lora = make_random_lora(rank=8, seed=2, **common)
    return build(case.decision, weights, device=device)


@pytest.mark.parametrize("walk,case", list(_params()))
def test_every_selected_layer_builds_and_matches_the_reference(walk, case):
    _, _, device = WALKS[walk]
    layer = tiny_layer(case, device)
    assert layer.kernel_id == (case.decision.kernel or case.decision.adapter)
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(TOKENS, layer.hidden_size, generator=gen, device=device).to(TORCH_DTYPE[layer.weights.in_dtype])
    top_k = min(case.decision.config.model.top_k, layer.weights.num_experts)
    ids, w = fused_topk(torch.randn(TOKENS, layer.weights.num_experts, generator=gen, device=device), top_k=top_k,
                        renormalize=True)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert out.shape == (TOKENS, layer.hidden_size)
    quantized = case.decision.config.quant.activation_key is not None
    assert rel_err(out, reference64(layer, x, ids, w)) < TOLERANCE[quantized]


@pytest.mark.parametrize("walk", list(WALKS))
def test_external_kernels_refuse_to_build_naming_their_package(walk):
    _, external = CASES[walk]
    for decision in external:
        with pytest.raises(KernelUnavailableError, match=decision.external_package or "external"):
            build(decision, object())


def test_the_walks_reach_every_kernel_and_scheme_they_should():
    """Guards the walk itself: a config generator that silently shrank would pass everything above."""
    kernels = {c.decision.kernel for ours, _ in CASES.values() for c in ours}
    families = {c.decision.config.quant.family.value for ours, _ in CASES.values() for c in ours}
    activations = {c.decision.config.model.activation.value for ours, _ in CASES.values() for c in ours}
    assert {"triton.fused_moe", "torch.grouped_mm" if ON_GPU else "torch.reference"} <= kernels
    assert {"unquantized", "fp8_w8a8", "fp8_w8a16", "int8_w8a8", "int8_w8a16", "mxfp4_w4a16", "mxfp8"} <= families
    assert {"silu", "swigluoai", "relu2_no_mul", "silu_no_mul", "gelu_no_mul"} <= activations
    assert any(c.decision.config.features.lora for ours, _ in CASES.values() for c in ours)
    assert any(c.decision.padding.intermediate_pad for ours, _ in CASES.values() for c in ours)
