"""Compile a `RuleSet` into durable-rules JSON: single-pattern rules, packed into shards.

The compiler is the only path into durable-rules, so everything durable gets wrong
silently, or fatally, is made impossible here:
- every pattern carries a type tag (`t`), because the engine's own state is a fact too;
- negation is pushed into the comparisons (an expression-level `$not` never fires);
- `in` becomes `$or` of equalities (durable has no `$in`);
- there is no negated pattern at all (durable never revises negation): a component is
  eligible when no rule rejected it, which the evaluator reads off the rejections;
- `backend.*` capabilities are resolved per backend at compile time, so no rule joins a
  backend table at run time, and rules whose conditions come out identical (one
  constraint over many backends) share one durable rule, fired once;
- a condition that one config could match along several paths is split into disjoint
  cases (disjoint.py): durable fires once per matching path, and firings are the largest
  cost of a decision;
- every rule is priced against durable's fixed capacities (`capacity.py`) and the rules of
  one fact type are packed into shards that stay inside them; each shard is its own copy
  of the fact (`s`), so no assert can overflow durable's stack or child tables however
  many rules match; a rule that cannot fit alone is refused with its file:line;
- one rule (`start`) fires on every config, so `delete_state` is always safe.

Facts, each asserted from outside once the previous ones have quiesced:
    cfg           one per shard: the config          -> reject / priority / dispatch rules
    placement     config + plan.backend/dispatcher    -> plan rules of the placement stage
    quantization  ... + plan.expects_unquantized_inputs -> plan rules of the quantization stage
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from operator import itemgetter
from typing import Iterable, Optional, Union

from moerules.decision import SourceRef
from moerules.errors import RuleFileError, RuleSetError
from moerules.engine import capacity
from moerules.engine.disjoint import Known, cases, fold, holds
from moerules.engine.expr import And, Cmp, Expr, In, Not, Or, normalize
from moerules.engine.rulefile import Backend
from moerules.engine.ruleset import Rule, RuleSet

CFG = "cfg"
STAGES = ("placement", "quantization")
TAG, GROUP, SHARD = "t", "g", "s"  # reserved property names of every fact we assert
# Each shard is an `s` equality test and each group of shards a `g` test: durable holds 511
# children per node, so shards come in groups of at most this many (and groups likewise).
SHARDS_PER_GROUP = capacity.CHILD_SLOTS - 11
_OPS = {"!=": "$neq", "<": "$lt", "<=": "$lte", ">": "$gt", ">=": "$gte"}

@dataclass(frozen=True)
class Firing:
    """What a matched condition means in rule-file terms."""

    name: str                   # trace name: "start", "<id>@<component>", or the id
    rule_id: str                # the rule-file id it came from
    kind: str                   # start | reject | priority | dispatch | plan
    target: Optional[str]       # the component a reject firing is about
    source: Optional[SourceRef]


@dataclass(frozen=True)
class CompiledRule:
    """One durable rule: one pattern on one fact type and shard, and every firing it stands for."""

    name: str                   # durable rule name ("r<n>"; it never needs quoting)
    tag: str
    shard: int
    condition: dict             # durable JSON, tag and shard tests included
    firings: tuple[Firing, ...]

    # What a firing of this rule contributes, computed once: a decision reads them for ~100 rules.
    @cached_property
    def trace(self) -> tuple[str, ...]:
        return tuple(firing.name for firing in self.firings)

    @cached_property
    def selects(self) -> tuple[str, ...]:
        """Ids of the priority, dispatch and plan rules it stands for."""
        return tuple(f.rule_id for f in self.firings if f.kind in ("priority", "dispatch", "plan"))

    @cached_property
    def rejects(self) -> tuple[Firing, ...]:
        return tuple(firing for firing in self.firings if firing.kind == "reject")

    @cached_property
    def rejected(self) -> tuple[str, ...]:
        return tuple(firing.target for firing in self.rejects)

    @cached_property
    def cost(self) -> capacity.Cost:
        return price_of(tuple(self.condition["$and"][len(head(self.tag, self.shard)):]))


class CompiledRules:
    """A compiled rule set: durable rules by name, and the shards of each fact type."""

    def __init__(self, ruleset: RuleSet, rules: list[CompiledRule]):
        self.ruleset = ruleset
        self.hash = ruleset.hash
        self.rules = {rule.name: rule for rule in rules}
        self.components = frozenset(ruleset.backends) | frozenset(ruleset.dispatchers)
        # Per fact type, the fields each shard's rules read: a fact carries only those, since
        # durable's cost of an assert grows with the properties of the fact.
        reads: dict[str, dict[int, set[str]]] = {}
        for rule in rules:
            reads.setdefault(rule.tag, {}).setdefault(rule.shard, set()).update(_paths(rule.condition) - set(head(rule.tag, 0)))
        self.reads = {tag: [tuple(sorted(shards[s])) for s in range(len(shards))] for tag, shards in reads.items()}
        # Per fact type, (shard, fields it reads, a getter of their values as a tuple) for each shard.
        self.shards = {tag: [(shard, paths, _values_of(paths)) for shard, paths in enumerate(shards)]
                       for tag, shards in self.reads.items()}
        # Each reject firing's place in a decision's rejections, which are listed by (component, rule).
        rejects = sorted((f for rule in rules for f in rule.rejects), key=lambda f: (f.target, f.rule_id))
        self.reject_rank = {firing.name: rank for rank, firing in enumerate(rejects)}
        # Each firing's place in a decision's trace: rule-file order, the order the rules apply
        # (durable's own firing order within a phase is undocumented and differs run to run).
        position = {rule.id: index for index, rule in enumerate(ruleset.rules())}
        firings = sorted((f for rule in rules for f in rule.firings),
                         key=lambda f: (position.get(f.rule_id, -1), f.name))
        self.trace_rank = {firing.name: rank for rank, firing in enumerate(firings)}

    def durable_definition(self) -> str:
        """The ruleset JSON durable's create_ruleset takes (actions are read from the agenda, not run)."""
        return json.dumps({rule.name: {"all": [{"m": rule.condition}]} for rule in self.rules.values()})


