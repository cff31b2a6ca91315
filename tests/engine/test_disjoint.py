"""Conditions split into disjoint cases (engine/disjoint.py): the cases of a condition match
exactly the configs it matches, never two at once, and durable fires each rule once per config."""

import json
import random
import time
from pathlib import Path

import pytest

from moerules.engine import compiler
from moerules.engine.disjoint import MAX_CASES, cases
from moerules.engine.expr import normalize, parse
from moerules.engine.fields import config_fields
from moerules.engine.loader import load_rules
from moerules.tools.matrix import cells
from moerules.engine.reference_runner import compile_condition

RULES = Path(__file__).parents[2] / "rules"
# xpu.fp8_keys' violation (rules/32-fp8-int8-mxfp8.yaml): before the split, one config broke it 24 ways at once.
SCHEME_LIST_VIOLATION = (
    "quant.family in [fp8_w8a8, fp8_w8a16, int8_w8a8, mxfp8] and not (quant.family == mxfp8 or "
    "(quant.family == fp8_w8a16 and quant.weight.granularity == tensor) or (quant.family == fp8_w8a8 and "
    "quant.weight.granularity == tensor and quant.activation.granularity == tensor and quant.activation.dynamic) or "
    "(quant.family == fp8_w8a8 and quant.weight.granularity == block128 and (quant.activation.granularity == group128 "
    "or (quant.activation.granularity == tensor and quant.activation.dynamic and "
    "quant.checkpoint == compressed_tensors))))")


def sample_facts(n: int = 3000) -> list[dict]:
    """Matrix cells (every platform, scheme, layout and pin the golden matrix covers), sampled."""
    all_cells = list(cells(load_rules(RULES).backends))
    return [cell.config.facts() for cell in random.Random(7).sample(all_cells, n)]


def predicate(condition):
    return compile_condition({"$and": list(compiler._conjuncts(compiler._to_json(condition)))})


def test_a_scheme_list_violation_splits_into_single_path_cases_that_partition_its_configs():
    condition = normalize(parse(SCHEME_LIST_VIOLATION, config_fields()))
    assert compiler._paths_through(condition) > 1
    split = cases(condition, compiler._paths_through)
    assert 1 < len(split) <= MAX_CASES
    assert [compiler._paths_through(case) for case in split] == [1] * len(split)
    whole, parts = predicate(condition), [predicate(case) for case in split]
    matched = 0
    for facts in sample_facts():
        hits = sum(part(facts) for part in parts)
        assert hits == int(whole(facts)), facts
        matched += hits
    assert matched > 100  # the sample reaches the condition, so the check is not vacuous


def test_a_condition_of_many_alternatives_splits_within_the_case_budget_quickly_and_exactly():
    tests = " or ".join(f"(model.activation == silu and quant.checkpoint == {c} and model.has_bias == {b})"
                        for c in ("native", "compressed_tensors", "modelopt", "quark") for b in ("true", "false"))
    condition = normalize(parse(f"not ({tests}) and not (platform.vendor == cuda and features.lora)",
                                config_fields()))
    start = time.perf_counter()
    split = cases(condition, compiler._paths_through)
    assert time.perf_counter() - start < 2
    assert len(split) <= MAX_CASES
    whole, parts = predicate(condition), [predicate(case) for case in split]
    for facts in sample_facts(500):
        assert sum(part(facts) for part in parts) == int(whole(facts))


def test_durable_fires_each_rule_of_the_shipped_rule_set_at_most_once_per_config():
    durable = pytest.importorskip("durable_rules_engine")
    compiled = compiler.compile_rules(load_rules(RULES))
    handle = durable.create_ruleset("disjoint_test", compiled.durable_definition())
    firings = []
    for facts in sample_facts(300):
        array = json.dumps([{"sid": "1", **compiler.head(compiler.CFG, shard), **{p: facts[p] for p in reads}}
                            for shard, reads in enumerate(compiled.reads[compiler.CFG])])
        _, state = durable.assert_facts(handle, array)
        result = durable.start_action_for_state(handle, state)
        messages = result[1] if result else None
        names = []
        while messages:
            names.append(messages[2:messages.index('"', 2)])
            messages = durable.complete_and_start_action(handle, state)
        durable.retract_facts(handle, array)
        repeated = {name for name in names if names.count(name) > 1}
        # Conditions testing integer ranges on two sides (cc < 90 or cc >= 110) cannot be split on
        # enum or bool values; they cannot hold on both sides at once either.
        assert not repeated, [compiled.rules[name].trace for name in repeated]
        firings.append(len(names))
    assert sum(firings) > 300 * 10
