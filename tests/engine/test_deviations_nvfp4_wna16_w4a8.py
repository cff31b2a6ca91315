"""Named deviations from vLLM 0.33 for the NVFP4 / WNA16 (incl. INT8 W8A16) / W4A8 families
(rules/34-nvfp4-wna16-w4a8.yaml): our exact decision, and, where vLLM is importable, that vLLM's own
selection differs as each rule's `deviation:` says."""

import pytest

from moerules import decide
from moerules.config import VLLM_INSTALL, MoEConfig
from moerules.decision import Outcome

CUDA_ALL = sorted(p.value for p in VLLM_INSTALL)


def _config(quant, vendor, arch, packages, hidden=4096, intermediate=4096, **model):
    return MoEConfig(model=dict(num_experts=16, top_k=2, hidden_size=hidden, moe_intermediate_size=intermediate,
                                **model),
                     quant=quant, platform={"vendor": vendor, "arch": arch, "packages": packages})


def _vllm(config):
    pytest.importorskip("vllm")
    from moerules.tools.vllm_oracle import VllmOracle

    return VllmOracle().select(config)


def test_w4a8_cutlass_shape_refused_before_selection():
    # hidden 2880 is not a multiple of 256: vLLM picks CUTLASS W4A8, then asserts in create_weights
    # (as it would for Humming): we refuse both up front.
    config = _config({"family": "w4a8"}, "cuda", "sm_90", CUDA_ALL, hidden=2880, intermediate=2880)
    decision = decide(config)
    assert decision.outcome == Outcome.unsupported
    for backend in ("cutlass_w4a8", "humming"):
        assert {r.rule for r in decision.rejections_of(backend)} == {"cutlass_w4a8.dim_alignment_256"}
    answer = _vllm(config)
    assert answer.experts == "CutlassExpertsW4A8Fp8"


@pytest.mark.parametrize("vendor, arch, packages, ours", [
    ("rocm", "gfx942", ["triton", "vllm"], "triton"),
    ("cpu", "x86_64", ["vllm", "vllm_cpu"], "torch_reference"),
])
def test_int8_w8a16_served_by_ours_where_vllm_has_none(vendor, arch, packages, ours):
    # A GPTQ (native) 8-bit checkpoint announces biases, so vLLM's TRITON refuses it; int4 emulation and
    # the CPU int4 experts take no int8 weights: vLLM raises, our kernels serve.
    config = _config({"family": "int8_w8a16"}, vendor, arch, packages)
    decision = decide(config)
    assert decision.outcome == Outcome.selected and decision.backend == ours
    assert ("priority.int8_w8a16.gpu" if vendor == "rocm" else "cpu.order") in decision.trace
    answer = _vllm(config)
    assert not answer.selected and answer.error.startswith("NotImplementedError")


def test_int8_w8a16_uses_the_wna16_oracle_with_marlin_on_cuda():
    config = _config({"family": "int8_w8a16"}, "cuda", "sm_80", CUDA_ALL)
    assert decide(config).backend == "marlin"
    answer = _vllm(config)
    assert answer.family == "wna16" and answer.experts == "MarlinExperts"


def test_flashinfer_cutlass_refused_below_128_aligned_intermediate():
    # 2880 is not a multiple of 128: vLLM's FlashInferExperts checks no shape and hangs there (vllm#51492).
    config = _config({"family": "nvfp4"}, "cuda", "sm_120", CUDA_ALL + ["flashinfer"], hidden=2880,
                     intermediate=2880)
    decision = decide(config)
    assert decision.backend == "vllm_cutlass"
    assert [r.rule for r in decision.rejections_of("flashinfer_cutlass")] == ["flashinfer_cutlass.intermediate_align_128"]
    assert _vllm(config).experts == "FlashInferExperts"


def test_flashinfer_cutlass_refused_for_nvfp4_biases():
    # vLLM's FlashInferExperts passes expert biases only for MXFP4 weights: with NVFP4 it drops them.
    config = _config({"family": "nvfp4"}, "cuda", "sm_120", CUDA_ALL + ["flashinfer"], has_bias=True)
    decision = decide(config)
    assert decision.backend == "marlin"
    assert [r.rule for r in decision.rejections_of("flashinfer_cutlass")] == ["flashinfer_cutlass.nvfp4_no_bias"]
    assert _vllm(config).experts == "FlashInferExperts"
