"""Run the compiled phases for one config and collect what fired, in rule-file terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from moerules.config import MoEConfig
from moerules.decision import Rejection
from moerules.errors import EngineError
from moerules.engine.compiler import CFG, PHASE, PLAN, CompiledRules
from moerules.engine.fields import flatten
from moerules.engine.rulefile import MESSAGE_PLACEHOLDER
from moerules.engine.ruleset import Rule

@dataclass
class Evaluation:
    """The facts a decision is assembled from."""

    rejections: list[Rejection] = field(default_factory=list)
    eligible: set[str] = field(default_factory=set)
    priority_rules: list[Rule] = field(default_factory=list)
    dispatch_rules: list[Rule] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)


class PhaseRunner:
    """Drives one session of a runner through the phases (see compiler.py)."""

    def __init__(self, compiled: CompiledRules, session, config: MoEConfig):
        self.compiled, self.session, self.config = compiled, session, config
        self.facts = config.facts()
        self.flat = flatten(self.facts)
        self.evaluation = Evaluation()

    def screen(self) -> Evaluation:
        """Phases cfg and eligibility: rejections, eligible components, priority and dispatch rules."""
        fired = self._run({"t": CFG, **self.facts})
        fired += self._run({"t": PHASE, "n": "eligibility"})
        ruleset = self.compiled.ruleset
        names = set(fired)
        for name in fired:
            rule = self.compiled.rules[name]
            if rule.kind == "reject":
                self.evaluation.rejections.append(self._rejection(rule.target, ruleset.rule(rule.rule_id)))
            elif rule.kind == "eligible":
                self.evaluation.eligible.add(rule.target)
        # Keep rule-file order, never firing order: durable fires matches in no documented order.
        self.evaluation.priority_rules = [r for r in ruleset.priorities if r.id in names]
        self.evaluation.dispatch_rules = [r for r in ruleset.dispatch if r.id in names]
        self.evaluation.rejections.sort(key=lambda r: (r.backend, r.rule))
        return self.evaluation

    def plan(self, stage: str, **known) -> list[Rule]:
        """A plan stage: the rules that fired for the chosen backend/dispatcher, in file order."""
        names = set(self._run({"t": PLAN, "stage": stage, **known}))
        return [r for r in self.compiled.ruleset.plan if r.id in names]

    def _run(self, fact: dict) -> list[str]:
        fired = self.session.run([fact])
        self.evaluation.fired.extend(fired)
        return fired

    def _rejection(self, target: str, rule: Rule) -> Rejection:
        values = {**self.flat, "backend": target}
        detail = MESSAGE_PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), rule.item.message)
        # Every field comes from a validated rule file, so skip re-validation: a decision
        # builds ~30 of these and validation was a fifth of a cold decide.
        return Rejection.model_construct(backend=target, reason=rule.item.reason, detail=detail, rule=rule.id,
                                         source=rule.source)


def effective_order(rules: list[Rule]) -> tuple[list[str], Optional[Rule]]:
    """The platform priority: the first matching base `order`, then demotions/promotions in file order."""
    base = next((rule for rule in rules if rule.item.action == "order"), None)
    order = list(base.item.order) if base else []
    for rule in rules:
        if rule.item.action == "order":
            continue
        moved = [name for name in rule.item.backends if name in order]
        rest = [name for name in order if name not in moved]
        order = rest + moved if rule.item.action == "demote" else moved + rest
    return order, base


def single(rules: list[Rule], what: str) -> Optional[Rule]:
    """At most one rule may decide `what`; two is a rules bug, reported with both locations."""
    if len(rules) > 1:
        places = ", ".join(f"{r.id} ({r.source})" for r in rules)
        raise EngineError(f"conflicting rules decide {what}: {places}; make their conditions disjoint")
    return rules[0] if rules else None


def merged_plan(rules: list[Rule]) -> dict[str, tuple[object, Rule]]:
    """Plan values set by the fired rules; two rules giving one key different values is a conflict."""
    values: dict[str, tuple[object, Rule]] = {}
    for rule in rules:
        for key, value in rule.item.set.values.items():
            if key in values and values[key][0] != value:
                other = values[key][1]
                raise EngineError(f"conflicting plan rules set {key}: {other.id} ({other.source}) says "
                                  f"{values[key][0]!r}, {rule.id} ({rule.source}) says {value!r}")
            values[key] = (value, rule)
    return values

