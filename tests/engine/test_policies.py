"""The policies of DESIGN.md: pins honoured or failing loudly, typed errors, pure decisions."""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from moerules import decide, load_rules
from moerules.config import MoEConfig
from moerules.decision import Decision, Outcome, ReasonCode, SelectedBy
from moerules.errors import BackendRejectedError, UnknownBackendError
from moerules.engine.decide import Engine

from decision_helpers import config, cuda, rocm


def test_a_pinned_backend_is_honoured_over_the_priority():
    decision = decide(config(platform=cuda("sm_90"), features={"backend": "torch_grouped_mm"}))
    assert (decision.backend, decision.selected_by, decision.requested) == (
        "torch_grouped_mm", SelectedBy.pinned, "torch_grouped_mm")
    assert decision.alternatives == ("triton",)


def test_a_rejected_pin_fails_naming_rule_reason_and_alternatives():
    cfg = config(platform=cuda("sm_90"), features={"backend": "aiter"})
    with pytest.raises(BackendRejectedError) as raised:
        decide(cfg)
    text = str(raised.value)
    assert "requested backend 'aiter' is rejected" in text
    assert "aiter.rocm at rules/20-platform.yaml" in text and "vendor_unsupported" in text
    assert text.endswith("Eligible alternatives: triton, torch_grouped_mm")
    assert raised.value.decision.failure_reason == ReasonCode.package_missing or \
        raised.value.decision.failure_reason == ReasonCode.vendor_unsupported


def test_unknown_backend_names_fail_before_evaluation_and_list_valid_ones():
    with pytest.raises(UnknownBackendError) as raised:
        decide(config(features={"backend": "Trtion"}))
    assert raised.value.name == "trtion"
    assert "Did you mean 'triton'?" in str(raised.value)
    assert raised.value.valid == sorted(load_rules().backends)


@pytest.mark.parametrize("sections,field", [
    ({"model": {"num_experts": 8, "top_k": 9, "hidden_size": 64, "moe_intermediate_size": 64}}, "model"),
    ({"model": {"num_experts": 8, "top_k": 2, "hidden_size": 0, "moe_intermediate_size": 64}}, "model.hidden_size"),
    ({"model": {"num_experts": 8, "top_k": 2, "hidden_size": 64, "moe_intermediate_size": 64, "activaton": "silu"}},
     "model.activaton"),
    ({"model": {"num_experts": 8, "top_k": 2, "hidden_size": 64, "moe_intermediate_size": 64},
      "platform": {"vendor": "cuda", "arch": "gfx950"}}, "platform"),
    ({"model": {"num_experts": 8, "top_k": 2, "hidden_size": 64, "moe_intermediate_size": 64},
      "quant": {"family": "int8_w8a8", "weight_granularity": "block128"}}, "quant"),
])
def test_bad_config_values_name_the_field(sections, field):
    with pytest.raises(ValidationError) as raised:
        MoEConfig.model_validate(sections)
    assert ".".join(str(p) for p in raised.value.errors()[0]["loc"]) == field


def test_the_old_intermediate_size_name_is_refused_naming_the_new_one():
    """Hugging Face's `intermediate_size` is the dense MLP's: read as the experts' it gives wrong shapes silently."""
    with pytest.raises(ValidationError) as raised:
        MoEConfig(model={"num_experts": 128, "top_k": 8, "hidden_size": 2048, "intermediate_size": 6144})
    (error,) = raised.value.errors()
    assert error["type"] == "renamed_field" and error["loc"] == ("model", "intermediate_size")
    assert error["msg"].startswith("model.intermediate_size was renamed model.moe_intermediate_size")


def test_unsupported_auto_lists_every_candidate_with_its_reason():
    decision = decide(config(quant={"family": "w4a8"}, platform=rocm("gfx942")))
    assert decision.outcome == Outcome.unsupported and decision.error.startswith("no backend supports")
    rejected = {r.backend for r in decision.rejections}
    assert rejected >= set(load_rules().backends)


def test_engines_agree_and_decisions_are_deterministic():
    cfgs = [config(platform=cuda(arch, "flashinfer", "marlin"), quant=quant, features=features)
            for arch in ("sm_80", "sm_90", "sm_100")
            for quant in ({"family": "unquantized"}, {"family": "fp8_w8a8", "weight_granularity": "block128"},
                          {"family": "mxfp4_w4a16"})
            for features in ({}, {"lora": True})]
    ruleset = load_rules()
    durable, reference = Engine(ruleset, "durable"), Engine(ruleset, "reference")
    for cfg in cfgs:
        a, b = durable.decide(cfg), reference.decide(cfg)
        assert a.model_dump(exclude={"engine"}) == b.model_dump(exclude={"engine"})
        assert (a.engine, b.engine) == ("durable", "reference")
    fresh = Engine(ruleset, "durable")
    assert [fresh.decide(c) for c in reversed(cfgs)][::-1] == [durable.decide(c) for c in cfgs]


def test_decisions_are_the_same_from_many_threads():
    engine = Engine(load_rules(), "durable")
    cfgs = [config(model={"moe_intermediate_size": 1024 * (i + 1)}, platform=cuda("sm_90")) for i in range(40)]
    expected = [Engine(load_rules(), "reference").decide(c).model_dump(exclude={"engine"}) for c in cfgs]
    results: dict[int, list] = {}

    def work(worker: int) -> None:
        results[worker] = [engine.decide(c).model_dump(exclude={"engine"}) for c in cfgs]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[i] == expected for i in range(6))


def test_more_decisions_than_durable_keeps_live_sids():
    # durable caps live sids at 1,024 per ruleset; a leaked sid per decision would hit it.
    engine = Engine(load_rules(), "durable")
    for i in range(1100):
        assert engine.decide(config(model={"moe_intermediate_size": 64 * (i + 1)})).backend == "triton"


def test_decision_json_round_trips_and_describe_is_one_line():
    decision = decide(config(platform=cuda("sm_90")))
    assert Decision.model_validate_json(decision.to_json()) == decision
    assert "\n" not in decision.describe() and decision.describe().startswith("moerules: triton experts (auto)")


def test_invalid_decisions_are_unrepresentable():
    decision = decide(config(platform=cuda("sm_90")))
    with pytest.raises(ValidationError, match="selected decision lacks backend"):
        Decision.model_validate({**decision.to_dict(), "backend": None})
    with pytest.raises(ValidationError, match="unsupported decision names no backend"):
        Decision.model_validate({**decision.to_dict(), "outcome": "unsupported", "error": None})
