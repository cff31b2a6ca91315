"""Conditions as disjoint cases, so that durable-rules fires each rule at most once per config.

durable-rules fires a rule once per path of its condition that a fact matches, and every
firing is an action to queue and drain: the largest single cost of a decision. A constraint's
violation is `when and not require`, and the negation of a scheme list (`require: (a and b)
or (c and d) ...`) is an `and` of `or`s that a config typically violates in several ways at
once (one layout broke a rule 24 ways). Splitting such a condition on the values of an enum
or bool field it tests (Shannon expansion: `C == or over v of (f == v and C[f := v])`) gives
cases that exclude each other and are each smaller; a case that still has several paths is
split again on another field, and what is left once no such field decides has its `or`s made
exclusive. Each case becomes its own durable rule standing for the same firings; at most one
of them matches a config.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional, Union

from moerules.engine.expr import And, Cmp, Expr, FieldSpec, In, Or, normalize

Known = Callable[[Expr], Optional[bool]]  # a test's truth value where it is known, else None
# A condition that would take more cases than this, or more partial evaluations to find them,
# stays one rule with several paths (compile time stays linear in the rule set).
MAX_CASES = 16
MAX_FOLDS = 256


class _GiveUp(Exception):
    """The split outgrew its budget."""


def fold(expr: Expr, known: Known) -> Union[Expr, bool]:
    """Replace the tests whose truth `known` gives by that value; simplify constants away."""
    if not isinstance(expr, (And, Or)):
        answer = known(expr)
        return expr if answer is None else answer
    items = [fold(item, known) for item in expr.items]
    absorbing = isinstance(expr, Or)  # True absorbs an Or, False absorbs an And
    if absorbing in items:
        return absorbing
    rest = tuple(item for item in items if not isinstance(item, bool))
    if not rest:
        return not absorbing
    return rest[0] if len(rest) == 1 else type(expr)(rest)


def holds(test: Union[Cmp, In], actual) -> bool:
    """Whether a comparison or membership test holds for the value `actual` of its field."""
    if isinstance(test, In):
        return (actual in test.values) != test.negated
    return {"==": actual == test.value, "!=": actual != test.value, "<": actual < test.value,
            "<=": actual <= test.value, ">": actual > test.value, ">=": actual >= test.value}[test.op]


def cases(condition: Expr, paths: Callable[[Expr], int]) -> list[Expr]:
    """Conditions that exclude each other and together match exactly what `condition` matches,
    each with one path where a split on enum/bool fields can give that (`paths` counts them)."""
    try:
        return _split(condition, paths, [MAX_FOLDS])
    except _GiveUp:
        return [condition]


def _split(condition: Expr, paths: Callable[[Expr], int], folds_left: list[int]) -> list[Expr]:
    if paths(condition) == 1:
        return [condition]
    for field in _discrete_fields(condition):
        by_residual: dict[str, tuple[Union[Expr, bool], list]] = {}
        for value in _domain(field):
            folds_left[0] -= 1
            if folds_left[0] < 0:
                raise _GiveUp
            residual = fold(condition, _assigned(field.path, value))
            if residual is not False:
                key = "true" if residual is True else repr(residual)
                by_residual.setdefault(key, (residual, []))[1].append(value)
        if len(by_residual) == 1 and len(next(iter(by_residual.values()))[1]) == len(_domain(field)):
            continue  # the value of this field never decides: try the next one
        result: list[Expr] = []
        for residual, values in by_residual.values():
            test = _membership(field, values)
            subs = [True] if residual is True else _split(residual, paths, folds_left)
            result += [test if sub is True else And((test, sub)) for sub in subs]
            if len(result) > MAX_CASES:
                raise _GiveUp
        return result
    return [exclusive(condition)]


def exclusive(expr: Expr) -> Expr:
    """The same condition with alternatives that exclude each other: `a or b` becomes
    `a or (not a and b)`; for the `or`s left after splitting on every enum and bool field
    (integer ranges such as `cc < 90 or align < 128`)."""
    if isinstance(expr, And):
        return And(tuple(exclusive(item) for item in expr.items))
    if not isinstance(expr, Or):
        return expr
    alternatives: list[Expr] = []
    for index, item in enumerate(expr.items):
        earlier = tuple(exclusive(normalize(other, negate=True)) for other in expr.items[:index])
        alternatives.append(And((*earlier, exclusive(item))) if earlier else exclusive(item))
    return Or(tuple(alternatives))


def _discrete_fields(condition: Expr) -> list[FieldSpec]:
    """The enum and bool fields a condition tests, the most tested first."""
    counts: Counter = Counter()
    stack = [condition]
    while stack:
        expr = stack.pop()
        if isinstance(expr, (And, Or)):
            stack.extend(expr.items)
        elif isinstance(expr, (Cmp, In)) and expr.field.kind in ("enum", "bool"):
            counts[expr.field] += 1
    return sorted(counts, key=lambda field: (-counts[field], field.path))


def _domain(field: FieldSpec) -> tuple:
    return (True, False) if field.kind == "bool" else field.values


def _assigned(path: str, value) -> Known:
    return lambda test: holds(test, value) if isinstance(test, (Cmp, In)) and test.field.path == path else None


def _membership(field: FieldSpec, values: list) -> Expr:
    """`field in values`, written as its shortest test."""
    if len(values) == 1:
        return Cmp(field, "==", values[0])
    others = tuple(value for value in _domain(field) if value not in values)
    return In(field, others, True) if len(others) < len(values) else In(field, tuple(values), False)
