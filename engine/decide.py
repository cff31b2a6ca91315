"""`decide`: config in, `Decision` out; pure, deterministic and cached.

Policy lives here, not in the rules: a pinned backend is honoured or the call fails
naming the rule that rejected it; auto mode may degrade, and every degradation is
recorded in the Decision and logged once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Union

from moerules.config import MoEConfig
from moerules.decision import (Decision, ExpertPlacement, Outcome, Padding, QuantizedBy, QuantPlacement,
                               ReasonCode, SelectedBy)
from moerules.errors import BackendRejectedError, EngineError, RuleFileError, RuleSetError, UnknownBackendError
from moerules.engine.compiler import CompiledRules, compile_rules
from moerules.engine.evaluate import (Evaluation, PhaseRunner, Rejections, ShardMemo, merged_plan, ranking,
                                      single)
from moerules.engine.expr import suggest
from moerules.engine.misses import decisive, nearest_miss
from moerules.engine.loader import load_rules
from moerules.engine.textfile import is_folder
from moerules.engine.reference_runner import ReferenceRunner
from moerules.engine.ruleset import RuleSet
from moerules.engine import durable_runner

log = logging.getLogger("moerules")
RulesArg = Union[RuleSet, str, Path, None]
_CACHE_SIZE = 4096


class Engine:
    """One rule-set version, compiled once, bound to one evaluator, with an LRU of decisions."""

    def __init__(self, ruleset: RuleSet, engine: str = "auto"):
        self.ruleset = ruleset
        self.compiled: CompiledRules = compile_rules(ruleset)
        self.runner = _make_runner(self.compiled, engine)
        self.rejections = Rejections(self.compiled)
        self.memo = ShardMemo()
        self._cache: OrderedDict[tuple, Decision] = OrderedDict()
        self._by_identity: dict[int, tuple[MoEConfig, Decision]] = {}
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.runner.name

    def decide(self, config: MoEConfig, *, quiet: bool = False) -> Decision:
        """The (cached) decision; `quiet` skips the fallback log line (bulk tools such as matrix)."""
        # Engines ask once per layer with the same frozen config object: an identity hit skips
        # even the key. The entry holds the config, so its id is not reused while it is there.
        entry = self._by_identity.get(id(config))
        if entry is not None and entry[0] is config:
            return self._returned(entry[1])
        self._check_pin(config)
        key = _config_key(config)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._remember(config, cached)
        if cached is None:
            cached = self._evaluate(config)
            if cached.fallback_rule and not quiet:  # logged once per (rules, config): later hits come from the cache
                log.warning("moerules: %s", fallback_message(cached, self.ruleset))
            with self._lock:
                self._cache[key] = cached
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
                self._remember(config, cached)
        return self._returned(cached)

    def _remember(self, config: MoEConfig, decision: Decision) -> None:
        self._by_identity[id(config)] = (config, decision)
        if len(self._by_identity) > _CACHE_SIZE:
            self._by_identity.pop(next(iter(self._by_identity)))

    @staticmethod
    def _returned(decision: Decision) -> Decision:
        if decision.outcome == Outcome.unsupported and decision.requested != "auto":
            raise BackendRejectedError(decision)
        return decision

    def _check_pin(self, config: MoEConfig) -> None:
        requested = config.features.backend
        if requested != "auto" and requested not in self.ruleset.backends:
            names = sorted(self.ruleset.backends)
            raise UnknownBackendError(requested, names, suggest(requested, names))

    def _evaluate(self, config: MoEConfig) -> Decision:
        return self.evaluate(config)[0]

    def evaluate(self, config: MoEConfig) -> tuple[Decision, Evaluation]:
        """One uncached evaluation, with the facts the decision was assembled from (lint reads them)."""
        with self.runner.session() as session:
            phases = PhaseRunner(self.compiled, session, config, self.rejections, self.memo)
            assembler = Assembler(self, config, phases)
            return assembler.run(), assembler.evaluation


class Assembler:
    """Turns what fired into a Decision: ranking, selection, dispatch plan, padding."""

    def __init__(self, engine: Engine, config: MoEConfig, phases: PhaseRunner):
        self.engine, self.config, self.phases = engine, config, phases
        self.ruleset = engine.ruleset
        self.requested = config.features.backend
        self.ranking: list = []  # set once the priority is known; an earlier failure has none

    def run(self) -> Decision:
        self.evaluation = evaluation = self.phases.screen()
        dispatch_rule = single(evaluation.dispatch_rules, "the prepare/finalize")
        if dispatch_rule is None:
            return self._unsupported(evaluation, "no prepare/finalize rule matches this parallel configuration "
                                     f"(all2all_backend={self.config.parallel.all2all_backend.value}, "
                                     f"use_all2all={self.config.parallel.use_all2all}); "
                                     "expert parallelism never runs without a dispatcher", ReasonCode.no_dispatcher)
        dispatcher = dispatch_rule.item.use
        if dispatcher not in evaluation.eligible:
            rejections = evaluation.rejections_of(dispatcher)
            reasons = "; ".join(r.describe() for r in rejections)
            return self._unsupported(evaluation, f"prepare/finalize {dispatcher} (chosen by {dispatch_rule.id}) "
                                     f"is rejected: {reasons}", decisive(rejections).reason)
        order, self.ranking = ranking(evaluation.priority_rules)
        eligible = [b for b in order if b in evaluation.eligible]
        # Eligible backends a platform list omits stay pinnable; lint reports the omission.
        eligible += sorted(b for b in evaluation.eligible if b in self.ruleset.backends and b not in order)
        winner, selected_by, fallback = self._choose(evaluation, order)
        if winner is None:
            return self._no_backend(evaluation, order, eligible, dispatcher)
        return self._selected(evaluation, winner, dispatcher, selected_by, fallback,
                              [b for b in eligible if b != winner])

    def _choose(self, evaluation: Evaluation, order: list[str]):
        if self.requested != "auto":
            if self.requested in evaluation.eligible:
                return self.requested, SelectedBy.pinned, None
            return None, None, None
        auto = [b for b in order if b in evaluation.eligible]
        if not auto:
            return None, None, None
        winner = auto[0]
        fallback = displaced(self.ruleset, evaluation.rejections_of, order[:order.index(winner)])
        return winner, (SelectedBy.fallback if fallback else SelectedBy.auto), fallback and fallback[1].id

    def _no_backend(self, evaluation: Evaluation, order: list[str], eligible: list[str], dispatcher: str) -> Decision:
        """Unsupported: a pinned backend that was rejected, or (auto) no eligible backend in the priority."""
        candidates = [self.requested] if self.requested != "auto" else order or sorted(self.ruleset.backends)
        packages = {name: [p.value for p in self.ruleset.backends[name].item.packages]
                    for name in candidates if name in self.ruleset.backends}
        miss = nearest_miss(evaluation.rejections, candidates, packages)
        if self.requested != "auto":
            rejections = evaluation.rejections_of(self.requested)
            reasons = "; ".join(r.describe() for r in rejections)
            error = (f"requested backend {self.requested!r} is rejected: {reasons}. "
                     f"Eligible alternatives: {', '.join(eligible) or 'none'}")
            return self._unsupported(evaluation, error, decisive(rejections).reason, dispatcher, miss)
        ranked = f"all {len(order)} backends of the platform priority are" if order else \
            "no platform priority rule matches this config, and every backend is"
        error = f"no backend supports this configuration: {ranked} rejected; nearest: {miss}"
        return self._unsupported(evaluation, error, ReasonCode.no_eligible_backend, dispatcher, miss)

    def _selected(self, evaluation, winner, dispatcher, selected_by, fallback, alternatives) -> Decision:
        backend = self.ruleset.backends[winner].item
        placement = merged_plan(self.phases.plan("placement", backend=winner, dispatcher=dispatcher))
        expects = placement.get("expects_unquantized_inputs", (backend.expects_unquantized_inputs, None))[0]
        quant_rule = single(self.phases.plan("quantization", backend=winner, dispatcher=dispatcher,
                                             expects_unquantized_inputs=expects), "the activation quantization")
        if quant_rule is None:
            raise EngineError(f"no plan rule decides how activations reach {winner} behind {dispatcher}; "
                              "every (backend, dispatcher) pair needs a quantization rule")
        return Decision(
            outcome=Outcome.selected, backend=winner, kernel=backend.kernel,
            external_package=backend.external.value if backend.external else None, adapter=backend.adapter,
            prepare_finalize=dispatcher, prepare_finalize_kernel=self.ruleset.dispatchers[dispatcher].item.kernel,
            activation_format=backend.format, monolithic=backend.monolithic,
            quant=self._quant(quant_rule, expects, placement), padding=self._padding(placement),
            expert_placement=placement.get("expert_placement", (ExpertPlacement.contiguous, None))[0],
            selected_by=selected_by, fallback_rule=fallback, alternatives=tuple(alternatives),
            **self._common(evaluation))

    def _quant(self, rule, expects: bool, placement: dict) -> QuantPlacement:
        values = rule.item.set.values
        scale_dim = values["scale_dim"]
        if isinstance(scale_dim, str):
            scale_dim = self.phases.flat[scale_dim]
        dtype = values["dispatch_dtype"]
        dtype = self.config.model.in_dtype.value if dtype == "input" else self.phases.flat.get(dtype, dtype)
        placement_rules = tuple(sorted({r.id for _, r in placement.values() if r is not None}))
        return QuantPlacement(
            quantized_by=QuantizedBy(values["quantized_by"]), expects_unquantized_inputs=expects,
            defer_input_quant=expects, dispatch_dtype=dtype, scale_dim=scale_dim,
            scale_type_size=values["scale_type_size"], weight_block=placement.get("weight_block", (0, None))[0],
            rules=placement_rules + (rule.id,))

    def _padding(self, placement: dict) -> Padding:
        hidden = self.config.model.hidden_size
        inter = self.config.intermediate_per_partition
        hidden_padded = _round_up(hidden, placement.get("round_up_hidden", (1, None))[0])
        inter_padded = _round_up(inter, placement.get("round_up_intermediate", (1, None))[0])
        return Padding(hidden_pad=hidden_padded - hidden, intermediate_pad=inter_padded - inter,
                       hidden_padded=hidden_padded, intermediate_padded=inter_padded)

    def _unsupported(self, evaluation: Evaluation, error: str, reason: ReasonCode,
                     dispatcher: Optional[str] = None, miss: Optional[str] = None) -> Decision:
        """No layer; `prepare_finalize` still names the dispatcher when only the experts failed."""
        return Decision(outcome=Outcome.unsupported, error=error, failure_reason=reason, nearest_miss=miss,
                        prepare_finalize=dispatcher, **self._common(evaluation))

    def _common(self, evaluation: Evaluation) -> dict:
        return dict(requested=self.requested, rejections=tuple(evaluation.rejections),
                    rules_hash=self.ruleset.hash, engine=self.engine.name, ranking=tuple(self.ranking),
                    trace=tuple(evaluation.fired), config=self.config)


def displaced(ruleset: RuleSet, rejections_of, better) -> Optional[tuple]:
    """(backend, rule): the better-ranked backend auto mode gave up and the fallback rule that took it,
    if only fallback rules rejected it; else None."""
    for backend in better:
        rules = [ruleset.rule(r.rule) for r in rejections_of(backend)]
        if rules and all(rule.item.fallback for rule in rules):
            return backend, rules[0]
    return None


def fallback_message(decision: Decision, ruleset: RuleSet) -> str:
    """The fallback warning: the winner, the displaced backend, the rule, where it is written, and why."""
    backend, rule = displaced(ruleset, decision.rejections_of, decision.ranked_ahead()) or \
        (None, ruleset.rule(decision.fallback_rule))
    why = next((r.detail for r in decision.rejections_of(backend) if r.rule == rule.id), rule.item.message)
    return (f"auto mode fell back to {decision.backend}: {backend or 'a better-ranked backend'} ranks higher but rule "
            f"{rule.id} ({rule.source}) rejects it ({why})")


def _config_key(config: MoEConfig) -> tuple:
    """Equal configs give equal keys: the section field values, two levels deep. Hashing and
    comparing these plain tuples costs a third of pydantic's nested __hash__ and __eq__."""
    return tuple([tuple(section.__dict__.values()) for section in config.__dict__.values()])


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def evaluator_name(engine: str) -> str:
    """The evaluator `engine` ("auto", "durable" or "reference") stands for on this machine."""
    if engine not in ("auto", "durable", "reference"):
        raise ValueError(f"engine={engine!r}: choose auto, durable or reference")
    if engine == "auto" and durable_runner.IMPORT_ERROR:
        _log_once(f"moerules: durable-rules unavailable ({durable_runner.IMPORT_ERROR}); using the reference evaluator")
        return "reference"
    return "durable" if engine == "auto" else engine


