"""A small pure-Python evaluator of the same compiled rules, with the same phase semantics.

It runs where durable-rules cannot (Python 3.13+, no C compiler) and is the oracle of the
engine differential test. It reads the compiled JSON conditions, not the rule files, so
both engines execute exactly the same program.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Iterator

from moerules.engine.compiler import CompiledRule, CompiledRules

_sids = itertools.count(1)
_COMPARE = {"$neq": lambda a, b: a != b, "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b,
            "$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b}
_MISSING = object()


def matches(condition: dict, fact: dict) -> bool:
    """Evaluate one durable JSON condition; a missing field matches nothing, as in durable."""
    for key, value in condition.items():
        if key == "$and":
            ok = all(matches(item, fact) for item in value)
        elif key == "$or":
            ok = any(matches(item, fact) for item in value)
        elif key in _COMPARE:
            (path, expected), = value.items()
            actual = _lookup(fact, path)
            ok = actual is not _MISSING and _COMPARE[key](actual, expected)
        else:
            ok = _lookup(fact, key) == value
        if not ok:
            return False
    return True


def _lookup(fact: dict, path: str):
    value = fact
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


class ReferenceRunner:
    name = "reference"

    def __init__(self, compiled: CompiledRules):
        self.compiled = compiled

    @contextmanager
    def session(self) -> Iterator["_ReferenceSession"]:
        yield _ReferenceSession(self.compiled, str(next(_sids)))


class _ReferenceSession:
    def __init__(self, compiled: CompiledRules, sid: str):
        self.compiled, self.sid = compiled, sid
        self.facts: list[dict] = []
        self.done: set[tuple] = set()  # (rule, matched fact indices): each activation fires once

    def run(self, facts: list[dict]) -> list[str]:
        fired: list[str] = []
        for fact in facts:
            self.facts.append({"sid": self.sid, **fact})
            self._settle(fired)
        return fired

    def _settle(self, fired: list[str]) -> None:
        """Fire activations until none is left (forward chaining to a fixpoint)."""
        progress = True
        while progress:
            progress = False
            for rule in self.compiled.rules.values():
                for activation in self._activations(rule):
                    if activation in self.done:
                        continue
                    self.done.add(activation)
                    fired.append(rule.name)
                    self.facts.extend(rule.effects(self.sid))
                    progress = True

    def _activations(self, rule: CompiledRule) -> list[tuple]:
        choices = []
        for pattern in rule.patterns:
            hits = [i for i, fact in enumerate(self.facts) if matches(pattern.condition, fact)]
            if pattern.negated:
                if hits:
                    return []
                continue
            if not hits:
                return []
            choices.append(hits)
        return [(rule.name,) + combo for combo in itertools.product(*choices)]
