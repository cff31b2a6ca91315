"""durable-rules' capacities: each constant holds at its edge on the real engine, and rule
sets past the edge (the repros of issue 10) decide correctly or are refused by name.

Anything that could crash or hang the interpreter runs in a child process with a timeout,
so a regression fails one test instead of killing the run.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moerules.errors import RuleSetError
from moerules.engine import capacity
from moerules.engine.decide import Engine
from moerules.engine.loader import load_rules

pytest.importorskip("durable_rules_engine")
PROBE = Path(__file__).with_name("durable_probe.py")
RULES = Path(__file__).parents[2] / "rules"


def probe(scenario: str, n: int, timeout: float = 10) -> str:
    try:
        done = subprocess.run([sys.executable, str(PROBE), scenario, str(n)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang"
    return done.stdout.strip() or f"signal {-done.returncode}"


@pytest.mark.parametrize("scenario, limit, beyond", [
    ("stack", capacity.STACK_SLOTS, "error 303"),
    ("children", capacity.CHILD_SLOTS, "hang"),
    ("absences", capacity.ABSENCE_SLOTS, "signal 11"),
    ("betas", capacity.BETA_SLOTS, "signal 11"),
    ("groups", capacity.EXPRESSION_SLOTS // 2, "error 113"),
    ("properties", capacity.FACT_PROPERTIES, "error 302"),
    ("rules", capacity.RULE_SLOTS, "error 106"),
])
def test_each_durable_limit_holds_at_its_edge_and_fails_one_past_it(scenario, limit, beyond):
    assert probe(scenario, limit) == "ok"
    assert probe(scenario, limit + 1, timeout=3) == beyond


def rules_with(tmp_path: Path, extra: str) -> Path:
    folder = tmp_path / "rules"
    shutil.copytree(RULES, folder)
    (folder / "90-extra.yaml").write_text("version: 1\n" + extra)
    return folder


def constraints(conditions: list[str], applies_to: str = "[triton]") -> str:
    body = "".join(f"  - id: extra.c{i}\n    applies_to: {applies_to}\n    when: {when}\n    require: model.top_k > 100\n"
                   f"    reason: shape_unaligned\n    message: extra constraint {i}\n"
                   for i, when in enumerate(conditions))
    return "constraints:\n" + body


def decide_in_child(folder: Path, *args: str) -> dict:
    """`moerules decide --json` on a rule folder, in a child process: a crash or hang fails the test."""
    command = [sys.executable, "-m", "moerules.tools.cli.main", "decide", "--model", "mixtral-8x7b", "--json",
               "--rules", str(folder), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("count", [64, 400])
def test_constraints_that_all_match_one_config_are_sharded_not_fatal(tmp_path, count):
    decision = decide_in_child(rules_with(tmp_path, constraints([f"model.hidden_size > {i}" for i in range(count)])))
    extra = sorted(int(r["rule"][len("extra.c"):]) for r in decision["rejections"] if r["rule"].startswith("extra."))
    assert extra == list(range(count))
    assert decision["backend"] == "torch_grouped_mm"  # triton rejected by every one of them


@pytest.mark.parametrize("fields", [["model.hidden_size"], ["model.hidden_size", "model.num_experts", "model.top_k",
                                                             "parallel.tp", "parallel.dp",
                                                             "model.moe_intermediate_size"]])
def test_hundreds_of_equality_tests_per_field_do_not_hang(tmp_path, fields):
    per_field = 600 // len(fields)
    conditions = [f"{field} == {4096 + 1 + i}" for field in fields for i in range(per_field)]
    conditions.append(f"{fields[0]} == 4096")  # mixtral-8x7b's hidden size: exactly one of them matches
    decision = decide_in_child(rules_with(tmp_path, constraints(conditions)))
    assert [r["rule"] for r in decision["rejections"] if r["rule"].startswith("extra.")] == [f"extra.c{len(conditions) - 1}"]


def test_hundreds_of_components_decide(tmp_path):
    count = 300
    backends = "".join(f"  - id: extra_{i}\n    kernel: torch.reference\n    description: filler {i}\n"
                       for i in range(count))
    folder = rules_with(tmp_path, "backends:\n" + backends)
    decision = decide_in_child(folder)
    assert decision["backend"] == "triton"
    # every filler backend is eligible (no rule rejects it) and, unlisted by the priorities, ranks after them
    assert [b for b in decision["alternatives"] if b.startswith("extra_")] == sorted(f"extra_{i}" for i in range(count))


@pytest.mark.parametrize("when, problem", [
    ("model.hidden_size in [" + ", ".join(str(i) for i in range(600)) + "]", "601 comparisons (durable-rules allows 500)"),
    (" and ".join(f"(model.hidden_size > {i} or model.top_k > {i})" for i in range(7)),
     "128 paths that can match one config at once (durable-rules allows 64)"),
    (" and ".join(f"(model.hidden_size == {i} or model.top_k == {i})" for i in range(15)),
     "32 and/or group markers (two per group) (durable-rules allows 31)"),
])
def test_a_rule_too_large_for_durable_is_refused_by_name(tmp_path, when, problem):
    folder = rules_with(tmp_path, constraints([when]))
    with pytest.raises(RuleSetError) as raised:
        Engine(load_rules(folder))
    error, = raised.value.errors
    assert (error.rule, error.file, error.line) == ("extra.c0", f"{folder}/90-extra.yaml", 3)
    assert problem in error.message


def test_rules_with_one_condition_share_one_durable_rule(tmp_path):
    """BETA_SLOTS: more rules than one alpha node can end would crash durable; merged, they cannot."""
    count = capacity.BETA_SLOTS + 100
    ruleset = load_rules(rules_with(tmp_path, constraints(["model.hidden_size > 1"] * count)))
    merged = [rule for rule in Engine(ruleset, "reference").compiled.rules.values()
              if rule.firings[0].rule_id.startswith("extra.")]
    assert len(merged) == 1 and len(merged[0].firings) == count
    decision = decide_in_child(rules_with(tmp_path / "child", constraints(["model.hidden_size > 1"] * count)))
    assert sum(r["rule"].startswith("extra.") for r in decision["rejections"]) == count


def test_more_shards_than_one_node_holds_are_grouped(tmp_path):
    """Rules of 31 alternatives fill a shard each: 520 of them need more shard tests than durable's
    child table holds under one node (CHILD_SLOTS), so shards come in groups."""
    conditions = [" or ".join(f"model.top_k > {31 * i + j}" for j in range(31)) for i in range(520)]
    folder = rules_with(tmp_path, constraints(conditions))
    shards = {rule.shard for rule in Engine(load_rules(folder), "reference").compiled.rules.values() if rule.tag == "cfg"}
    assert len(shards) > capacity.CHILD_SLOTS
    decision = decide_in_child(folder)
    assert [r["rule"] for r in decision["rejections"] if r["rule"].startswith("extra.")] == ["extra.c0"]  # top_k 2 > 0, 1


def test_shards_are_packed_in_rule_order_within_the_budget(tmp_path):
    """Each shard fits the budget, and a shard was closed only because its next rule did not fit."""
    ruleset = load_rules(rules_with(tmp_path, constraints([f"model.hidden_size > {i}" for i in range(400)])))
    rules = [rule for rule in Engine(ruleset, "reference").compiled.rules.values() if rule.tag == "cfg"]
    assert [rule.shard for rule in rules] == sorted(rule.shard for rule in rules)
    spent: dict[int, capacity.Cost] = {}
    for rule in rules:
        price = rule.cost
        if rule.shard not in spent and rule.shard > 0:
            assert not (spent[rule.shard - 1] + price).fits_shard()
        spent[rule.shard] = spent[rule.shard] + price if rule.shard in spent else price
    assert len(spent) >= 400 // capacity.SHARD_STACK and all(cost.fits_shard() for cost in spent.values())
