"""Each constraint named in the seed regressions is its own rule, and each test below
fails if that rule is deleted (the second half of every test builds that mutant)."""

from __future__ import annotations

import pytest

from moerules import decide
from moerules.config import All2AllBackend
from moerules.decision import ExpertPlacement, Outcome, QuantizedBy, ReasonCode, SelectedBy
from moerules.errors import BackendRejectedError, EngineError

from decision_helpers import config, cuda, rocm

MXFP4 = {"family": "mxfp4_w4a16"}
GPT_OSS_LIKE = dict(num_experts=32, top_k=4, activation="swigluoai", has_bias=True)


def mori_ep(**extra):
    return {"tp": 1, "dp": 2, "expert_parallel": True, "all2all_backend": "mori", **extra}


AITER_ON = {"rocm_use_aiter": "on"}   # vLLM 0.33 runs AITER's MXFP4 MoE only with VLLM_ROCM_USE_AITER=1


def test_ck_mxfp4_only_on_gfx950(rules_without):
    aligned = dict(GPT_OSS_LIKE, hidden_size=4096, moe_intermediate_size=4096)
    on_gfx950 = decide(config(aligned, quant=MXFP4, platform=rocm("gfx950", "aiter"), switches=AITER_ON))
    on_gfx942 = config(aligned, quant=MXFP4, platform=rocm("gfx942", "aiter"), switches=AITER_ON)
    assert on_gfx950.backend == "aiter"
    decision = decide(on_gfx942)
    assert decision.backend == "aiter_triton"   # AITER's Triton MXFP4 kernel also runs on gfx942
    [rejection] = [r for r in decision.rejections_of("aiter") if r.rule == "ck_mxfp4.gfx950_only"]
    assert rejection.reason == ReasonCode.arch_unsupported and rejection.source.file == "rules/30-quant.yaml"
    assert decide(on_gfx942, rules_without("ck_mxfp4.gfx950_only")).backend == "aiter"


def test_aiter_mxfp4_needs_the_aiter_switch(rules_without):
    cfg = config(dict(GPT_OSS_LIKE, hidden_size=4096, moe_intermediate_size=4096), quant=MXFP4,
                 platform=rocm("gfx950", "aiter"))
    decision = decide(cfg)
    assert decision.backend == "triton"     # neither AITER kernel without VLLM_ROCM_USE_AITER=1
    assert [r.rule for r in decision.rejections_of("aiter")] == ["aiter.mxfp4_enabled"]
    assert decide(cfg, rules_without("aiter.mxfp4_enabled")).backend == "aiter"


@pytest.mark.parametrize("hidden,intermediate,tp", [(2880, 2880, 1), (4096, 1536, 4)])
def test_ck_mxfp4_unaligned_shapes_are_padded_to_256(rules_without, hidden, intermediate, tp):
    # gpt-oss-20b hidden 2880; MiniMax-style TP=4 leaves 384 per partition: both crashed CK unpadded.
    # vLLM pads both to 256 on ROCm (oracle/mxfp4.py:880-910) instead of falling back.
    cfg = config(dict(GPT_OSS_LIKE, hidden_size=hidden, moe_intermediate_size=intermediate),
                 quant=MXFP4, platform=rocm("gfx950", "aiter"), parallel={"tp": tp}, switches=AITER_ON)
    decision = decide(cfg)
    assert decision.backend == "aiter"
    assert decision.padding.hidden_padded % 256 == 0 and decision.padding.intermediate_padded % 256 == 0
    assert decision.padding.hidden_pad < 256 and decision.padding.intermediate_pad < 256
    unpadded = decide(cfg, rules_without("rocm.mxfp4_round_up")).padding
    assert unpadded.hidden_pad == 0 and unpadded.intermediate_pad == 0


def test_padding_is_tp_aware(rules_without):
    # Marlin pads MXFP4 hidden to 256 and the *per-partition* intermediate to 128.
    shape = dict(GPT_OSS_LIKE, hidden_size=2880, moe_intermediate_size=2880)
    def pinned(tp, rules=None):
        cfg = config(shape, quant=MXFP4, platform=cuda("sm_90", "marlin"), parallel={"tp": tp},
                     features={"backend": "marlin"})
        return decide(cfg, rules).padding
    assert pinned(1).model_dump() == dict(hidden_pad=192, intermediate_pad=64, hidden_padded=3072,
                                          intermediate_padded=2944)
    assert pinned(4).model_dump() == dict(hidden_pad=192, intermediate_pad=48, hidden_padded=3072,
                                          intermediate_padded=768)
    assert pinned(4, rules_without("marlin.mxfp4_round_up")).intermediate_pad == 0


