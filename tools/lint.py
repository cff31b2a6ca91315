"""`moerules lint`: what a reviewer of a rule change would catch.

- the load checks (schema, unknown fields/backends/operators, typed conditions);
- durable-rules' capacities (the compiler's checks: a rule too large for durable, too many rules);
- kernels that are neither registered nor declared external;
- backends and dispatchers no config of the decision matrix can select;
- priority lists that omit a backend that is eligible on that platform;
- dispatch and plan coverage: every matrix config gets exactly one dispatcher and a plan.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

from moerules.config import MoEConfig

from moerules.errors import EngineError, RuleSetError
from moerules.tools import matrix, pool
from moerules.engine.compiler import compile_rules
from moerules.decision import ReasonCode
from moerules.engine.decide import Engine
from moerules.engine.evaluate import effective_order
from moerules.engine.loader import load_rules
from moerules.engine.ruleset import RuleSet

@dataclass(frozen=True)
class Finding:
    level: str   # error | warning
    code: str
    message: str
    where: Optional[str] = None


@dataclass
class LintReport:
    findings: list[Finding] = field(default_factory=list)
    configs_checked: int = 0

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def add(self, level: str, code: str, message: str, where: Optional[str] = None) -> None:
        self.findings.append(Finding(level, code, message, where))

    def lines(self, start: int = 0) -> list[str]:
        """Findings from `start` on: the CLI prints the static ones before coverage runs."""
        return [f"{f.level}: {f.where + ': ' if f.where else ''}[{f.code}] {f.message}" for f in self.findings[start:]]

    def tally(self) -> str:
        return (f"{len(self.errors)} error(s), {len(self.findings) - len(self.errors)} warning(s); "
                f"{self.configs_checked} configs checked")

    def text(self) -> str:
        return "\n".join(self.lines() + [self.tally()])

    def to_dict(self) -> dict:
        return {"findings": [asdict(f) for f in self.findings], "configs_checked": self.configs_checked}


def lint(rules=None, configs: Optional[Iterable[MoEConfig]] = None, **pool_options) -> LintReport:
    """Lint a rule set; coverage is checked over `configs` (default: every decision-matrix cell).

    `pool_options` (cache_root, workers, progress) go to `pool.evaluate_all`."""
    report, ruleset = static_checks(rules)
    if ruleset is not None:
        kernel_checks(ruleset, report)
        coverage(ruleset, report, configs, **pool_options)
    return report


def static_checks(rules=None) -> tuple[LintReport, Optional[RuleSet]]:
    """The load and capacity checks: no decision and no torch import, so well under a second.
    The rule set is None when it does not load; nothing else can run then."""
    report = LintReport()
    try:
        ruleset = load_rules(rules)
    except RuleSetError as error:
        _errors(report, "load", error)
        return report, None
    try:  # durable-rules' capacities, checked by the compiler before any engine exists
        compile_rules(ruleset)
    except RuleSetError as error:
        _errors(report, "capacity", error)
        return report, None
    ranking_checks(ruleset, report)
    return report, ruleset


def ranking_checks(ruleset: RuleSet, report: LintReport) -> None:
    """Every backend is ranked by some priority rule or declared `pin_only`, never both: a new backend left
    out of every order would otherwise never win in auto mode, and no check would say so."""
    ranked = {name for rule in ruleset.priorities for name in rule.item.backends}
    for name, declared in ruleset.backends.items():
        if declared.item.pin_only and name in ranked:
            report.add("error", "priority.pin_only", f"{name} is declared pin_only but a priority rule lists it: "
                       "drop `pin_only: true` or take it out of the order", str(declared.source))
        elif not declared.item.pin_only and name not in ranked:
            report.add("error", "priority.unranked", f"{name} is listed by no priority rule, so auto mode never "
                       "selects it: add it to its platform's order, or declare `pin_only: true` if vLLM runs it "
                       "only when pinned", str(declared.source))


def _errors(report: LintReport, code: str, error: RuleSetError) -> None:
    for e in error.errors:
        report.add("error", code, e.message + (f" ({e.hint})" if e.hint else ""),
                   f"{e.file}:{e.line}:{e.col}" if e.line else e.file)


def kernel_checks(ruleset: RuleSet, report: LintReport) -> None:
    """Kernel ids the registry does not know (imports the registry, hence torch: about a second)."""
    try:
        from moerules.kernels.registry import ADAPTERS, EXPERTS, PREPARE_FINALIZE
    except ImportError as error:
        report.add("warning", "kernels.unchecked", f"kernel registry not importable ({error}); install torch to check ids")
        return
    for table, registered in ((ruleset.backends, EXPERTS), (ruleset.dispatchers, PREPARE_FINALIZE)):
        for name, declared in table.items():
            kernel = declared.item.kernel
            if kernel is not None and kernel not in registered:
                report.add("warning", "kernels.unregistered",
                           f"{name} names kernel {kernel!r}, which is not registered (registered: "
                           f"{', '.join(sorted(registered))}); build() will refuse it", str(declared.source))
    for name, declared in ruleset.backends.items():
        adapter = declared.item.adapter
        if adapter is not None and adapter not in ADAPTERS:
            report.add("warning", "kernels.unregistered",
                       f"{name} names adapter {adapter!r}, which is not registered (registered: "
                       f"{', '.join(sorted(ADAPTERS))}); build() will refuse it", str(declared.source))


def coverage(ruleset: RuleSet, report: LintReport, configs: Optional[Iterable[MoEConfig]] = None,
             **pool_options) -> None:
    """Dispatch/plan coverage, reachability and priority gaps over `configs` (default: the matrix)."""
    configs = [c.config for c in matrix.cells(ruleset.backends)] if configs is None else list(configs)
    records = pool.evaluate_all(coverage_record, ruleset, configs, **pool_options)
    report.configs_checked += len(configs)
    ever_eligible: set[str] = set()
    omitted: dict[tuple, int] = defaultdict(int)
    problems: dict[str, int] = defaultdict(int)
    for config, record in zip(configs, records):
        ever_eligible.update(record["reachable"])
        if record["problem"]:
            problems[record["problem"]] += 1
        for backend, rule in record["omitted"]:
            omitted[backend, rule, config.platform.vendor.value] += 1
    for name in list(ruleset.backends) + list(ruleset.dispatchers):
        if name not in ever_eligible:
            report.add("warning", "unreachable", f"{name} is eligible for no config of the decision matrix",
                       str(ruleset.component(name).source))
    for (backend, rule, vendor), count in sorted(omitted.items()):
        report.add("warning", "priority.omits",
                   f"{backend} is eligible on {vendor} in {count} matrix configs but {rule} does not list it")
    for message, count in sorted(problems.items()):
        report.add("error", "coverage", f"{message} ({count} matrix configs)")


def coverage_record(engine: Engine, config: MoEConfig) -> dict:
    """What coverage needs of one config (JSON, so the decision cache can keep it): the components it
    can reach, eligible backends its priority list omits, and a coverage hole if any."""
    try:
        decision, evaluation = engine.evaluate(config)
    except EngineError as error:
        return {"reachable": [], "omitted": [], "problem": str(error)}
    ruleset = engine.ruleset
    # A backend is reachable when eligible; a dispatcher only when a dispatch rule also picks it.
    reachable = evaluation.eligible & (set(ruleset.backends) | {r.item.use for r in evaluation.dispatch_rules})
    order, base = effective_order(evaluation.priority_rules)
    omitted = sorted(evaluation.eligible & set(ruleset.backends) - set(order))
    return {"reachable": sorted(reachable), "omitted": [[b, base.id if base else "(no priority rule)"] for b in omitted],
            "problem": decision.error if decision.failure_reason == ReasonCode.no_dispatcher else None}
