"""Run the compiled phases for one config and collect what fired, in rule-file terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter, itemgetter
from typing import Callable, Optional

from moerules.config import MoEConfig
from moerules.decision import RankStep, Rejection
from moerules.errors import EngineError
from moerules.engine.compiler import CFG, CompiledRule, CompiledRules, Firing
from moerules.engine.rulefile import MESSAGE_PLACEHOLDER
from moerules.engine.ruleset import Rule


_BACKEND = attrgetter("backend")


@dataclass
class Evaluation:
    """The facts a decision is assembled from."""

    rejections: list[Rejection] = field(default_factory=list)
    eligible: set[str] = field(default_factory=set)
    priority_rules: list[Rule] = field(default_factory=list)
    dispatch_rules: list[Rule] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)
    _by_component: Optional[dict[str, list[Rejection]]] = field(default=None, init=False, repr=False)

    def rejections_of(self, component: str) -> list[Rejection]:
        """A component's rejections, from a table built on first use (a decision may ask for many)."""
        if self._by_component is None:  # the rejections are listed by component, then rule
            self._by_component = {backend: list(group) for backend, group in groupby(self.rejections, _BACKEND)}
        return self._by_component.get(component, [])


class PhaseRunner:
    """Drives one session of a runner through the facts of a decision (see compiler.py)."""

    def __init__(self, compiled: CompiledRules, session, config: MoEConfig, rejections: "Rejections",
                 memo: "ShardMemo"):
        self.compiled, self.session, self.config, self.rejections, self.memo = (compiled, session, config,
                                                                                rejections, memo)
        self.flat = config.facts()
        self.evaluation = Evaluation()

    def screen(self) -> Evaluation:
        """The config: rejections, eligible components (those no rule rejected), priority and dispatch rules."""
        compiled, evaluation, flat = self.compiled, self.evaluation, self.flat
        ranked, ids, rejected = [], set(), set()
        for rule in self._run(CFG, flat):  # ~100 rules at several times today's rule set: only what each carries
            if rule.rejects:
                ranked += self.rejections.of(rule, flat)
                rejected.update(rule.rejected)
            if rule.selects:
                ids.update(rule.selects)
        evaluation.eligible = set(compiled.components - rejected)
        # Keep rule-file order, never firing order: durable fires matches in no documented order.
        evaluation.priority_rules = [r for r in compiled.ruleset.priorities if r.id in ids]
        evaluation.dispatch_rules = [r for r in compiled.ruleset.dispatch if r.id in ids]
        ranked.sort()
        evaluation.rejections = [rejection for _, rejection in ranked]
        return evaluation

    def plan(self, stage: str, **known) -> list[Rule]:
        """A plan stage: the rules that fired for the chosen backend/dispatcher, in file order."""
        fired = self._run(stage, {**self.flat, **{f"plan.{name}": value for name, value in known.items()}})
        ids = {rule_id for rule in fired for rule_id in rule.selects}
        return sorted(map(self.compiled.ruleset.rule, ids), key=self.compiled.ruleset.position)

    def _run(self, tag: str, values: dict) -> list[CompiledRule]:
        """The rules a fact of `tag` fires in each of its shards: remembered where the shard saw the
        same fields before, else asserted with the fields that shard reads."""
        compiled, memo = self.compiled, self.memo
        names: list[str] = []
        unseen: list[tuple[int, tuple, dict]] = []
        for shard, reads, read in compiled.shards.get(tag, ()):
            key = (tag, shard, read(values))
            seen = memo.get(key)
            if seen is None:
                unseen.append((shard, key, dict(zip(reads, key[2]))))
            else:
                names += seen
        if unseen:
            by_shard: dict[int, list[str]] = {shard: [] for shard, _, _ in unseen}
            for name in self.session.run(tag, [(shard, body) for shard, _, body in unseen]):
                by_shard[compiled.rules[name].shard].append(name)
            for shard, key, _ in unseen:
                memo.put(key, tuple(by_shard[shard]))
                names += by_shard[shard]
        fired = [compiled.rules[name] for name in names]
        # The trace keeps phase order (screen, then each plan stage), each phase in rule-file order.
        self.evaluation.fired += sorted([name for rule in fired for name in rule.trace],
                                        key=compiled.trace_rank.__getitem__)
        return fired