def test_lora_in_auto_mode_falls_back_to_a_lora_capable_backend(rules_without):
    # vLLM 0.33 serves BF16 LoRA on SM10x with its TRT-LLM LoRA experts (oracle/unquantized.py:234-244) ...
    lora = config(platform=cuda("sm_100", "flashinfer"), features={"lora": True})
    assert decide(lora).backend == "flashinfer_trtllm_lora"
    # ... but not for sigmoid routing (experts/trtllm_lora_moe.py:525-531), which the monolithic kernel takes
    cfg = config({"routing": "sigmoid"}, platform=cuda("sm_100", "flashinfer"), features={"lora": True})
    assert decide(config({"routing": "sigmoid"}, platform=cuda("sm_100", "flashinfer"))).backend == "flashinfer_trtllm"
    decision = decide(cfg)
    assert (decision.backend, decision.selected_by) == ("triton", SelectedBy.fallback)
    assert decision.fallback_rule == "lora.requires_capable_backend"
    assert decide(cfg, rules_without("lora.requires_capable_backend")).backend == "flashinfer_trtllm"


def test_lora_pin_is_never_replaced():
    cfg = config(platform=cuda("sm_100", "flashinfer"), features={"lora": True, "backend": "flashinfer_cutlass"})
    with pytest.raises(BackendRejectedError) as raised:
        decide(cfg)
    decision = raised.value.decision
    assert decision.outcome == Outcome.unsupported and decision.backend is None
    assert decision.failure_reason == ReasonCode.lora_unsupported
    assert "lora.requires_capable_backend" in str(raised.value)
    assert "Eligible alternatives: flashinfer_trtllm_lora, triton" in str(raised.value)


def test_lora_never_sees_quantized_activations(rules_without):
    fp8 = {"family": "fp8_w8a8", "weight_granularity": "channel"}
    cfg = config(quant=fp8, platform=cuda("sm_90", "marlin"), features={"lora": True})
    decision = decide(cfg)
    assert decision.backend == "marlin" and decision.quant.quantized_by == QuantizedBy.none
    assert decide(cfg, rules_without("lora.needs_unquantized_activations")).backend == "triton"


def test_aiter_expects_unquantized_inputs_unless_behind_mori(rules_without):
    fp8 = {"family": "fp8_w8a8", "weight_granularity": "channel"}
    packages = rocm("gfx942", "aiter", "mori")
    aiter_on = {"rocm_use_aiter": "on"}   # vLLM 0.33 runs AITER's FP8 experts only with VLLM_ROCM_USE_AITER=1
    behind_mori = config(quant=fp8, platform=packages, parallel=mori_ep(), switches=aiter_on)
    local = config(quant=fp8, platform=packages, switches=aiter_on)
    mori_decision, local_decision = decide(behind_mori), decide(local)
    assert (mori_decision.backend, mori_decision.prepare_finalize) == ("aiter", "mori")
    assert mori_decision.quant.expects_unquantized_inputs is False
    assert local_decision.quant.expects_unquantized_inputs is True
    assert local_decision.quant.quantized_by == QuantizedBy.experts
    mutant = decide(behind_mori, rules_without("aiter.prequantized_behind_mori"))
    assert mutant.quant.expects_unquantized_inputs is True  # the unconditional regression of vllm#37418


def test_mori_fp8_dispatch_quantizes_before_the_network_unless_experts_defer(rules_without):
    fp8 = {"family": "fp8_w8a8", "weight_granularity": "channel"}
    cfg = config(quant=fp8, platform=rocm("gfx942", "aiter", "mori"), parallel=mori_ep(),
                 switches={"rocm_use_aiter": "on"})
    quant = decide(cfg).quant
    assert (quant.quantized_by, quant.dispatch_dtype, quant.scale_dim, quant.scale_type_size) == (
        QuantizedBy.dispatcher, "fp8_e4m3", 1, 4)
    assert quant.defer_input_quant is False
    deferred = decide(cfg, rules_without("aiter.prequantized_behind_mori")).quant
    assert (deferred.quantized_by, deferred.dispatch_dtype, deferred.defer_input_quant) == (
        QuantizedBy.experts, "bf16", True)
    with pytest.raises(EngineError, match="no plan rule decides how activations reach aiter behind mori"):
        decide(cfg, rules_without("mori.fp8_dispatch_before_network"))


def test_unquantized_mori_dispatch_uses_the_input_dtype_and_no_scales(rules_without):
    # vLLM runs unquantised AITER only with VLLM_ROCM_USE_AITER=1 (experts/rocm_aiter_moe.py:512-514)
    cfg = config(platform=rocm("gfx942", "aiter", "mori"), parallel=mori_ep(), switches={"rocm_use_aiter": "on"})
    decision = decide(cfg)
    assert (decision.backend, decision.prepare_finalize) == ("aiter", "mori")
    assert (decision.quant.dispatch_dtype, decision.quant.scale_dim, decision.quant.scale_type_size) == ("bf16", 0, 0)
    assert "mori.unquantized_dispatch" in decision.quant.rules
    with pytest.raises(EngineError, match="no plan rule"):
        decide(cfg, rules_without("mori.unquantized_dispatch"))


