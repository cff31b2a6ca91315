"""Run the compiled phases for one config and collect what fired, in rule-file terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from moerules.config import MoEConfig
from moerules.decision import Rejection
from moerules.errors import EngineError
from moerules.engine.compiler import CFG, REJECT, CompiledRules, Firing
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
    """Drives one session of a runner through the facts of a decision (see compiler.py)."""

    def __init__(self, compiled: CompiledRules, session, config: MoEConfig, rejections: Rejections):
        self.compiled, self.session, self.config, self.rejections = compiled, session, config, rejections
        self.facts = config.facts()
        self.flat = flatten(self.facts)
        self.evaluation = Evaluation()

    def screen(self) -> Evaluation:
        """The config, then the rejected components: rejections, eligible components, priority and dispatch rules."""
        firings = self._run(CFG, self.flat)
        rejected = {firing.target for firing in firings if firing.kind == "reject"}
        firings += self._run(REJECT, {f"b{i}": 1 for i, name in enumerate(self.compiled.components) if name in rejected})
        ruleset = self.compiled.ruleset
        names = set()
        for firing in firings:
            names.add(firing.rule_id)
            if firing.kind == "reject":
                self.evaluation.rejections.append(
                    self.rejections.get(ruleset.rule(firing.rule_id), firing.target, self.flat))
            elif firing.kind == "eligible":
                self.evaluation.eligible.add(firing.target)
        # Keep rule-file order, never firing order: durable fires matches in no documented order.
        self.evaluation.priority_rules = [r for r in ruleset.priorities if r.id in names]
        self.evaluation.dispatch_rules = [r for r in ruleset.dispatch if r.id in names]
        self.evaluation.rejections.sort(key=lambda r: (r.backend, r.rule))
        return self.evaluation

    def plan(self, stage: str, **known) -> list[Rule]:
        """A plan stage: the rules that fired for the chosen backend/dispatcher, in file order."""
        names = {firing.rule_id for firing in self._run(stage, {**self.flat, **flatten(known, "plan.")})}
        return [r for r in self.compiled.ruleset.plan if r.id in names]

    def _run(self, tag: str, values: dict) -> list[Firing]:
        """Assert a fact of `tag` in each of its shards, with the fields that shard reads; the firings, traced."""
        compiled, firings = self.compiled, []
        for (fact_tag, shard), reads in compiled.reads.items():
            if fact_tag == tag:
                body = {path: values[path] for path in reads if path in values}
                firings += [firing for name in self.session.run(tag, shard, body)
                            for firing in compiled.rules[name].firings]
        self.evaluation.fired.extend(firing.name for firing in firings)
        return firings


class Rejections:
    """The rejection records of one rule set, built once per (rule, component, quoted values).

    A decision records ~30 rejections and most recur from config to config with the same
    message; formatting and constructing each was the largest cost of a cold decide.
    """

    _SIZE = 1 << 16  # records kept; past it the table starts over (bounded memory)

    def __init__(self):
        self._quotes: dict[str, tuple[str, ...]] = {}
        self._built: dict[tuple, Rejection] = {}

    def get(self, rule: Rule, target: str, flat: dict) -> Rejection:
        quotes = self._quotes.get(rule.id)
        if quotes is None:
            quotes = self._quotes[rule.id] = tuple(MESSAGE_PLACEHOLDER.findall(rule.item.message))
        key = (rule.id, target) + tuple(flat.get(name) for name in quotes)
        built = self._built.get(key)
        if built is None:
            if len(self._built) >= self._SIZE:
                self._built.clear()
            built = self._built[key] = self._build(rule, target, flat)
        return built

    @staticmethod
    def _build(rule: Rule, target: str, flat: dict) -> Rejection:
        values = {**flat, "backend": target}
        detail = MESSAGE_PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), rule.item.message)
        # Every field comes from a validated rule file, so skip re-validation.
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