class ShardMemo:
    """The rules each shard fired, by the values of the fields it reads.

    A compiled rule has one pattern on one shard's fact and no rule asserts a fact, so what a
    shard fires depends on those fields alone. Configs that differ in a few fields (the cells
    of a matrix, the layers of a model, lint's coverage configs) assert only the shards that
    read them; the first sight of every shard's fields runs the engine as before.
    """

    _SIZE = 1 << 15  # entries kept; past it the table starts over (bounded memory)

    def __init__(self):
        self._fired: dict[tuple, tuple[str, ...]] = {}

    def get(self, key: tuple) -> Optional[tuple[str, ...]]:
        return self._fired.get(key)

    def put(self, key: tuple, names: tuple[str, ...]) -> None:
        if len(self._fired) >= self._SIZE:
            self._fired.clear()
        self._fired[key] = names

    def clear(self) -> None:
        self._fired.clear()


class Rejections:
    """The rejection records of one rule set, built once per (compiled rule, quoted config values).

    A decision records ~30 rejections at today's rule set and well over 100 at several times
    its size; most recur from config to config with the same messages, and formatting and
    constructing each record was the largest cost of a cold decide.
    """

    _SIZE = 1 << 14  # entries kept; past it the table starts over (bounded memory)

    def __init__(self, compiled: CompiledRules):
        self.compiled, self.ruleset = compiled, compiled.ruleset
        self._quoted: dict[str, Callable[[dict], object]] = {}
        self._built: dict[tuple, tuple[tuple[int, Rejection], ...]] = {}

    def of(self, rule: CompiledRule, flat: dict) -> tuple[tuple[int, Rejection], ...]:
        """The rejections a fired rule records, each with its rank in a decision's list."""
        quoted = self._quoted.get(rule.name)
        if quoted is None:
            quoted = self._quoted[rule.name] = self._quotes(rule)
        key = (rule.name, quoted(flat))
        built = self._built.get(key)
        if built is None:
            if len(self._built) >= self._SIZE:
                self._built.clear()
            ranks = self.compiled.reject_rank
            built = self._built[key] = tuple((ranks[f.name], self._build(f, flat)) for f in rule.rejects)
        return built

    def _quotes(self, rule: CompiledRule) -> Callable[[dict], object]:
        """The config values a rule's messages quote ({backend} is the firing's own), as one getter."""
        names = sorted({name for firing in rule.rejects
                        for name in MESSAGE_PLACEHOLDER.findall(self.ruleset.rule(firing.rule_id).item.message)}
                       - {"backend"})
        return itemgetter(*names) if names else (lambda flat: None)

    def _build(self, firing: Firing, flat: dict) -> Rejection:
        values = {**flat, "backend": firing.target}
        item = self.ruleset.rule(firing.rule_id).item
        detail = MESSAGE_PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), item.message)
        # Every field comes from a validated rule file, so skip re-validation.
        return Rejection.model_construct(backend=firing.target, reason=item.reason, detail=detail, rule=item.id,
                                         source=firing.source)


def effective_order(rules: list[Rule]) -> tuple[list[str], Optional[Rule]]:
    """The platform priority: the first matching base `order`, then demotions/promotions in file order."""
    return ranking(rules)[0], next((rule for rule in rules if rule.item.action == "order"), None)


def ranking(rules: list[Rule]) -> tuple[list[str], list[RankStep]]:
    """The platform priority and the steps that built it: the base order, then each promote/demote
    (in file order) that changed it. A step that moved nothing is not a step."""
    base = next((rule for rule in rules if rule.item.action == "order"), None)
    order = list(base.item.order) if base else []
    steps = [_step(base, order, order)] if base else []
    for rule in rules:
        if rule.item.action == "order":
            continue
        moved = [name for name in rule.item.backends if name in order]
        rest = [name for name in order if name not in moved]
        before, order = order, rest + moved if rule.item.action == "demote" else moved + rest
        if order != before:
            steps.append(_step(rule, moved, order))
    return order, steps


def _step(rule: Rule, moved: list[str], order: list[str]) -> RankStep:
    # Every field comes from a validated rule file, so skip re-validation (matrix ranks ~10^5 configs).
    return RankStep.model_construct(rule=rule.id, source=rule.source, action=rule.item.action,
                                    moved=tuple(moved), order=tuple(order), cite=rule.item.cite)


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

