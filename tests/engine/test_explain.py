"""`explain`: the ranking (base order, the promote/demote that moved the winner, each runner-up's
decisive reason), one decisive rejection per component, the nearest miss, the fallback warning."""

from __future__ import annotations

from pathlib import Path

from moerules.decision import ReasonCode
from moerules.tools.cli.main import main
from moerules.engine.decide import decide, engine_for, fallback_message
from moerules.engine.explain import explain_text
from moerules.engine.misses import SEVERITY

from decision_helpers import config, cuda

QWEN3_FP8 = Path(__file__).resolve().parents[1] / "hf" / "configs" / "qwen3-30b-a3b-fp8.json"
RULES = engine_for().ruleset
SM90_BF16 = config(platform=cuda("sm_90", "flashinfer", "vllm_cutlass"))


def where(rule_id: str) -> str:
    return str(RULES.rule(rule_id).source)


def test_the_bar_command_shows_the_shapes_and_the_ranking(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    argv = ["explain", "--hf-config", str(QWEN3_FP8), "--platform", "rocm:gfx942", "--packages", "triton,aiter"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "E=128 top_k=8 hidden=2048 moe_intermediate=768" in flat and "(w block128, a group128 dynamic)" in flat
    assert f"base order: fp8.order ({where('fp8.order')}; vLLM model_executor/layers/fused_moe/oracle/fp8.py:88-104)" \
        in flat
    assert "final order ([x] rejected): xpu[x], aiter[x]," in flat and "vllm_cutlass[x], triton[winner], marlin[x]" in flat
    assert max(map(len, out.splitlines()[1:])) <= 120  # the first line is the one-line describe()


def test_the_ranking_records_each_step_that_moved_something_in_file_order():
    decision = decide(SM90_BF16)
    assert [(s.rule, s.action, s.moved) for s in decision.ranking] == [
        ("unquantized.priority.cuda", "order", RULES.rule("unquantized.priority.cuda").item.order and
         tuple(RULES.rule("unquantized.priority.cuda").item.order)),
        ("demote.sm90_bf16.flashinfer", "demote", ("flashinfer_trtllm", "flashinfer_trtllm_modular",
                                                   "flashinfer_cutlass")),
        ("demote.unquantized.ours_last", "demote", ("torch_grouped_mm",))]
    assert decision.ranking[1].cite == "model_executor/layers/fused_moe/oracle/unquantized.py:78-80"
    assert decision.ranking[-1].order.index("triton") < decision.ranking[-1].order.index("flashinfer_cutlass")
    # demote.dp_bf16.flashinfer_cutlass matches only dp > 1: not a step here
    assert "demote.dp_bf16.flashinfer_cutlass" not in {s.rule for s in decision.ranking}


def test_explain_names_the_demotion_that_moved_each_runner_up_behind_the_winner():
    decision = decide(SM90_BF16)
    assert (decision.backend, decision.alternatives) == ("triton", ("flashinfer_cutlass", "torch_grouped_mm"))
    text = " ".join(explain_text(decision, width=400).split())
    assert (f"demotes: flashinfer_trtllm, flashinfer_trtllm_modular, flashinfer_cutlass by demote.sm90_bf16.flashinfer "
            f"({where('demote.sm90_bf16.flashinfer')}; vLLM model_executor/layers/fused_moe/oracle/unquantized.py:78-80)"
            ) in text
    assert (f"flashinfer_cutlass (eligible): demoted behind triton by demote.sm90_bf16.flashinfer "
            f"({where('demote.sm90_bf16.flashinfer')})") in text
    assert (f"torch_grouped_mm (eligible): ranks below triton in the base order unquantized.priority.cuda "
            f"({where('unquantized.priority.cuda')})") in text


def test_the_trace_keeps_phase_order_then_rule_file_order():
    decision = decide(SM90_BF16)
    trace = decision.trace
    assert trace[0] == "start" and trace != tuple(sorted(trace))
    plan = [trace.index(rule) for rule in decision.quant.rules]
    screen = [name for name in trace if name != "start" and trace.index(name) < min(plan)]
    positions = [RULES.position(RULES.rule(name.split("@")[0])) for name in screen]
    assert positions == sorted(positions) and max(plan) == len(trace) - 1


def test_rejections_show_one_decisive_row_per_component_and_hide_other_dispatchers():
    decision = decide(SM90_BF16)
    dispatchers = RULES.dispatchers
    lines = explain_text(decision, dispatchers=dispatchers, width=400).splitlines()
    rows = lines[lines.index(next(l for l in lines if l.startswith("rejections ("))) + 3:]
    components = [row.split()[0] for row in rows]
    rejected = {r.backend for r in decision.rejections}
    assert sorted(components) == sorted(name for name in rejected if name not in dispatchers)
    # aiter: vendor_unsupported outranks its missing package, and the other rejection is counted
    aiter = [r for r in decision.rejections if r.backend == "aiter"]
    assert {r.reason for r in aiter} == {ReasonCode.vendor_unsupported, ReasonCode.package_missing}
    assert rows[components.index("aiter")].split()[1:4] == ["vendor_unsupported", "(+1", "more)"]
    every = explain_text(decision, dispatchers=dispatchers, show_all=True, width=400)
    assert "dispatchers outside this layout hidden" in "\n".join(lines)
    assert "dispatchers outside this layout hidden" not in every
    assert len(every.splitlines()) - len(lines) == len(decision.rejections) - len(rows)


def test_an_unsupported_decision_has_a_reason_code_and_the_nearest_miss():
    decision = decide(config(quant={"family": "nvfp4"}, platform=cuda("sm_80")))
    assert decision.failure_reason == ReasonCode.no_eligible_backend
    assert decision.nearest_miss == "marlin: only package_missing - install marlin (or state it: --packages)"
    assert len(decision.describe()) < 300
    assert "nearest miss: marlin: only package_missing - install marlin" in explain_text(decision)


def test_the_fallback_warning_names_the_displaced_backend_and_the_rule():
    cfg = config({"routing": "sigmoid"}, platform=cuda("sm_100", "flashinfer"), features={"lora": True})
    decision = decide(cfg)
    rule = RULES.rule("lora.requires_capable_backend")
    assert fallback_message(decision, RULES) == (
        f"auto mode fell back to triton: flashinfer_trtllm ranks higher but rule lora.requires_capable_backend "
        f"({rule.source}) rejects it (flashinfer_trtllm experts cannot apply LoRA deltas)")
    assert (f"experts: triton (kernel triton.fused_moe), selected by fallback via lora.requires_capable_backend "
            f"({rule.source}), displacing flashinfer_trtllm") in " ".join(explain_text(decision).split())


def test_every_reason_code_has_a_severity():
    assert set(SEVERITY) == set(ReasonCode)


def test_the_library_explain_hides_other_dispatchers_unless_asked():
    import moerules
    text, every = moerules.explain(SM90_BF16), moerules.explain(SM90_BF16, show_all=True)
    assert "dispatchers outside this layout hidden" in text and "dispatchers outside this layout hidden" not in every
    assert "\ndeepep_ll " in every and "\ndeepep_ll " not in text
