"""`build(decision, weights)`: the decided layer runs, or fails saying which kernel and why."""

from __future__ import annotations

import pytest
import torch

from moerules import build, decide
from moerules.activation import SwigluParams
from moerules.errors import KernelUnavailableError
from moerules.kernels import make_random_lora, make_random_weights
from moerules.kernels.example import run_forward
from moerules.kernels.builder import routing_for
from moerules.kernels.routing import fused_topk, grouped_topk
from moerules.tools.cli.run import run_example

from decision_helpers import config, cuda, rocm

CPU = {"vendor": "cpu", "arch": "x86_64", "packages": []}
SMALL = dict(num_experts=4, top_k=2, hidden_size=64, moe_intermediate_size=96, in_dtype="fp32")


def weights_for(decision, seed=0):
    c = decision.config
    return make_random_weights(num_experts=c.model.num_experts, hidden=c.model.hidden_size,
                               intermediate=c.intermediate_per_partition, quant=c.quant, in_dtype=c.model.in_dtype,
                               has_bias=c.model.has_bias, seed=seed, device="cpu")


@pytest.mark.parametrize("quant", [{"family": "unquantized"}, {"family": "fp8_w8a8", "weight_granularity": "channel"},
                                   {"family": "int8_w8a8"}])
def test_the_cpu_decision_builds_and_matches_the_reference(quant):
    decision = decide(config(SMALL, quant=quant, platform=CPU))
    assert (decision.backend, decision.kernel, decision.prepare_finalize_kernel) == (
        "torch_reference", "torch.reference", "local")
    layer = build(decision, weights_for(decision))
    report = run_forward(layer, num_tokens=5, seed=1, device="cpu", top_k=2)
    assert report["all_finite"] and report["rel_err_vs_reference"] < 1e-6


def test_the_experts_agree_with_the_rules_on_expects_unquantized_inputs():
    decision = decide(config(SMALL, quant={"family": "fp8_w8a8", "weight_granularity": "channel"}, platform=CPU))
    layer = build(decision, weights_for(decision))
    assert layer.experts.expects_unquantized_inputs == decision.quant.expects_unquantized_inputs


def test_an_external_backend_is_named_and_never_replaced():
    decision = decide(config(SMALL, platform=rocm("gfx942", "aiter"), switches={"rocm_use_aiter": "on"}))
    assert decision.backend == "aiter" and decision.kernel is None
    with pytest.raises(KernelUnavailableError, match="experts backend 'aiter' is an external kernel from package "
                                                     "'aiter'.*pin one of our backends.*triton"):
        build(decision, weights_for(decision))


def test_a_gpu_decision_on_a_cpu_says_how_to_run_it():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    # Under the interpreter (tests set TRITON_INTERPRET on CPUs) bf16 is refused with the reason.
    decision = decide(config(dict(SMALL, in_dtype="bf16"), platform=cuda("sm_90")))
    with pytest.raises(KernelUnavailableError, match="cannot build triton behind local: triton.fused_moe: "
                                                     "the Triton interpreter computes tl.dot wrongly for bf16"):
        build(decision, weights_for(decision), device="cpu")


def test_run_example_reports_checksum_and_error():
    report = run_example(decide(config(SMALL, platform=CPU)), num_tokens=3, seed=0, device="cpu")
    assert report["kernel_id"] == "torch.reference" and report["num_tokens"] == 3
    assert report["checksum"] != 0 and report["rel_err_vs_reference"] < 1e-6


def _lora(decision, rank=4):
    c = decision.config
    return make_random_lora(num_experts=c.model.num_experts, hidden=c.model.hidden_size,
                            intermediate=c.intermediate_per_partition, rank=rank, in_dtype=c.model.in_dtype, seed=7,
                            device="cpu")


def test_lora_weights_need_a_decision_made_for_lora():
    decision = decide(config(SMALL, platform=CPU))
    weights = weights_for(decision)
    weights.lora = _lora(decision)
    with pytest.raises(KernelUnavailableError) as info:
        build(decision, weights)
    assert str(info.value) == ("the weights carry LoRA adapters but the decision was made without features.lora, so "
                               "its backend 'torch_reference' was not chosen to apply them; decide again with "
                               "features.lora=true")


def test_a_lora_decision_builds_without_adapters_and_takes_them_later():
    decision = decide(config(SMALL, platform=CPU, features={"lora": True}))
    layer = build(decision, weights_for(decision))
    base = run_forward(layer, num_tokens=5, seed=1, device="cpu")
    layer.set_lora(_lora(decision))
    with_lora = run_forward(layer, num_tokens=5, seed=1, device="cpu")
    assert with_lora["lora_rank"] == 4 and with_lora["rel_err_vs_reference"] < 1e-6
    assert with_lora["checksum"] != base["checksum"]


