"""A small pure-Python evaluator of the same compiled rules, with the same semantics.

It runs where durable-rules cannot (Python 3.13+, no C compiler) and is the oracle of the
engine differential test. It reads the compiled JSON conditions, not the rule files, so
both engines execute exactly the same program: every compiled rule has one pattern, on
one fact type and shard, so a fact fires exactly the rules of its shard that it matches.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from moerules.engine.compiler import CompiledRules, head

_COMPARE = {"$neq": lambda a, b: a != b, "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b,
            "$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b}
_MISSING = object()


def compile_condition(condition: dict) -> Callable[[dict], bool]:
    """A durable JSON condition as a Python predicate over a flat fact (dotted names, as durable
    flattens nested objects); a missing field matches nothing, as in durable."""
    tests = []
    for key, value in condition.items():
        if key in ("$and", "$or"):
            parts = [compile_condition(item) for item in value]
            tests.append((lambda f, ps=parts: all(p(f) for p in ps)) if key == "$and"
                         else (lambda f, ps=parts: any(p(f) for p in ps)))
        elif key == "$nex":
            (path, _), = value.items()
            tests.append(lambda f, path=path: path not in f)
        elif key in _COMPARE:
            (path, expected), = value.items()
            tests.append(_comparison(path, _COMPARE[key], expected))
        else:
            tests.append(_comparison(key, lambda a, b: a == b, value))
    return tests[0] if len(tests) == 1 else (lambda f: all(t(f) for t in tests))


def _comparison(path: str, compare, expected) -> Callable[[dict], bool]:
    def test(fact: dict) -> bool:
        value = fact.get(path, _MISSING)
        return value is not _MISSING and compare(value, expected)
    return test


class ReferenceRunner:
    name = "reference"

    def __init__(self, compiled: CompiledRules):
        self.compiled = compiled
        self.by_shard: dict[tuple[str, int], list[tuple[str, Callable]]] = {}
        for rule in compiled.rules.values():
            self.by_shard.setdefault((rule.tag, rule.shard), []).append((rule.name, compile_condition(rule.condition)))

    @contextmanager
    def session(self) -> Iterator["_ReferenceSession"]:
        yield _ReferenceSession(self)


class _ReferenceSession:
    def __init__(self, runner: ReferenceRunner):
        self.runner = runner

    def run(self, tag: str, bodies: list[tuple[int, dict]]) -> list[str]:
        """The rules the facts of `tag`, (shard, body) each, fire; no rule asserts facts, so nothing chains."""
        fired = []
        for shard, body in bodies:
            fact = {**head(tag, shard), **body}
            fired += [name for name, matches in self.runner.by_shard.get((tag, shard), ()) if matches(fact)]
        return fired
