"""The regression corpus: each seed regression re-created in a mutated copy of the default
rules (or a mutated component), and the check in our suite that catches it.

Rule mutants are caught by the committed decision matrix (the cells of the mutant's
platform are re-decided and compared with the golden files in matrix/decisions/) and by the invariants the
property suite asserts; component mutants by the kernel-boundary checks.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from moerules import build, decide
from moerules.config import MoEConfig
from moerules.decision import Outcome
from moerules.errors import BackendRejectedError
from moerules.tools import matrix, matrix_golden
from moerules.engine.decide import Engine
from moerules.engine.loader import load_rules
from moerules.kernels import make_random_weights
from moerules.resources import default_rules_dir

from decision_helpers import config, cuda

GOLDEN = Path(__file__).resolve().parents[2] / "matrix" / "decisions"


@functools.lru_cache(maxsize=1)
def golden_rows() -> dict[str, dict]:
    return matrix_golden.read(GOLDEN, regenerate="moerules matrix")


def matrix_changes(rules: Path, *fragments: str) -> list[matrix.Change]:
    """Re-decide the golden cells whose key contains every fragment, under `rules`: the cells whose
    decision differs from the committed golden files, each with both sides' explanations (the golden
    files hold decisions only, so the default rules' side is decided again for its explanation)."""
    engine, default = Engine(load_rules(rules)), Engine(load_rules(default_rules_dir()))
    cells = [c for c in matrix.cells(engine.ruleset.backends) if all(f in c.key for f in fragments)]
    assert cells, f"no matrix cell matches {fragments}"
    new = {c.key: matrix.row(engine, c) for c in cells}
    caught = matrix.compare({c.key: golden_rows()[c.key] for c in cells}, new)
    explained = matrix.compare({c.key: matrix.row(default, c) for c in cells}, new)
    assert [c.cell for c in caught] == [c.cell for c in explained]
    return explained


def test_the_golden_matrix_matches_the_default_rules_on_a_sample():
    assert matrix_changes(default_rules_dir(), "cuda:sm_90") == []


def test_dropped_gfx950_gate(rules_without):
    changes = matrix_changes(rules_without("ck_mxfp4.gfx950_only"), "rocm:gfx942|mxfp4_w4a16")
    to_aiter = [c for c in changes if c.new["backend"] == "aiter"]
    assert to_aiter and all("ck_mxfp4.gfx950_only" in c.rules for c in to_aiter)
    assert all("ck_mxfp4.gfx950_only" in c.rules for c in changes)  # the others: triton auto -> fallback


def test_dropped_256_alignment(rules_without):
    # CK MXFP4 needs 256-aligned sizes: vLLM pads them on ROCm (oracle/mxfp4.py:880-910).
    changes = matrix_changes(rules_without("rocm.mxfp4_round_up"), "rocm:gfx950|mxfp4_w4a16", "unaligned")
    padded = [c for c in changes if "hidden_pad" in c.fields() or "intermediate_pad" in c.fields()]
    assert padded


def test_unconditional_expects_unquantized_inputs(rules_without):
    # vLLM 0.33 runs AITER's FP8 experts only with VLLM_ROCM_USE_AITER=1 (rocm_aiter_moe.py:513), which no
    # MoRI cell of the matrix sets: the regression is pinned on that config directly.
    cfg = MoEConfig(model=dict(num_experts=16, top_k=2, hidden_size=4096, moe_intermediate_size=4096),
                    quant={"family": "fp8_w8a8", "weight_granularity": "channel", "checkpoint": "compressed_tensors"},
                    parallel={"dp": 2, "expert_parallel": True, "all2all_backend": "mori"},
                    platform={"vendor": "rocm", "arch": "gfx942", "packages": ["triton", "aiter", "mori"]},
                    switches={"rocm_use_aiter": "on"})
    engine, mutant = Engine(load_rules(default_rules_dir())), Engine(load_rules(rules_without("aiter.prequantized_behind_mori")))
    old, new = matrix.record(engine, cfg), matrix.record(mutant, cfg)
    assert old["backend"] == new["backend"] == "aiter"
    changed = sorted(key for key in old if old[key] != new[key] and key != "rules")
    assert changed == sorted(["quantized_by", "expects_unquantized_inputs", "dispatch_dtype", "scale_dim"]), changed