def test_run_example_with_lora_runs_adapters():
    report = run_example(decide(config(SMALL, platform=CPU, features={"lora": True})), num_tokens=3, seed=0,
                         device="cpu")
    assert report["lora_rank"] == 8 and report["rel_err_vs_reference"] < 1e-6


GROUPED = dict(SMALL, num_experts=8, top_k=3, routing_groups=4, routing_topk_groups=2, routed_scaling_factor=2.5)


def test_grouped_biased_routing_is_built_from_the_decision_and_the_weights_bias():
    decision = decide(config(dict(GROUPED, routing="deepseek_v3"), platform=CPU))
    weights = make_random_weights(num_experts=8, hidden=64, intermediate=96, quant=decision.config.quant,
                                  in_dtype=decision.config.model.in_dtype, has_bias=False, seed=0, device="cpu",
                                  correction_bias=True)
    layer = build(decision, weights)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    ids, w = layer.route(logits)
    expected_ids, expected_w = grouped_topk(logits, top_k=3, num_expert_group=4, topk_group=2, renormalize=True,
                                            e_score_correction_bias=weights.correction_bias, routed_scaling_factor=2.5)
    assert torch.equal(ids, expected_ids) and torch.equal(w, expected_w)
    torch.testing.assert_close(w.sum(-1), torch.full((6,), 2.5))


def test_grouped_softmax_routing_ranks_groups_by_their_best_expert():
    """DeepSeek-V2's group_limited_greedy: softmax scores, no bias, a group counts by its best expert."""
    decision = decide(config(dict(GROUPED, routing="softmax"), platform=CPU))
    layer = build(decision, weights_for(decision))
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))
    ids, w = layer.route(logits)
    scores = torch.softmax(logits, -1)
    for t in range(6):
        groups = scores[t].view(4, 2).max(-1).values.topk(2).indices
        allowed = torch.cat([torch.arange(2 * g, 2 * g + 2) for g in groups.tolist()])
        assert set(ids[t].tolist()) == set(allowed[scores[t, allowed].topk(3).indices].tolist())
    torch.testing.assert_close(w, 2.5 * scores.gather(1, ids.long()))


def test_biased_routing_without_the_bias_is_refused_by_name():
    """The layer still runs given top-k (the caller routes); router logits alone it refuses, naming the bias."""
    decision = decide(config(dict(GROUPED, routing="deepseek_v3"), platform=CPU))
    layer = build(decision, weights_for(decision))
    x = torch.randn(5, 64)
    with pytest.raises(ValueError, match=r"^model.routing='deepseek_v3' needs the router's correction bias "
                                         r"\(e_score_correction_bias\).*; or pass topk_ids= and topk_weights=$"):
        layer(x, router_logits=torch.randn(5, 8))
    ids, w = fused_topk(torch.randn(5, 8), top_k=3, renormalize=True)
    assert layer(x, topk_ids=ids, topk_weights=w).shape == (5, 64)
    with pytest.raises(KernelUnavailableError, match="needs the router's correction bias"):
        routing_for(decision)


def test_the_configs_swiglu_parameters_reach_the_built_experts():
    decision = decide(config(dict(SMALL, activation="swigluoai", swiglu_limit=5.0, swiglu_alpha=1.5), platform=CPU))
    layer = build(decision, make_random_weights(num_experts=4, hidden=64, intermediate=96, quant=decision.config.quant,
                                                in_dtype=decision.config.model.in_dtype, has_bias=False, seed=0,
                                                device="cpu"))
    assert layer.experts.swiglu == SwigluParams(limit=5.0, alpha=1.5)
    assert "model.swiglu_limit" not in decision.config.facts()   # kernel math, not a rule fact


def test_shared_experts_run_in_the_layer_or_the_build_is_refused_by_name():
    decision = decide(config(dict(SMALL, shared_experts=1, shared_intermediate_size=32), platform=CPU))
    with pytest.raises(KernelUnavailableError, match=r"model.shared_experts=1 \(shared_intermediate_size=32\): moerules "
                                                     r"layers compute the routed experts; pass shared_experts="):
        build(decision, weights_for(decision))
    shared = torch.nn.Linear(64, 64, bias=False)
    layer = build(decision, weights_for(decision), shared_experts=shared)
    x = torch.randn(5, 64)
    ids = torch.tensor([[0, 1]] * 5, dtype=torch.int32)
    w = torch.full((5, 2), 0.5)
    routed = build(decide(config(SMALL, platform=CPU)), weights_for(decision))(x, topk_ids=ids, topk_weights=w)
    torch.testing.assert_close(layer(x, topk_ids=ids, topk_weights=w), routed + shared(x))
