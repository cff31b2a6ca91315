"""The durable-rules engine, hardened: the C core driven directly, one sid reused by every decision.

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
- A ruleset is never freed by durable itself, and `delete_ruleset` leaves the memory of its
  states behind (~1.7 MB each): when the runner is garbage-collected its live sid is deleted,
  then its ruleset, so dropping an Engine releases both.
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
from moerules.engine.compiler import CompiledRules, head

try:  # The C extension does not import on Python 3.13+ or where it could not be built.
    import durable_rules_engine as _c
    IMPORT_ERROR = None
except Exception as error:  # noqa: BLE001 - any import failure means "use the reference evaluator"
    _c = None
    IMPORT_ERROR = f"{type(error).__name__}: {error}"

_RESULT_OBSERVED = 2
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
        self._lock = threading.Lock()
        self._sid = str(next(_sids))
        self._live: set[str] = set()  # sids holding state (an action ran in them)
        weakref.finalize(self, _release, self._handle, self._live)

    @contextmanager
    def session(self) -> Iterator["_DurableSession"]:
        """One decision. Its facts are retracted afterwards, so the next decision reuses the sid:
        creating a sid allocates durable's frame tables for every rule (~35 us at 130 rules,
        growing with the rule set), retracting five facts costs a few. A decision that fails
        part-way leaves its sid behind, deleted, and the next one starts a fresh sid."""
        with self._lock:
            session = _DurableSession(self._handle, self._sid, acted=self._sid in self._live)
            try:
                yield session
                session.retract_all()
            except BaseException:
                self._sid = str(next(_sids))
                session.discard()
                self._live.discard(session.sid)
                raise
            if session.acted:
                self._live.add(session.sid)


class _DurableSession:
    def __init__(self, handle: int, sid: str, acted: bool):
        self.handle, self.sid = handle, sid
        self._asserted: list[str] = []
        self.acted = acted  # an action has run in this sid (now or in an earlier decision)

    def run(self, tag: str, bodies: list[tuple[int, dict]]) -> list[str]:
        """Assert the facts of `tag`, (shard, body) each, and drain the agenda: the names of the
        rules they fired, each once."""
        # One assert_facts call for all shards: durable processes every fact of the array (its
        # result code says only whether some fact matched nothing, so it is not read) and
        # queues their actions in the sid, drained below.
        # durable also fires once per matching path of an `$or`; each compiled rule has one
        # pattern, so one firing per name is the logical semantics.
        if not bodies:
            return []
        array = json.dumps([{"sid": self.sid, **head(tag, shard), **body} for shard, body in bodies])
        fired: dict[str, None] = {}
        try:
            code, state = _c.assert_facts(self.handle, array)
            self._asserted.append(array)
            if code == _RESULT_OBSERVED:
                raise EngineError(f"durable-rules already holds one of these facts (left by an earlier decision): {array}")
            next_action, complete = _c.start_action_for_state, _c.complete_and_start_action
            result = next_action(self.handle, state)
            messages = result[1] if result else None
            while messages:
                self.acted = True
                fired[messages[2:messages.index('"', 2)]] = None  # {"<rule>": {...}}: names never hold quotes
                messages = complete(self.handle, state)
        except _c.error as error:
            raise EngineError(f"durable-rules failed on a {tag} fact ({error}); please report it") from None
        return list(fired)

    def retract_all(self) -> None:
        try:
            for array in self._asserted:
                _c.retract_facts(self.handle, array)
        except _c.error as error:
            raise EngineError(f"durable-rules failed to retract a decision's facts ({error}); please report it") from None
        self._asserted.clear()

    def discard(self) -> None:
        """Give the sid up after a failure. durable's delete_state frees an uninitialised
        pointer when no action ever started in the sid, so such a sid is left in place."""
        if self.acted:
            _c.delete_state(self.handle, self.sid)


def _release(handle: int, live_sids: set[str]) -> None:
    """Free a ruleset: durable's delete_ruleset frees the state table but not what each state
    holds (~1.7 MB of frame tables at 130 rules), so live states are deleted first."""
    for sid in live_sids:
        _c.delete_state(handle, sid)
    _c.delete_ruleset(handle)
