"""Compile a `RuleSet` into durable-rules JSON, phase by phase.

The compiler is the only path into durable-rules, so everything durable gets wrong
silently is made impossible here:
- every pattern carries a type tag (`t`), because the engine's own state is a fact too;
- negation is pushed into the comparisons (an expression-level `$not` never fires);
- `in` becomes `$or` of equalities (durable has no `$in`);
- the only absence test (`eligible` rules) is gated behind an externally asserted phase
  fact and never placed first, because durable does not revise negation;
- `backend.*` capabilities are resolved per backend at compile time, so no rule joins
  a backend table at run time;
- one rule (`start`) fires on every config, so `delete_state` is always safe.

Phases, each asserted from outside once the previous one has quiesced:
    cfg          -> reject / priority / dispatch rules
    eligibility  -> one `eligible` rule per component: phase fact and no reject fact
    placement    -> plan rules that read the chosen backend and dispatcher
    quantization -> plan rules that also read the placement
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Union

from moerules.decision import SourceRef
from moerules.errors import RuleFileError, RuleSetError
from moerules.engine.expr import And, Cmp, Expr, FieldSpec, In, Not, Or, normalize
from moerules.engine.rulefile import Backend
from moerules.engine.ruleset import Rule, RuleSet

CFG, REJECT, PHASE, PLAN = "cfg", "rej", "phase", "plan"
_OPS = {"!=": "$neq", "<": "$lt", "<=": "$lte", ">": "$gt", ">=": "$gte"}


@dataclass(frozen=True)
class Pattern:
    alias: str
    condition: dict   # durable JSON condition, type tag included
    negated: bool = False


@dataclass(frozen=True)
class CompiledRule:
    name: str                   # unique durable rule name
    rule_id: str                # the rule-file id it came from
    kind: str                   # start | reject | priority | dispatch | eligible | plan
    target: Optional[str]       # component a reject/eligible rule is about
    patterns: tuple[Pattern, ...]
    source: Optional[SourceRef]

    def effects(self, sid: str) -> list[dict]:
        """Facts the rule asserts when it fires (the chaining both engines perform)."""
        if self.kind == "reject":
            return [{"sid": sid, "t": REJECT, "b": self.target, "r": self.name}]
        return []


class CompiledRules:
    """A compiled rule set: durable JSON plus the table that maps rule names back to rule ids."""

    def __init__(self, ruleset: RuleSet, rules: list[CompiledRule]):
        self.ruleset = ruleset
        self.rules = {rule.name: rule for rule in rules}
        self.hash = ruleset.hash

    def durable_definition(self) -> dict:
        """A fresh copy each call: durable's Ruleset() deletes keys from what it is given."""
        definition = {}
        for rule in self.rules.values():
            patterns = [{(p.alias + "$not") if p.negated else p.alias: p.condition} for p in rule.patterns]
            definition[rule.name] = {"all": patterns, "run": f"fire:{rule.name}"}
        return copy.deepcopy(definition)


def compile_rules(ruleset: RuleSet) -> CompiledRules:
    rules = [CompiledRule("start", "start", "start", None, (Pattern("c", {"t": CFG}),), None)]
    for rule in ruleset.constraints:
        rules.extend(_constraint(rule, ruleset))
    for rule in ruleset.priorities:
        rules.extend(_on_config(rule, "priority"))
    for rule in ruleset.dispatch:
        rules.extend(_on_config(rule, "dispatch"))
    for name in list(ruleset.backends) + list(ruleset.dispatchers):
        rules.append(_eligible(name))
    for rule in ruleset.plan:
        rules.extend(_plan(rule))
    return CompiledRules(ruleset, rules)


# -- per kind -------------------------------------------------------------------------------
def _constraint(rule: Rule, ruleset: RuleSet) -> list[CompiledRule]:
    item = rule.item
    targets = list(ruleset.backends) if item.applies_to == "all_backends" else item.applies_to
    violated = And(tuple(e for e in (rule.when, Not(rule.require)) if e is not None))
    compiled = []
    for target in targets:
        declared = ruleset.backends.get(target)
        condition = _fold(normalize(violated), declared.item if declared else None)
        if condition is False:
            continue  # this backend satisfies the rule by declaration
        name = f"{item.id}@{target}"
        compiled.append(CompiledRule(name, item.id, "reject", target,
                                     (Pattern("c", _tagged(CFG, condition)),), rule.source))
    return compiled