def _values_of(paths: tuple[str, ...]):
    """A getter of the values of `paths` from a fact, as a tuple (itemgetter returns a bare value for one)."""
    if len(paths) == 1:
        path, = paths
        return lambda values: (values[path],)
    return itemgetter(*paths) if paths else (lambda values: ())


def compile_rules(ruleset: RuleSet) -> CompiledRules:
    conditions: dict[str, dict] = {}  # tag -> {condition text: (conjuncts, [firings])}: identical ones merge
    _add(conditions, CFG, True, Firing("start", "start", "start", None, None))
    for rule in ruleset.constraints:
        for target, condition in _violations(rule, ruleset):
            _add(conditions, CFG, condition, Firing(f"{rule.id}@{target}", rule.id, "reject", target, rule.source))
    for kind, rules in (("priority", ruleset.priorities), ("dispatch", ruleset.dispatch)):
        for rule in rules:
            _add(conditions, CFG, _when(rule), Firing(rule.id, rule.id, kind, None, rule.source))
    for rule in ruleset.plan:
        _add(conditions, rule.item.set.stage.value, _plan_condition(rule), Firing(rule.id, rule.id, "plan", None,
                                                                                    rule.source))
    compiled = [rule for tag, entries in conditions.items() for rule in _shards(tag, list(entries.values()))]
    compiled = [replace(rule, name=f"r{index}") for index, rule in enumerate(compiled)]
    if len(compiled) > capacity.RULE_SLOTS:
        raise _whole_set_error(ruleset, f"the rule set compiles to {len(compiled)} durable rules; durable-rules holds "
                               f"{capacity.RULE_SLOTS}", "merge rules with equal conditions, or split the rule set")
    result = CompiledRules(ruleset, compiled)
    widest = max(len(paths) for shards in result.reads.values() for paths in shards)
    if widest + 4 > capacity.FACT_PROPERTIES:  # + sid, t, g, s
        raise _whole_set_error(ruleset, f"a fact would carry {widest + 4} properties; durable-rules holds "
                               f"{capacity.FACT_PROPERTIES}", "rules may read fewer config fields")
    return result


def _add(conditions: dict, tag: str, condition: Union[Expr, bool], firing: Firing) -> None:
    """One durable rule per disjoint case of the condition (disjoint.py), each standing for `firing`."""
    for body in _bodies(condition):
        entry = conditions.setdefault(tag, {}).setdefault(json.dumps(body, sort_keys=True), (body, []))
        entry[1].append(firing)


@lru_cache(maxsize=4096)  # a constraint over many components mostly folds to one condition for all
def _bodies(condition: Union[Expr, bool]) -> tuple[tuple, ...]:
    """The conjuncts of each case of a condition; the condition whole where a case would not fit."""
    if condition is True:
        return ((),)
    whole = _conjuncts(_to_json(condition))
    bodies = tuple(_conjuncts(_to_json(case)) for case in cases(condition, _paths_through))
    return (whole,) if any(price_of(body).excesses() for body in bodies) else bodies


def _paths_through(condition: Expr) -> int:
    return price_of(_conjuncts(_to_json(condition))).paths


def _whole_set_error(ruleset: RuleSet, message: str, hint: str) -> RuleSetError:
    return RuleSetError([RuleFileError(message, file=ruleset.files[0] if ruleset.files else "", hint=hint)])


