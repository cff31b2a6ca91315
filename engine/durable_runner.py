"""The durable-rules engine, hardened: the C core driven directly, one fresh sid per decision.

What the wrapper guards against (measured in shared/reference/durable-rules.md):
- `durable.engine.Host` starts two timer threads that race the decision path (error 307,
  segfaults) and round-trips the state through JSON per action: we never build a Host;
  the ruleset is created, its agenda drained and its state deleted through the C
  extension's own functions.
- A reused sid leaks facts into the next decision, and each new sid costs time in
  proportion to the rule set: one sid serves every decision of a runner, and each
  decision retracts every fact it asserted (a failed decision gives its sid up instead).
- `delete_state` on a sid where no action ever ran frees garbage: the compiler's `start`
  rule fires on every config, and a failed sid is deleted only if an action ran.
- A ruleset is never freed by durable itself (~1 MB each): `delete_ruleset` runs when the
  runner is garbage-collected, so dropping an Engine releases it.
- Capacity faults (stack overflow, full child tables) abort or hang the process: the
  compiler packs rules into shards within durable's limits (capacity.py) before
  `create_ruleset` sees them.
"""

from __future__ import annotations

import itertools
import json
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator

from moerules.errors import EngineError
from moerules.engine.compiler import SHARD, TAG, CompiledRules

try:  # The C extension does not import on Python 3.13+ or where it could not be built.
    import durable_rules_engine as _c
    IMPORT_ERROR = None
except Exception as error:  # noqa: BLE001 - any import failure means "use the reference evaluator"
    _c = None
    IMPORT_ERROR = f"{type(error).__name__}: {error}"

_RESULT_NOT_HANDLED, _RESULT_OBSERVED = 1, 2
_sids = itertools.count(1)
_names = itertools.count(1)


class DurableRunner:
    name = "durable"

    def __init__(self, compiled: CompiledRules):
        if _c is None:
            raise EngineError(f"durable-rules is not importable here ({IMPORT_ERROR})")
        self.compiled = compiled
        try:
            self._handle = _c.create_ruleset(f"moe_{compiled.hash[:16]}_{next(_names)}",
                                             compiled.durable_definition())
        except _c.error as error:  # the compiler's checks make this a bug of ours, not of the rules
            raise EngineError(f"durable-rules refused the compiled rules ({error}); please report it") from None
        weakref.finalize(self, _c.delete_ruleset, self._handle)
        self._lock = threading.Lock()
        self._sid = str(next(_sids))

    @contextmanager
    def session(self) -> Iterator["_DurableSession"]:
        """One decision. Its facts are retracted afterwards, so the next decision reuses the sid:
        creating a sid allocates durable's frame tables for every rule (~35 us at 130 rules,
        growing with the rule set), retracting five facts costs a few. A decision that fails
        part-way leaves its sid behind, deleted, and the next one starts a fresh sid."""
        with self._lock:
            session = _DurableSession(self._handle, self._sid)
            try:
                yield session
                session.retract_all()
            except BaseException:
                self._sid = str(next(_sids))
                session.discard()
                raise


class _DurableSession:
    def __init__(self, handle: int, sid: str):
        self.handle, self.sid = handle, sid
        self._prefix = f'{{"sid":"{sid}","{TAG}":'
        self._asserted: list[str] = []
        self._acted = False

    def run(self, tag: str, shard: int, body: dict) -> list[str]:
        """Assert one fact and drain the agenda: the names of the rules it fired, each once."""
        # durable expands an `$or` into one Rete path per disjunct and fires once per path
        # that matches; each compiled rule has one pattern, so one firing per name is the
        # logical semantics.
        text = f'{self._prefix}"{tag}","{SHARD}":{shard}' + (f",{json.dumps(body)[1:]}" if body else "}")
        code, state = self._call(_c.assert_fact, text)
        self._asserted.append(text)
        if code == _RESULT_OBSERVED:
            raise EngineError(f"durable-rules already holds this fact (a previous decision left it): {text}")
        if code == _RESULT_NOT_HANDLED:
            return []  # no rule of this shard reads this fact
        fired: dict[str, None] = {}
        result = self._call(_c.start_action_for_state, state)
        messages = result[1] if result else None
        while messages:
            self._acted = True
            fired[_rule_name(messages)] = None
            messages = self._call(_c.complete_and_start_action, state)
        return list(fired)

    def retract_all(self) -> None:
        for text in self._asserted:
            self._call(_c.retract_fact, text)
        self._asserted.clear()

    def discard(self) -> None:
        """Give the sid up after a failure. durable's delete_state frees an uninitialised
        pointer when no action ever started in the sid, so such a sid is left in place."""
        if self._acted:
            _c.delete_state(self.handle, self.sid)

    def _call(self, function, argument):
        try:
            return function(self.handle, argument)
        except _c.error as error:
            raise EngineError(f"durable-rules failed in {function.__name__} ({error}); please report it") from None


def _rule_name(messages: str) -> str:
    """The rule name of an action's messages, `{"<rule>": {...matched facts...}}`.

    Decoding the whole JSON would parse the matched config fact on every action, which
    was the largest single cost of a decision; compiled rule names never contain quotes.
    """
    return messages[2:messages.index('"', 2)]