def _make_runner(compiled: CompiledRules, engine: str):
    if evaluator_name(engine) == "reference":
        return ReferenceRunner(compiled)
    return durable_runner.DurableRunner(compiled)


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning(message)


# -- module-level API -----------------------------------------------------------------------
class _Lru:
    """A small thread-safe LRU map. Engines and parsed rule sets are kept in bounded ones, so a
    process that sees many rule-set versions (an editor, a hot-reloading server) holds only
    the recent ones; an evicted durable engine frees its ruleset when it is collected."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value):
        """Store `value` unless another thread stored one first; the stored one is returned."""
        with self._lock:
            value = self._items.setdefault(key, value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            return value


_engines = _Lru(8)
_rulesets = _Lru(8)
_SNAPSHOT_TRIES = 5


def engine_for(rules: RulesArg = None, engine: str = "auto") -> Engine:
    """The Engine of a rule set, built once per (content hash, evaluator) and kept while recent."""
    ruleset = rules if isinstance(rules, RuleSet) else _load_cached(rules)
    key = (ruleset.hash, engine)
    return _engines.get(key) or _engines.put(key, Engine(ruleset, engine))


def _load_cached(path) -> RuleSet:
    """The rules of a folder as one snapshot, reloaded only when one of its files changed.

    The folder is resolved once and read from its real path, so flipping a symlink between
    two complete folders mid-read cannot mix them; a load is cached only if no file of that
    folder changed while it was read (same stamp before and after), else it is read again.
    """
    from moerules.resources import default_rules_dir
    root = Path(path) if path is not None else default_rules_dir()
    for _ in range(_SNAPSHOT_TRIES):
        stamp = _stamp(root)
        cached = _rulesets.get(stamp)
        if cached is not None:
            return cached
        ruleset = load_rules(stamp[0], display="rules" if path is None else str(path))
        if _stamp(stamp[0]) == stamp:  # the folder that was read, even if a link moved on since
            return _rulesets.put(stamp, ruleset)
    raise RuleSetError([RuleFileError(f"the rules changed while they were read, {_SNAPSHOT_TRIES} times in a row; "
                                      "retry once they are written", file=str(root))])


def _stamp(root: Path) -> tuple:
    """The resolved folder (or file) and each rule file's identity, size and modification time."""
    real = root.resolve()
    files = sorted(real.glob("*.yaml")) if is_folder(real) else [real]
    identity = []
    for file in files:
        try:
            status = file.stat()
        except OSError:  # removed between listing and stat: the next stamp differs
            continue
        identity.append((file.name, status.st_ino, status.st_size, status.st_mtime_ns))
    return (real, *identity)


def decide(config: MoEConfig, rules: RulesArg = None, engine: str = "auto") -> Decision:
    """Decide the MoE backend for `config` under `rules` (default: the shipped rule set)."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}; build one with "
                        "MoEConfig.model_validate(data), which names each invalid field")
    return engine_for(rules, engine).decide(config)
