"""Shared oracles for the property suite: the default rule set, its engines, and helpers
that recompute what a decision must satisfy without going through `decide`."""

from __future__ import annotations

from functools import lru_cache

from moerules.config import MoEConfig
from moerules.decision import Decision
from moerules.errors import BackendRejectedError
from moerules.engine.compiler import compile_rules, head
from moerules.engine.decide import Engine
from moerules.engine.evaluate import effective_order
from moerules.engine.loader import load_rules
from moerules.engine.reference_runner import compile_condition

RULES = load_rules()
BACKENDS = sorted(RULES.backends)
COMPILED = compile_rules(RULES)
DURABLE = Engine(RULES, "durable")
REFERENCE = Engine(RULES, "reference")


def decide(config: MoEConfig, engine: Engine = DURABLE) -> Decision:
    """A decision, with a rejected pin's record returned instead of raised."""
    try:
        return engine.decide(config)
    except BackendRejectedError as error:
        return error.decision


@lru_cache(maxsize=None)
def _reject_predicates(target: str):
    return [(firing.rule_id, rule.shard, compile_condition(rule.condition))
            for rule in COMPILED.rules.values() for firing in rule.firings
            if firing.kind == "reject" and firing.target == target]


def violated_constraints(config: MoEConfig, target: str) -> list[str]:
    """Rule ids whose reject condition holds for `target`, evaluated directly on the compiled JSON."""
    facts = config.facts()
    return [rule_id for rule_id, shard, predicate in _reject_predicates(target)
            if predicate({**head("cfg", shard), **facts})]


def priority_order(decision: Decision) -> list[str]:
    fired = set(decision.trace)
    return effective_order([r for r in RULES.priorities if r.id in fired])[0]


def declared(backend: str):
    return RULES.backends[backend].item