# -- per kind -------------------------------------------------------------------------------
def _violations(rule: Rule, ruleset: RuleSet) -> Iterable[tuple[str, Union[Expr, bool]]]:
    """(component, condition under which the constraint rejects it), for each component it can reject."""
    item = rule.item
    targets = list(ruleset.backends) if item.applies_to == "all_backends" else item.applies_to
    violated = normalize(And(tuple(e for e in (rule.when, Not(rule.require)) if e is not None)))
    for target in targets:
        declared = ruleset.backends.get(target)
        condition = fold(violated, _declared(declared.item if declared else None))
        if condition is not False:  # False: this backend satisfies the rule by declaration
            yield target, condition


def _when(rule: Rule) -> Union[Expr, bool]:
    return True if rule.when is None else normalize(rule.when)


def _plan_condition(rule: Rule) -> Union[Expr, bool]:
    """The `when` plus the backends/dispatchers the plan rule is restricted to."""
    parts = [] if rule.when is None else [normalize(rule.when)]
    for path, names in (("plan.backend", rule.item.backends), ("plan.dispatcher", rule.item.dispatchers)):
        if names:
            parts.append(_Names(path, tuple(names)))
    return And(tuple(parts)) if parts else True


@dataclass(frozen=True)
class _Names:
    """A test that a plan field names one of the given components."""

    path: str
    names: tuple[str, ...]


def _shards(tag: str, entries: list) -> list[CompiledRule]:
    """Pack the conditions of one fact type, in rule order, into shards within durable's limits."""
    compiled, shard, spent = [], 0, None
    for body, firings in entries:
        price = price_of(body)
        problems = price.excesses()
        if problems:
            raise RuleSetError([_too_big(firings[0], problems)])
        if spent is not None and not (spent + price).fits_shard():
            shard, spent = shard + 1, None
        spent = price if spent is None else spent + price
        compiled.append(CompiledRule("", tag, shard, _tagged(tag, shard, body), tuple(firings)))
    return compiled


def _too_big(firing: Firing, problems: list[str]) -> RuleFileError:
    source = firing.source or SourceRef(file="(compiled)", line=0)
    return RuleFileError(f"this condition cannot be compiled for durable-rules: {'; '.join(problems)}",
                         file=source.file, line=source.line, rule=firing.rule_id,
                         hint="split the rule into several rules, or shorten its 'in' lists")


# -- expressions ------------------------------------------------------------------------------
def _declared(backend: Optional[Backend]) -> Known:
    """The truth of `backend.*` tests, read from a backend's declaration."""
    def known(test: Expr) -> Optional[bool]:
        if not isinstance(test, (Cmp, In)) or test.field.fact != "backend":
            return None
        actual = getattr(backend, test.field.path.split(".", 1)[1])
        return holds(test, actual.value if hasattr(actual, "value") else actual)
    return known


def _tagged(tag: str, shard: int, body: tuple) -> dict:
    return {"$and": [*({name: value} for name, value in head(tag, shard).items()), *body]}


def price_of(body: tuple) -> capacity.Cost:
    """What a rule's own conjuncts cost; the head tests (tag, group, shard) are shared by the whole
    shard, and the shard budgets leave room for them."""
    return capacity.cost({"$and": list(body)}) if body else capacity.Cost(0, 0, 0, 1, 1)


def head(tag: str, shard: int) -> dict:
    """The properties that route a fact to its fact type, group of shards and shard."""
    return {TAG: tag, GROUP: shard // SHARDS_PER_GROUP, SHARD: shard}


def _conjuncts(condition: dict) -> tuple:
    """The conjuncts of a condition, so they join the tag tests in one `$and` group."""
    return tuple(condition["$and"]) if set(condition) == {"$and"} else (condition,)


def _paths(condition: dict) -> set[str]:
    paths = set()
    for key, value in condition.items():
        if key in ("$and", "$or"):
            paths.update(*(_paths(item) for item in value))
        elif key.startswith("$"):
            paths.update(value)
        else:
            paths.add(key)
    return paths


def _to_json(expr) -> dict:
    if isinstance(expr, Cmp):
        return {expr.field.path: expr.value} if expr.op == "==" else {_OPS[expr.op]: {expr.field.path: expr.value}}
    if isinstance(expr, (In, _Names)):
        path, values = (expr.field.path, expr.values) if isinstance(expr, In) else (expr.path, expr.names)
        negated = isinstance(expr, In) and expr.negated
        tests = [{"$neq": {path: v}} if negated else {path: v} for v in values]
        return tests[0] if len(tests) == 1 else {"$and" if negated else "$or": tests}
    key = "$and" if isinstance(expr, And) else "$or"
    items = []
    for item in expr.items:  # nested groups of the same kind flatten: durable counts every group
        part = _to_json(item)
        items.extend(part[key] if set(part) == {key} else [part])
    return items[0] if len(items) == 1 else {key: items}
