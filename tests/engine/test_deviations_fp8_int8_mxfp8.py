"""Named deviations from vLLM 0.33 for FP8, INT8 and MXFP8 layers (rules/32-fp8-int8-mxfp8.yaml and the
shared rules that carry `deviation:` for these schemes).

Each case pins our exact decision on one concrete config and, where vLLM 0.33 is importable, that vLLM's
own selection differs as the rule's `deviation:` text says.
"""

from __future__ import annotations

from typing import Optional

import pytest

from moerules import decide, load_rules
from moerules.config import MoEConfig
from moerules.decision import Outcome

CUDA_VLLM = ["triton", "vllm", "marlin", "vllm_cutlass", "deep_gemm", "flashinfer", "humming", "triton_kernels"]
ROCM_VLLM = ["triton", "vllm", "aiter"]
CPU_VLLM = ["vllm", "vllm_cpu"]
LAYER = dict(num_experts=16, top_k=2, hidden_size=4096, moe_intermediate_size=4096)


def _config(vendor: str, arch: str, packages: list[str], quant: dict, model: Optional[dict] = None,
            lora: bool = False) -> MoEConfig:
    return MoEConfig(model={**LAYER, **(model or {})}, quant=quant,
                     platform={"vendor": vendor, "arch": arch, "packages": packages}, features={"lora": lora})


# (case id, config, our backend or None for unsupported, the rule that names the deviation,
#  vLLM's experts class or None where vLLM selects nothing)
CASES = [
    ("bias_dropped_by_trtllm",
     _config("cuda", "sm_100", CUDA_VLLM, {"family": "fp8_w8a8", "weight_granularity": "block128"},
             model={"has_bias": True}),
     "triton", "bias.never_dropped", "TrtLlmFp8ExpertsMonolithic"),
    ("lora_on_quantized_activations",
     _config("cuda", "sm_89", CUDA_VLLM, {"family": "fp8_w8a8"}, lora=True),
     "marlin", "lora.needs_unquantized_activations", "TritonExperts"),
    ("fp8_triton_on_rdna3",
     _config("rocm", "gfx1100", ROCM_VLLM, {"family": "fp8_w8a8"}),
     None, "triton.fp8_arch", "TritonExperts"),
    ("mxfp8_emulation_on_cpu",
     _config("cpu", "x86_64", CPU_VLLM, {"family": "mxfp8"}),
     "torch_reference", "vllm_emulation.gpu_only", "Mxfp8EmulationTritonExperts"),
    ("native_mxfp8_lora_not_applied",
     _config("rocm", "gfx950", ROCM_VLLM, {"family": "mxfp8"}, lora=True),
     "vllm_emulation", "mxfp8_native.lora_not_applied", "Mxfp8NativeTritonExperts"),
    ("fp8_per_tensor_on_cpu",
     _config("cpu", "x86_64", CPU_VLLM, {"family": "fp8_w8a8"}),
     "torch_reference", "cpu.order", None),
    ("fp8_w8a16_on_rocm",
     _config("rocm", "gfx942", ROCM_VLLM, {"family": "fp8_w8a16"}),
     "triton", "fp8.order.w8a16", None),
    ("fp8_w8a16_on_sm90_without_marlin_or_humming",
     MoEConfig(model=LAYER, quant={"family": "fp8_w8a16"}, features={"batch_invariant": True},
               platform={"vendor": "cuda", "arch": "sm_90",
                         "packages": [p for p in CUDA_VLLM if p != "humming"]}),
     "triton", "fp8.order.w8a16.sm90", None),
    ("int8_w8a16_on_rocm",
     _config("rocm", "gfx942", ROCM_VLLM, {"family": "int8_w8a16"}),
     "triton", "priority.int8_w8a16.gpu", None),
    ("mori_behind_triton_with_the_aiter_switch",
     MoEConfig(model=LAYER, quant={"family": "int8_w8a8"}, switches={"rocm_use_aiter": "on"},
               parallel={"dp": 2, "expert_parallel": True, "all2all_backend": "mori"},
               platform={"vendor": "rocm", "arch": "gfx942", "packages": ROCM_VLLM + ["mori"]}),
     None, "mori.pairs_with_aiter", "TritonExperts"),
    ("flashinfer_nvlink_on_rocm",
     MoEConfig(model=LAYER, quant={"family": "mxfp8"}, switches={"rocm_use_aiter": "on"},
               parallel={"dp": 2, "expert_parallel": True, "all2all_backend": "flashinfer_nvlink"},
               platform={"vendor": "rocm", "arch": "gfx950", "packages": ROCM_VLLM + ["flashinfer"]}),
     None, "flashinfer_nvlink.cuda", "AiterMxfp8Experts"),
    ("int8_swigluoai_on_cpu",
     _config("cpu", "x86_64", CPU_VLLM, {"family": "int8_w8a8"}, model={"activation": "swigluoai"}),
     "torch_reference", "cpu.order", None),
]


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("vllm")
    from moerules.tools.vllm_oracle import VllmOracle

    return VllmOracle()


def _ours(config: MoEConfig) -> Optional[str]:
    decision = decide(config)
    return decision.backend if decision.outcome == Outcome.selected else None


@pytest.mark.parametrize("case, config, ours, rule, theirs", CASES, ids=[case[0] for case in CASES])
def test_our_decision(case, config, ours, rule, theirs):
    decision = decide(config)
    assert _ours(config) == ours
    assert load_rules().rule(rule).item.deviation, f"{rule} names no deviation"
    if ours is None:    # the deviating rule is among the rejections that left nothing eligible
        assert rule in {rejection.rule for rejection in decision.rejections}
    else:
        assert rule in decision.trace or rule in {rejection.rule for rejection in decision.rejections}


@pytest.mark.parametrize("case, config, ours, rule, theirs", CASES, ids=[case[0] for case in CASES])
def test_vllm_differs(oracle, case, config, ours, rule, theirs):
    answer = oracle.select(config)
    assert answer.experts == theirs, answer
    assert answer.experts != ours   # vLLM's class never maps to our choice here
