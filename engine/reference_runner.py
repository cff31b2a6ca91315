"""A small pure-Python evaluator of the same compiled rules, with the same phase semantics.

It runs where durable-rules cannot (Python 3.13+, no C compiler) and is the oracle of the
engine differential test. It reads the compiled JSON conditions, not the rule files, so
both engines execute exactly the same program.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Callable, Iterator

from moerules.engine.compiler import CompiledRule, CompiledRules

_sids = itertools.count(1)
_COMPARE = {"$neq": lambda a, b: a != b, "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b,
            "$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b}


def compile_condition(condition: dict) -> Callable[[dict], bool]:
    """A durable JSON condition as a Python predicate; a missing field matches nothing, as in durable."""
    tests = []
    for key, value in condition.items():
        if key in ("$and", "$or"):
            parts = [compile_condition(item) for item in value]
            tests.append((lambda f, ps=parts: all(p(f) for p in ps)) if key == "$and"
                         else (lambda f, ps=parts: any(p(f) for p in ps)))
        elif key in _COMPARE:
            (path, expected), = value.items()
            tests.append(_comparison(path.split("."), _COMPARE[key], expected))
        else:
            tests.append(_comparison(key.split("."), lambda a, b: a == b, value))
    return tests[0] if len(tests) == 1 else (lambda f: all(t(f) for t in tests))


def _comparison(path: list[str], compare, expected) -> Callable[[dict], bool]:
    def test(fact: dict) -> bool:
        value = fact
        for part in path:
            if not isinstance(value, dict) or part not in value:
                return False
            value = value[part]
        return compare(value, expected)
    return test


class ReferenceRunner:
    name = "reference"

    def __init__(self, compiled: CompiledRules):
        self.compiled = compiled
        self.predicates = {(rule.name, at): compile_condition(pattern.condition)
                           for rule in compiled.rules.values() for at, pattern in enumerate(rule.patterns)}
        # Rules by the type tag of each positive pattern: a new fact can only complete
        # activations of rules that have a positive pattern for its type.
        self.by_tag: dict[str, list[tuple[CompiledRule, int]]] = {}
        for rule in compiled.rules.values():
            for position, pattern in enumerate(rule.patterns):
                if not pattern.negated:
                    self.by_tag.setdefault(_tag(pattern.condition), []).append((rule, position))

    @contextmanager
    def session(self) -> Iterator["_ReferenceSession"]:
        yield _ReferenceSession(self, str(next(_sids)))


def _tag(condition: dict) -> str:
    """The `t` a compiled pattern requires (the compiler puts it first in every pattern)."""
    return condition["t"] if "t" in condition else condition["$and"][0]["t"]


class _ReferenceSession:
    def __init__(self, runner: ReferenceRunner, sid: str):
        self.runner, self.sid = runner, sid
        self.facts: list[dict] = []
        self.by_tag: dict[str, list[int]] = {}
        self.done: set[tuple] = set()  # (rule, matched fact indices): each activation fires once

    def run(self, facts: list[dict]) -> list[str]:
        """Assert facts in order; chain every activation they (and their effects) complete."""
        fired: list[str] = []
        queue = [{"sid": self.sid, **fact} for fact in facts]
        while queue:
            index = len(self.facts)
            fact = queue.pop(0)
            self.facts.append(fact)
            self.by_tag.setdefault(fact["t"], []).append(index)
            for rule, position in self.runner.by_tag.get(fact["t"], ()):
                for activation in self._activations(rule, position, index):
                    if activation not in self.done:
                        self.done.add(activation)
                        fired.append(rule.name)
                        queue.extend(rule.effects(self.sid))
        return fired

    def _activations(self, rule: CompiledRule, position: int, index: int) -> list[tuple]:
        """Activations of `rule` in which the new fact `index` fills pattern `position`."""
        predicates = self.runner.predicates
        if not predicates[rule.name, position](self.facts[index]):
            return []
        choices = []
        for at, pattern in enumerate(rule.patterns):
            if at == position:
                choices.append([index])
                continue
            test = predicates[rule.name, at]
            hits = [i for i in self.by_tag.get(_tag(pattern.condition), ()) if test(self.facts[i])]
            if pattern.negated:
                if hits:
                    return []
                continue
            if not hits:
                return []
            choices.append(hits)
        return [(rule.name,) + combo for combo in itertools.product(*choices)]
