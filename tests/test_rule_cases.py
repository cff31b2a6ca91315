"""The cases beside each rule file (rules/cases/): every one holds, every rule has one, the seed rules and
the deviations are defended by name, and `moerules test` notices a lost rule, a weakened one, a rule file
without cases and a malformed case."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from moerules.engine.loader import load_rules
from moerules.errors import RuleSetError
from moerules.resources import default_rules_dir
from moerules.tools import rule_cases
from moerules.tools.cli.main import main

RULES = default_rules_dir()
SEED_TESTS = Path(__file__).parent / "engine" / "test_seed_rules.py"


@pytest.fixture(scope="module")
def results():
    return rule_cases.run(RULES, load_rules())


def test_every_case_holds_and_every_rule_file_has_cases(results):
    assert [r for r in results if r.problem] == []
    assert rule_cases.missing_case_files(RULES, load_rules()) == []


def test_every_rule_has_a_case(results):
    covered = rule_cases.coverage(load_rules(), results)
    assert (covered.uncovered, covered.deviations, covered.percent) == ({}, [], 100.0)


def test_the_seed_rules_and_the_deviations_are_defended_by_name(results):
    defended = {r.rule for r in results if r.problem is None}
    seeds = set(re.findall(r'rules_without\("([^"]+)"\)', SEED_TESTS.read_text()))
    deviations = {rule.id for rule in load_rules().rules() if getattr(rule.item, "deviation", None)}
    assert len(seeds) >= 10 and len(deviations) >= 30   # the patterns above still find them
    assert seeds - defended == set() and deviations - defended == set()


def problems(rules_dir: Path, rule_id: str) -> list[str]:
    return [r.problem for r in rule_cases.run(rules_dir, load_rules(rules_dir)) if r.rule == rule_id]


def test_a_deleted_rule_fails_its_case(rules_without):
    assert problems(rules_without("batched_triton.no_int8"), "batched_triton.no_int8") == [
        "no rule 'batched_triton.no_int8' in this rule set (deleted or renamed? update or remove the case)"]


def test_a_weakened_rule_fails_its_case(tmp_path):
    out = tmp_path / "rules"
    shutil.copytree(RULES, out)
    quant = out / "30-quant.yaml"
    data = yaml.safe_load(quant.read_text())
    [rule] = [c for c in data["constraints"] if c["id"] == "batched_triton.no_int8"]
    rule["require"] = "quant.family != nvfp4"   # no longer refuses INT8
    quant.write_text(yaml.safe_dump(data, sort_keys=False))
    assert problems(out, "batched_triton.no_int8") == [
        "batched_triton.no_int8 does not reject batched_triton here (rejected by: format.matches_dispatcher)"]


def test_a_rule_file_without_cases_and_a_malformed_case_are_reported(tmp_path):
    out = tmp_path / "rules"
    shutil.copytree(RULES, out)
    (out / "cases" / "60-dispatch.yaml").unlink()
    assert rule_cases.missing_case_files(out, load_rules(out)) == ["60-dispatch.yaml"]
    (out / "cases" / "70-plan.yaml").write_text(
        "cases:\n- rule: quant.unquantized\n"
        "  config: {model: {num_experts: 8, top_k: 2, hidden_size: 64, moe_intermediate_size: 64}}\n"
        "  rejectd: triton\n")
    with pytest.raises(RuleSetError) as info:
        rule_cases.run(out, load_rules(out))
    assert [str(e) for e in info.value.errors] == [
        "rules/cases/70-plan.yaml:4:3: unknown field 'rejectd' (did you mean 'rejected'?)"]


def test_the_command_runs_every_case_and_checks_the_threshold(capsys):
    assert main(["test", "--min-coverage", "100"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"(\d+) of \1 cases hold", out[0]) and out[1].startswith("coverage: 100.0% of ")
