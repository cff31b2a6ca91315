"""The durable-rules engine, hardened: our own `Host`, one fresh sid per decision, no timers.

What the wrapper guards against (measured in shared/reference/durable-rules.md):
- `Host.__init__` starts two timer threads that race the decision path (error 307,
  segfaults): `_run` is a no-op here.
- `Ruleset()` deletes keys of the definition it is given: we register a fresh copy.
- A reused sid leaks facts into the next decision, a kept one costs ~1.8 MB and there is
  a cap of 1,024: every decision gets a new sid, deleted in `finally`.
- `delete_state` on a sid where no action ever ran frees garbage: the compiler's
  `start` rule fires on every config.
- Action exceptions are swallowed into the state by `Host`'s Promise machinery: our
  decision loop calls the bound actions itself, so an exception propagates.

The loop talks to the registered ruleset's C handle directly instead of through
`Closure`, whose JSON round trip of the state per action would cost ~25 us per fired
rule (about 1 ms per decision); registration and action binding still go through Host.
"""

from __future__ import annotations

import itertools
import json
import threading
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator

from moerules.errors import EngineError
from moerules.engine.compiler import CompiledRules

try:  # The C extension does not import on Python 3.13+ or where it could not be built.
    import durable_rules_engine as _c
    from durable import engine as _durable
    IMPORT_ERROR = None
except Exception as error:  # noqa: BLE001 - any import failure means "use the reference evaluator"
    _c = _durable = None
    IMPORT_ERROR = f"{type(error).__name__}: {error}"

_RESULT_NOT_HANDLED, _RESULT_OBSERVED = 1, 2
_sids = itertools.count(1)


class _MoeHost(_durable.Host if _durable else object):
    """A Host whose actions are moerules' own closures, with the background timers off."""

    def __init__(self, actions: dict[str, Callable]):
        self._actions = actions
        super().__init__()

    def _run(self):  # no timer threads: nothing may run behind the decision path
        return None

    def get_action(self, action_name: str) -> Callable:
        try:
            return self._actions[action_name]
        except KeyError:
            raise EngineError(f"compiled rules name an unbound action {action_name!r}") from None


class DurableRunner:
    name = "durable"

    def __init__(self, compiled: CompiledRules):
        if _c is None:
            raise EngineError(f"durable-rules is not importable here ({IMPORT_ERROR})")
        self.compiled = compiled
        # Durable calls each action with one positional argument; ours ignore it, since the
        # decision loop below records firings itself.
        actions = {f"fire:{name}": (lambda _context: None) for name in compiled.rules}
        self._host = _MoeHost(actions)
        self._ruleset_name = f"moe_{compiled.hash[:16]}"
        with _quiet():
            self._host.set_rulesets({self._ruleset_name: compiled.durable_definition()})
        self._handle = self._host.get_ruleset(self._ruleset_name)._handle
        self._lock = threading.Lock()

    @contextmanager
    def session(self) -> Iterator["_DurableSession"]:
        with self._lock:
            session = _DurableSession(self, str(next(_sids)))
            try:
                yield session
            finally:
                _c.delete_state(self._handle, session.sid)


class _DurableSession:
    def __init__(self, runner: DurableRunner, sid: str):
        self.runner, self.sid = runner, sid
        self.seen: set[str] = set()
        self.rejected: set[str] = set()

    def run(self, facts: list[dict]) -> list[str]:
        """Assert facts (each from outside, in order) and drain every action they trigger."""
        fired: list[str] = []
        for fact in facts:
            self._assert({"sid": self.sid, **fact}, fired)
        return fired

    def _assert(self, fact: dict, fired: list[str]) -> None:
        handle = self.runner._handle
        state = self._put(fact)
        if state is None:
            return  # no rule reads this fact type in this rule set: nothing to fire
        result = _c.start_action_for_state(handle, state)
        messages = result[1] if result else None
        while messages:
            self._fire(_rule_name(messages), fired)
            messages = _c.complete_and_start_action(handle, state)

    def _fire(self, name: str, fired: list[str]) -> None:
        # durable expands an `$or` into one Rete path per disjunct and fires once per path
        # that matches; every compiled rule matches at most one fact combination per
        # decision, so one firing per rule name is the logical semantics.
        if name in self.seen:
            return
        self.seen.add(name)
        fired.append(name)
        rule = self.runner.compiled.rules[name]
        # Facts asserted while an action is open join the agenda; the next
        # complete_and_start_action picks their activations up (chaining). One reject
        # fact per component is all the eligibility test needs; the rest only cost time.
        if rule.kind == "reject" and rule.target not in self.rejected:
            self.rejected.add(rule.target)
            for effect in rule.effects(self.sid):
                self._put(effect)

    def _put(self, fact: dict):
        code, state = _c.assert_fact(self.runner._handle, json.dumps(fact))
        if code == _RESULT_OBSERVED:
            raise EngineError(f"durable-rules saw the same fact twice: {fact}")
        return None if code == _RESULT_NOT_HANDLED else state


def _rule_name(messages: str) -> str:
    """The rule name of an action's messages, `{"<rule>": {...matched facts...}}`.

    Decoding the whole JSON would parse the matched config fact on every action, which
    was the largest single cost of a decision; rule names never contain quotes.
    """
    return messages[2:messages.index('"', 2)]


@contextmanager
def _quiet():
    """durable.engine triggers a DeprecationWarning per action on 3.12; silence only that one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"durable\..*")
        yield