def _on_config(rule: Rule, kind: str) -> list[CompiledRule]:
    condition = True if rule.when is None else normalize(rule.when)
    return [CompiledRule(rule.id, rule.id, kind, None, (Pattern("c", _tagged(CFG, condition)),), rule.source)]


def _eligible(target: str) -> CompiledRule:
    phase = Pattern("p", {"$and": [{"t": PHASE}, {"n": "eligibility"}]})
    no_reject = Pattern("r", {"$and": [{"t": REJECT}, {"b": target}]}, negated=True)
    return CompiledRule(f"eligible@{target}", "eligible", "eligible", target, (phase, no_reject), None)


def _plan(rule: Rule) -> list[CompiledRule]:
    item = rule.item
    config_part: list[Expr] = []
    plan_part: list[Expr] = []
    when = normalize(rule.when) if rule.when is not None else And(())
    for conjunct in (when.items if isinstance(when, And) else (when,)):
        facts = _facts_of(conjunct)
        if facts == {"plan"}:
            plan_part.append(conjunct)
        elif facts == {"cfg"}:
            config_part.append(conjunct)
        else:
            raise RuleSetError([RuleFileError("join plan.* tests to config tests with a top-level 'and'",
                                              file=rule.source.file, line=rule.source.line, rule=item.id)])
    for field, names in (("backend", item.backends), ("dispatcher", item.dispatchers)):
        if names:
            plan_part.append(In(FieldSpec(f"plan.{field}", "enum", fact="plan"), tuple(names), False))
    stage = item.set.stage.value
    plan_condition = _to_json(And(tuple(plan_part)), strip="plan.") if plan_part else None
    patterns = [Pattern("p", {"$and": [{"t": PLAN}, {"stage": stage}] + ([plan_condition] if plan_condition else [])})]
    if config_part:
        patterns.append(Pattern("c", _tagged(CFG, And(tuple(config_part)))))
    return [CompiledRule(item.id, item.id, "plan", None, tuple(patterns), rule.source)]


# -- expressions ------------------------------------------------------------------------------
def _fold(expr: Expr, backend: Optional[Backend]) -> Union[Expr, bool]:
    """Resolve `backend.*` tests against a backend's declaration; simplify constants away."""
    if isinstance(expr, (Cmp, In)):
        if expr.field.fact != "backend":
            return expr
        actual = getattr(backend, expr.field.path.split(".", 1)[1])
        actual = actual.value if hasattr(actual, "value") else actual
        if isinstance(expr, In):
            return (actual in expr.values) != expr.negated
        return _compare(actual, expr.op, expr.value)
    items = [_fold(item, backend) for item in expr.items]
    absorbing = isinstance(expr, Or)  # True absorbs an Or, False absorbs an And
    if absorbing in items:
        return absorbing
    rest = tuple(item for item in items if not isinstance(item, bool))
    if not rest:
        return not absorbing
    return rest[0] if len(rest) == 1 else type(expr)(rest)


def _compare(left, op: str, right) -> bool:
    return {"==": left == right, "!=": left != right, "<": left < right, "<=": left <= right,
            ">": left > right, ">=": left >= right}[op]


def _tagged(fact: str, condition: Union[Expr, bool]) -> dict:
    if condition is True or (isinstance(condition, And) and not condition.items):
        return {"t": fact}
    return {"$and": [{"t": fact}, _to_json(condition)]}


def _to_json(expr: Expr, strip: str = "") -> dict:
    if isinstance(expr, Cmp):
        path = expr.field.path[len(strip):]
        return {path: expr.value} if expr.op == "==" else {_OPS[expr.op]: {path: expr.value}}
    if isinstance(expr, In):
        path = expr.field.path[len(strip):]
        tests = [{"$neq": {path: v}} if expr.negated else {path: v} for v in expr.values]
        return tests[0] if len(tests) == 1 else {"$and" if expr.negated else "$or": tests}
    items = [_to_json(item, strip) for item in expr.items]
    if len(items) == 1:
        return items[0]
    return {"$and" if isinstance(expr, And) else "$or": items}


def _facts_of(expr: Expr) -> set[str]:
    if isinstance(expr, (Cmp, In)):
        return {expr.field.fact}
    return set().union(*(_facts_of(item) for item in expr.items))

