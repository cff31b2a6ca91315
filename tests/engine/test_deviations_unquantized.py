"""Named deviations from vLLM 0.33 for unquantised MoE: our exact decision on a concrete config and,
where vLLM is importable, that vLLM's own select_unquantized_moe_backend decides otherwise as described
in the responsible rule's `deviation:`."""

from __future__ import annotations

import pytest

from moerules import decide
from moerules.config import MoEConfig
from moerules.decision import Outcome
from moerules.errors import BackendRejectedError
from moerules.engine.loader import load_rules
from moerules.resources import default_rules_dir

CUDA_VLLM = ["triton", "vllm", "marlin", "vllm_cutlass"]
ROCM_VLLM = ["triton", "vllm"]
CPU_VLLM = ["vllm", "vllm_cpu"]
MODEL = dict(num_experts=64, top_k=4, hidden_size=4096, moe_intermediate_size=1536)
DEEPEP_LL = dict(tp=1, dp=2, expert_parallel=True, all2all_backend="deepep_low_latency")
FI_NVLINK = dict(tp=1, dp=2, expert_parallel=True, all2all_backend="flashinfer_nvlink")


def cfg(vendor="cuda", arch="sm_90", packages=CUDA_VLLM, model=None, **sections) -> MoEConfig:
    return MoEConfig(model={**MODEL, **(model or {})}, platform=dict(vendor=vendor, arch=arch, packages=packages),
                     **sections)


def ours(config: MoEConfig):
    """Our backend id, or None where we refuse (auto) or reject the pin."""
    try:
        decision = decide(config)
    except BackendRejectedError:
        return None
    return decision.backend if decision.outcome == Outcome.selected else None


@pytest.fixture(scope="module")
def vllm():
    """(experts class, error) of vLLM 0.33's own selection for a config."""
    pytest.importorskip("vllm")
    from moerules.tools.vllm_oracle import VllmOracle

    oracle, backends = VllmOracle(), load_rules(default_rules_dir()).backends

    def select(config: MoEConfig):
        pin = config.features.backend
        answer = oracle.select(config, "auto" if pin == "auto" else backends[pin].item.vllm_backend)
        return answer.experts, answer.error
    return select


def rule(rule_id: str):
    item = load_rules(default_rules_dir()).rule(rule_id).item
    assert item.deviation, f"{rule_id} carries no deviation"
    return item


# (rule that carries the deviation, config, our backend or None, vLLM's experts class or None (it raises))
CASES = [
    ("triton.lora_unchecked_format", cfg(parallel=DEEPEP_LL, features=dict(lora=True),
                                         packages=CUDA_VLLM + ["deep_ep"]), None, "TritonExperts"),
    ("triton.lora_unchecked_vendor", cfg("cpu", "x86_64", CPU_VLLM, features=dict(lora=True)),
     "torch_reference", "TritonExperts"),
    ("triton.lora_unchecked_fi_nvlink", cfg(arch="sm_100", parallel=FI_NVLINK, features=dict(lora=True),
                                            packages=CUDA_VLLM + ["flashinfer"]), None, "TritonExperts"),
    ("batched_triton.bf16_needs_batched_dispatcher", cfg(features=dict(backend="batched_triton")),
     None, "BatchedTritonExperts"),
    ("batched_triton.gated_activations", cfg(model=dict(activation="silu_no_mul"), parallel=DEEPEP_LL,
                                             packages=CUDA_VLLM + ["deep_ep"]), None, "BatchedTritonExperts"),
    ("flashinfer_cutlass.bf16_drops_bias", cfg(arch="sm_120", model=dict(has_bias=True),
                                               packages=CUDA_VLLM + ["flashinfer"]), "triton", "FlashInferExperts"),
    ("flashinfer_cutlass.intermediate_align_128", cfg(arch="sm_120", model=dict(moe_intermediate_size=1504),
                                                       packages=CUDA_VLLM + ["flashinfer"]),
     "triton", "FlashInferExperts"),
    ("bias.never_dropped", cfg(arch="sm_100", model=dict(has_bias=True), packages=CUDA_VLLM + ["flashinfer"]),
     "triton", "TrtLlmBf16ExpertsMonolithic"),
    ("aiter.bias_only_mxfp4_w4a16", cfg("rocm", "gfx942", ROCM_VLLM + ["aiter"], model=dict(has_bias=True),
                                        switches=dict(rocm_use_aiter="on")), "triton", "AiterUnquantizedExperts"),
    ("ours.half_precision", cfg(arch="sm_80", model=dict(in_dtype="fp32")), None, "TritonExperts"),
    ("ep.even_expert_split", cfg(model=dict(num_experts=6, top_k=2), parallel=dict(tp=4, expert_parallel=True)),
     None, "TritonExperts"),
    ("cpu.order", cfg("cpu", "x86_64", CPU_VLLM, features=dict(batch_invariant=True)),
     "torch_reference", None),
    ("demote.unquantized.ours_last", cfg(arch="sm_110", model=dict(num_experts=4096, top_k=8)),
     "torch_grouped_mm", None),
]


@pytest.mark.parametrize("rule_id, config, expected, _", CASES, ids=[case[0] for case in CASES])
def test_our_decision_on_a_named_deviation(rule_id, config, expected, _):
    rule(rule_id)
    assert ours(config) == expected


@pytest.mark.parametrize("rule_id, config, expected, theirs", CASES, ids=[case[0] for case in CASES])
def test_vllm_decides_otherwise(vllm, rule_id, config, expected, theirs):
    experts, error = vllm(config)
    assert experts == theirs, error
    if theirs is None:
        assert error