EXPECTED_DISPATCHER = {
    All2AllBackend.allgather_reducescatter: "allgather_reducescatter",
    All2AllBackend.torch_all2all: "torch_all2all",
    All2AllBackend.torch_all2all_batched: "torch_all2all_batched",
    All2AllBackend.deepep_high_throughput: "deepep_ht",
    All2AllBackend.deepep_low_latency: "deepep_ll",
    All2AllBackend.mori: "mori",
    All2AllBackend.nixl_ep: "nixl_ep",
    All2AllBackend.flashinfer_nvlink: "flashinfer_nvlink",
    All2AllBackend.deepep_v2: "deepep_v2",
    All2AllBackend.moonep: "moonep_dispatch",
    All2AllBackend.flashinfer_nvlink_one_sided: "flashinfer_nvlink_one_sided",
}


@pytest.mark.parametrize("backend", list(All2AllBackend))
def test_ep_over_all2all_always_has_a_real_dispatcher(backend):
    everything = ["triton", "aiter", "mori", "deep_ep", "nixl_ep", "flashinfer", "moonep"]
    platform = rocm("gfx942", *everything) if backend == All2AllBackend.mori else cuda("sm_90", *everything)
    cfg = config(platform=platform, parallel={"dp": 2, "expert_parallel": True, "all2all_backend": backend})
    decision = decide(cfg)
    assert decision.prepare_finalize == EXPECTED_DISPATCHER[backend]


def test_batched_dispatch_places_experts_round_robin(rules_without):
    batched = config(platform=cuda("sm_90"), parallel={"dp": 2, "expert_parallel": True,
                                                       "all2all_backend": "torch_all2all_batched"})
    decision = decide(batched)
    assert (decision.backend, decision.prepare_finalize, decision.expert_placement) == (
        "batched_triton", "torch_all2all_batched", ExpertPlacement.round_robin)
    standard = config(platform=cuda("sm_90"), parallel={"dp": 2, "expert_parallel": True,
                                                        "all2all_backend": "torch_all2all"})
    assert decide(standard).expert_placement == ExpertPlacement.contiguous
    assert decide(batched, rules_without("placement.round_robin_for_batched")).expert_placement == \
        ExpertPlacement.contiguous


def test_a_lost_dispatch_rule_is_an_error_never_a_silent_local_run(rules_without):
    cfg = config(platform=rocm("gfx942", "aiter", "mori"), parallel=mori_ep())
    decision = decide(cfg, rules_without("dispatch.a2a.mori"))
    assert decision.outcome == Outcome.unsupported and decision.prepare_finalize is None
    assert decision.failure_reason == ReasonCode.no_dispatcher


def test_int8_w8a8_triton_needs_cc75(rules_without):
    int8 = {"family": "int8_w8a8"}
    old_gpu = config(quant=int8, platform=cuda("sm_70"))
    assert decide(config(quant=int8, platform=cuda("sm_75"))).backend == "triton"
    decision = decide(old_gpu)
    assert decision.outcome == Outcome.unsupported
    assert [r.rule for r in decision.rejections_of("triton")] == ["triton.int8_w8a8_cc75"]
    assert decide(old_gpu, rules_without("triton.int8_w8a8_cc75")).backend == "triton"


def test_batched_triton_has_no_int8(rules_without):
    cfg = config(quant={"family": "int8_w8a8"}, platform=cuda("sm_90", "deep_ep"),
                 parallel={"dp": 2, "expert_parallel": True, "all2all_backend": "deepep_low_latency"})
    decision = decide(cfg)
    assert decision.outcome == Outcome.unsupported
    assert [r.rule for r in decision.rejections_of("batched_triton")] == ["batched_triton.no_int8"]
    assert decide(cfg, rules_without("batched_triton.no_int8")).backend == "batched_triton"


def test_mxfp8_sets_the_weight_block_before_conversion(rules_without):
    cfg = config(quant={"family": "mxfp8"}, platform=cuda("sm_90"))
    assert decide(cfg).quant.weight_block == 32
    assert decide(cfg, rules_without("mxfp8.weight_block_32")).quant.weight_block == 0


def test_uneven_expert_split_is_refused_by_a_rule_not_only_at_build(rules_without):
    uneven = config(model={"num_experts": 9}, parallel={"tp": 2, "expert_parallel": True})
    decision = decide(uneven)
    assert decision.outcome == Outcome.unsupported
    assert {r.rule for r in decision.rejections_of("triton")} == {"ep.even_expert_split"}
    assert decide(uneven, rules_without("ep.even_expert_split")).backend == "triton"
    assert decide(config(parallel={"tp": 2, "expert_parallel": True})).backend == "triton"