def test_no_dispatcher_under_all2all(rules_without):
    mutant = rules_without("dispatch.a2a.torch")
    changes = matrix_changes(mutant, "cuda:sm_90|unquantized", "a2a_torch")
    assert changes and all(c.new["failure_reason"] == "no_dispatcher" for c in changes)
    decision = decide(config(platform=cuda("sm_90"), parallel={"dp": 2, "expert_parallel": True,
                                                               "all2all_backend": "torch_all2all"}), mutant)
    assert decision.outcome == Outcome.unsupported and decision.prepare_finalize is None


def test_lora_pin_silently_replaced_or_accepted(rules_without):
    # Without the LoRA capability rule a pinned LoRA-incapable backend is accepted: the LoRA
    # invariant (selected => backend declares LoRA) is what fails.
    mutant = rules_without("lora.requires_capable_backend")
    pinned = config(platform=cuda("sm_100", "flashinfer"), features={"lora": True, "backend": "flashinfer_cutlass"})
    with pytest.raises(BackendRejectedError):
        decide(pinned)
    decision = decide(pinned, mutant)
    assert decision.backend == "flashinfer_cutlass" and not load_rules(mutant).backends[decision.backend].item.lora


def test_bias_dropped(rules_without):
    changes = matrix_changes(rules_without("bias.never_dropped"), "cuda:sm_100", "bias")
    assert changes and any(c.new["backend"] == "flashinfer_trtllm" for c in changes)


def test_lost_padding(rules_without):
    changes = matrix_changes(rules_without("marlin.mxfp4_round_up"), "mxfp4_w4a16", "unaligned", "pin=marlin")
    assert changes and all(c.fields() == ["hidden_pad", "intermediate_pad"] for c in changes)


def _cpu_layer():
    cfg = MoEConfig(model=dict(num_experts=4, top_k=2, hidden_size=64, moe_intermediate_size=96, in_dtype="fp32",
                               has_bias=True),
                    platform=dict(vendor="cpu", arch="x86_64", packages=[]))
    decision = decide(cfg)
    weights = make_random_weights(num_experts=4, hidden=64, intermediate=96, quant=cfg.quant, in_dtype=cfg.model.in_dtype,
                                  has_bias=True, seed=3, device="cpu")
    return build(decision, weights)


def test_swapped_topk_at_the_dispatcher_boundary_is_caught():
    layer = _cpu_layer()
    honest = layer.prepare_finalize.prepare

    def swapping_prepare(x, **kwargs):  # the bug: a dispatcher returning (weights, ids) in the wrong slots
        prepared = honest(x, **kwargs)
        return dataclasses.replace(prepared, topk_ids=prepared.topk_weights, topk_weights=prepared.topk_ids)
    layer.prepare_finalize.prepare = swapping_prepare
    with pytest.raises(ValueError, match="swapped"):
        layer(torch.randn(5, 64), router_logits=torch.randn(5, 4))


def test_bias_in_the_wrong_slot_is_caught():
    # In the peer a bias passed positionally into the zero-point slot was silently unused. Our
    # components take biases by keyword only, and a bias that goes missing changes the output.
    layer = _cpu_layer()
    x, logits = torch.randn(6, 64), torch.randn(6, 4)
    ids, weights = layer.route(logits)
    expected = layer.experts.apply(x, weights=layer.weights, topk_ids=ids, topk_weights=weights, a_scale=None)
    unbiased = dataclasses.replace(layer.weights, w13_bias=None, w2_bias=None)
    lost = layer.experts.apply(x, weights=unbiased, topk_ids=ids, topk_weights=weights, a_scale=None)
    assert (lost - expected).norm() / expected.norm() > 1e-2
    with pytest.raises(TypeError):
        layer.experts.apply(x, layer.weights, ids, weights, None)
