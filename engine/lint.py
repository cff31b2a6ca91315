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
from moerules.engine import matrix
from moerules.engine.compiler import CompiledRules, compile_rules
from moerules.decision import ReasonCode
from moerules.engine.decide import Assembler, Engine
from moerules.engine.evaluate import PhaseRunner, effective_order
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

    def text(self) -> str:
        lines = [f"{f.level}: {f.where + ': ' if f.where else ''}[{f.code}] {f.message}" for f in self.findings]
        lines.append(f"{len(self.errors)} error(s), {len(self.findings) - len(self.errors)} warning(s); "
                     f"{self.configs_checked} configs checked")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"findings": [asdict(f) for f in self.findings], "configs_checked": self.configs_checked}


def lint(rules=None, configs: Optional[Iterable[MoEConfig]] = None) -> LintReport:
    """Lint a rule set; coverage is checked over `configs` (default: every decision-matrix cell, ~1 min)."""
    report = LintReport()
    try:
        ruleset = load_rules(rules)
    except RuleSetError as error:
        return _errors(report, "load", error)
    try:  # durable-rules' capacities, checked by the compiler before any engine exists
        compiled = compile_rules(ruleset)
    except RuleSetError as error:
        return _errors(report, "capacity", error)
    _kernels(ruleset, report)
    _coverage(ruleset, compiled, report, configs if configs is not None else (c.config for c in matrix.cells(ruleset.backends)))
    return report


def _errors(report: LintReport, code: str, error: RuleSetError) -> LintReport:
    for e in error.errors:
        report.add("error", code, e.message + (f" ({e.hint})" if e.hint else ""),
                   f"{e.file}:{e.line}:{e.col}" if e.line else e.file)
    return report


def _kernels(ruleset: RuleSet, report: LintReport) -> None:
    try:
        from moerules.kernels.registry import EXPERTS, PREPARE_FINALIZE
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


def _coverage(ruleset: RuleSet, compiled: CompiledRules, report: LintReport, configs) -> None:
    engine = Engine(ruleset)
    ever_eligible: set[str] = set()
    omitted: dict[tuple, int] = defaultdict(int)
    problems: dict[str, int] = defaultdict(int)
    for config in configs:
        report.configs_checked += 1
        with engine.runner.session() as session:
            assembler = Assembler(engine, config, PhaseRunner(compiled, session, config, engine.rejections))
            try:
                decision = assembler.run()
            except EngineError as error:
                problems[str(error)] += 1
                continue
        evaluation = assembler.evaluation
        # A backend is reachable when eligible; a dispatcher only when a dispatch rule also picks it.
        ever_eligible |= evaluation.eligible & (set(ruleset.backends) | {r.item.use for r in evaluation.dispatch_rules})
        if decision.failure_reason == ReasonCode.no_dispatcher:
            problems[decision.error] += 1
        order, base = effective_order(evaluation.priority_rules)
        for backend in evaluation.eligible & set(ruleset.backends) - set(order):
            omitted[backend, base.id if base else "(no priority rule)", config.platform.vendor.value] += 1
    for name in list(ruleset.backends) + list(ruleset.dispatchers):
        if name not in ever_eligible:
            report.add("warning", "unreachable", f"{name} is eligible for no config of the decision matrix",
                       str(ruleset.component(name).source))
    for (backend, rule, vendor), count in sorted(omitted.items()):
        report.add("warning", "priority.omits",
                   f"{backend} is eligible on {vendor} in {count} matrix configs but {rule} does not list it")
    for message, count in sorted(problems.items()):
        report.add("error", "coverage", f"{message} ({count} matrix configs)")
