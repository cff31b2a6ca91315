"""Conformance: how often `decide` agrees with vLLM 0.33's own selection, and why not where it doesn't.

Each config is decided by our rules and by vLLM (`vllm_oracle`); vLLM's experts class is named by
the component whose `upstream:` lists it. A disagreement is charged to the moerules rules that
produced it (the rules that rejected vLLM's choice, or the priority rules that ranked ours ahead
of it); where every one of those rules carries `deviation:`, it is a named deviation, not a
disagreement. The per-config verdicts are committed (`reports/conformance.csv`) so that CI can
re-check a sample against the pinned vLLM, like the decision matrix.
"""

from __future__ import annotations

import csv
import functools
import inspect
import io
import random
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence

from moerules.config import MoEConfig
from moerules.decision import Decision, Outcome
from moerules.engine.decide import Engine
from moerules.engine.evaluate import effective_order
from moerules.tools.matrix import Cell, decide_config
from moerules.tools.progress import Progress
from moerules.engine.textfile import csv_rows
from moerules.engine.ruleset import RuleSet
from moerules.tools.vllm_oracle import Inexpressible, OracleAnswer, VllmOracle, vllm_family

UNSUPPORTED = "unsupported"
# Where vLLM replaces a pinned backend (its unquantized LoRA branch returns Triton before reading
# moe_backend, oracle/unquantized.py:234-248), our policy differs on purpose: a pin is honoured or the
# decision fails (README, Policies). Such a difference is charged to that policy.
PIN_POLICY = "policy:pin_honoured_or_refused"
COLUMNS = ["cell", "mode", "family", "platform", "ours", "theirs", "verdict", "rules", "source", "violations"]


class Verdict:
    agree = "agree"
    deviation = "deviation"
    disagree = "disagree"
    inexpressible = "inexpressible"


@dataclass(frozen=True)
class Comparison:
    """One config, decided both ways."""

    cell: str
    mode: str          # auto | pinned
    family: str        # vLLM's select family (fp8, mxfp4, ...)
    platform: str      # vendor:arch
    ours: str          # our backend id, or "unsupported"
    theirs: str        # the component vLLM's class maps to, "unnamed:<Class>", or "unsupported"
    verdict: str
    rules: str         # the moerules rules responsible for a difference, space-separated
    source: str        # vLLM's side of it: the experts class's file:line, or its refusal
    violations: str = ""   # invariants vLLM's own choice breaks (bias_dropped, pin_replaced, format_mismatch)


class Conformance:
    """Compares one rule set with vLLM over configs."""

    def __init__(self, ruleset: RuleSet, oracle: Optional[VllmOracle] = None, evaluator: str = "auto"):
        self.ruleset = ruleset
        self.engine = Engine(ruleset, evaluator)
        self.oracle = oracle or VllmOracle()
        self.component_of = {cls: name for name, declared in {**ruleset.backends, **ruleset.dispatchers}.items()
                             for cls in declared.item.upstream}

    def compare(self, cell: Cell) -> Comparison:
        config = cell.config
        mode = "auto" if config.features.backend == "auto" else "pinned"
        platform = f"{config.platform.vendor.value}:{config.platform.arch}"
        try:
            answer = self.oracle.select(config, self._vllm_pin(config))
        except Inexpressible as why:
            return Comparison(cell.key, mode, config.quant.family.value, platform, "", "", Verdict.inexpressible,
                              "", str(why))
        decision = decide_config(self.engine, config)
        ours = decision.backend if decision.outcome == Outcome.selected else UNSUPPORTED
        theirs = self._theirs(answer)
        violations = " ".join(self._violations(config, theirs))
        if ours == theirs:
            return Comparison(cell.key, mode, answer.family, platform, ours, theirs, Verdict.agree, "", "",
                              violations)
        if "pin_replaced" in violations:   # vLLM ran another backend than the one asked for
            return Comparison(cell.key, mode, answer.family, platform, ours, theirs, Verdict.deviation,
                              PIN_POLICY, _source(answer), violations)
        rules = self._responsible(decision, theirs)
        deviation = bool(rules) and all(self.ruleset.rule(rule).item.deviation for rule in rules)
        return Comparison(cell.key, mode, answer.family, platform, ours, theirs,
                          Verdict.deviation if deviation else Verdict.disagree, " ".join(rules), _source(answer),
                          violations)

    def _violations(self, config: MoEConfig, theirs: str) -> list[str]:
        """The invariants of this project that vLLM's own choice breaks, judged by the component's
        declared capabilities: biases silently dropped, a pin replaced, experts fed the other format."""
        declared = self.ruleset.backends.get(theirs)
        if declared is None:
            return []
        backend, found = declared.item, []
        if config.model.has_bias and not backend.bias:
            found.append("bias_dropped")
        if config.features.backend not in ("auto", theirs):
            found.append("pin_replaced")
        if (backend.format.value == "batched") != config.parallel.batched_format:
            found.append("format_mismatch")
        return found

    def _vllm_pin(self, config: MoEConfig) -> str:
        pin = config.features.backend
        if pin == "auto":
            return "auto"
        family = vllm_family(config)
        declared = self.ruleset.backends.get(pin)
        vllm_pin = declared.item.vllm_pin(family) if declared else None
        if vllm_pin is None:
            raise Inexpressible(f"features.backend={pin} has no vLLM moe_backend for {family} (ours only)")
        return vllm_pin

    def _theirs(self, answer: OracleAnswer) -> str:
        if not answer.selected:
            return UNSUPPORTED
        return self.component_of.get(answer.experts, f"unnamed:{answer.experts}")

    def _responsible(self, decision: Decision, theirs: str) -> list[str]:
        """The rules that kept vLLM's choice from being ours: its rejections, else the ranking in effect
        (the base order that applied and the promotions/demotions that moved either backend)."""
        rejected = sorted({r.rule for r in decision.rejections if r.backend == theirs})
        if not rejected and decision.prepare_finalize is None:   # vLLM's experts stand; the layout's dispatcher fell
            used = {rule.item.use for rule in self.ruleset.dispatch if rule.id in decision.trace}
            rejected = sorted({r.rule for r in decision.rejections if r.backend in used})
        if rejected or theirs.startswith("unnamed:"):
            return rejected
        fired = set(decision.trace)
        ranking = [rule for rule in self.ruleset.priorities if rule.id in fired]
        order, base = effective_order(ranking)
        moved = [rule for rule in ranking if rule.item.action != "order"]
        if theirs == UNSUPPORTED:   # ours serves where vLLM has nothing: the rules that ranked ours
            involved = {decision.backend}
        elif decision.backend in order and theirs in order and order.index(decision.backend) < order.index(theirs):
            involved = {decision.backend, theirs}
        else:
            return []
        charged = [rule for rule in moved if involved & set(rule.item.backends)]
        if base is not None and involved & set(base.item.backends):
            charged.append(base)
        return sorted(rule.id for rule in charged)


def _source(answer: OracleAnswer) -> str:
    """Where vLLM's side of a difference is written: its experts class, or its refusal's first words."""
    if answer.error:
        return answer.error.splitlines()[0][:160]
    if not answer.selected:
        return f"{answer.family}: {answer.backend} (no experts class: left to an out-of-tree plugin)"
    return _class_location(answer.experts)


@functools.lru_cache(maxsize=None)
def _class_location(name: str) -> str:
    """`path:line` of a vLLM fused-MoE class (computed once per class: reading source is slow)."""
    import sys

    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("vllm.model_executor.layers.fused_moe.") and name in vars(module):
            cls = vars(module)[name]
            if inspect.isclass(cls) and cls.__module__ == module_name:
                path = module_name.replace(".", "/") + ".py"
                return f"{path.removeprefix('vllm/')}:{inspect.getsourcelines(cls)[1]}"
    return name


def compare_all(conformance: Conformance, cells: Sequence[Cell],
                progress: Optional[Progress] = None) -> list[Comparison]:
    rows = []
    for index, cell in enumerate(cells):
        rows.append(conformance.compare(cell))
        if progress:
            progress.advance()
    return rows


def sample(cells: Sequence[Cell], count: int, seed: int = 0) -> list[Cell]:
    """A deterministic sample (the CI re-check)."""
    if count >= len(cells):
        return list(cells)
    return sorted(random.Random(seed).sample(list(cells), count), key=lambda cell: cell.key)


def to_csv(rows: Iterable[Comparison]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(asdict(row) for row in rows)
    return out.getvalue()


def from_csv(text: str, source: str = "conformance.csv") -> dict[str, Comparison]:
    """cell -> Comparison of a report written by `to_csv`; anything else is a TableFileError naming `source`."""
    return {row["cell"]: Comparison(**row) for row in csv_rows(text, source, COLUMNS)}


@dataclass(frozen=True)
class Summary:
    """Agreement counts: overall and per mode, family x platform; disagreements and deviations by rule."""

    rows: Sequence[Comparison]

    def agreement(self, rows: Sequence[Comparison]) -> tuple[int, int, int, int]:
        """(agree, deviation, disagree, compared) over the expressible rows."""
        counts = Counter(row.verdict for row in rows)
        compared = counts[Verdict.agree] + counts[Verdict.deviation] + counts[Verdict.disagree]
        return counts[Verdict.agree], counts[Verdict.deviation], counts[Verdict.disagree], compared

    def by(self, *fields: str) -> dict[tuple, list[Comparison]]:
        groups: dict[tuple, list[Comparison]] = defaultdict(list)
        for row in self.rows:
            if row.verdict != Verdict.inexpressible:
                groups[tuple(getattr(row, name) for name in fields)].append(row)
        return dict(sorted(groups.items()))

    def disagreements(self, verdict: str = Verdict.disagree) -> dict[tuple, list[Comparison]]:
        """Grouped by (responsible rules, ours, theirs, vLLM source)."""
        groups: dict[tuple, list[Comparison]] = defaultdict(list)
        for row in self.rows:
            if row.verdict == verdict:
                groups[(row.rules or "(no rule: missing in ours)", row.ours, row.theirs, row.source)].append(row)
        return dict(sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])))


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def report_markdown(summary: Summary, rules_hash: str, vllm_version: str, limit: int = 60) -> str:
    """The committed report: agreement, then every disagreement and deviation grouped by rule."""
    rows = summary.rows
    lines = [f"# Conformance with vLLM {vllm_version}", "",
             f"Rule set `{rules_hash[:16]}`; {len(rows)} configs (the decision matrix and seeded random configs); "
             "generated by `moerules conformance`. vLLM's own `select_*_moe_backend` functions ran unchanged, with "
             "only the platform, package probes and `VLLM_*` switches stood in (`tools/vllm_oracle.py`).", "",
             "| mode | configs compared | agree | named deviations | disagree | agreement outside deviations |",
             "|---|---|---|---|---|---|"]
    inexpressible = Counter(row.source for row in rows if row.verdict == Verdict.inexpressible)
    for mode in ("auto", "pinned"):
        agree, deviation, disagree, compared = summary.agreement([r for r in rows if r.mode == mode])
        lines.append(f"| {mode} | {compared} | {agree} | {deviation} | {disagree} | "
                     f"{_percent(agree + deviation, compared)} |")
    lines += ["", f"{sum(inexpressible.values())} configs have an input vLLM cannot be given (ours only):", ""]
    lines += [f"- {count} × {why}" for why, count in inexpressible.most_common()]
    lines += ["", "## Agreement per family and platform (auto mode)", "",
              "| family | platform | compared | agree | deviations | disagree |", "|---|---|---|---|---|---|"]
    for (mode, family, platform), group in summary.by("mode", "family", "platform").items():
        if mode == "auto":
            agree, deviation, disagree, compared = summary.agreement(group)
            lines.append(f"| {family} | {platform} | {compared} | {_percent(agree, compared)} | {deviation} | "
                         f"{disagree} |")
    lines += _deviation_counts(rows)
    lines += _violations_section(rows)
    for title, verdict in (("Disagreements", Verdict.disagree), ("Named deviations", Verdict.deviation)):
        groups = summary.disagreements(verdict)
        total = sum(len(group) for group in groups.values())
        lines += ["", f"## {title} by responsible rule ({total} configs, {len(groups)} groups)", "",
                  "| configs | moerules rules | ours | vLLM | vLLM source | example |", "|---|---|---|---|---|---|"]
        for (rules, ours, theirs, source), group in list(groups.items())[:limit]:
            lines.append(f"| {len(group)} | {rules} | {ours} | {theirs} | {source.replace('|', '/')} | "
                         f"`{group[0].cell}` |")
        if len(groups) > limit:
            lines.append(f"| ... | {len(groups) - limit} more groups in conformance.csv | | | | |")
    return "\n".join(lines) + "\n"


def _violations_section(rows: Sequence[Comparison]) -> list[str]:
    """vLLM decisions that break an invariant of ours, by invariant and vLLM's component."""
    groups: dict[tuple[str, str], list[Comparison]] = defaultdict(list)
    for row in rows:
        for violation in row.violations.split():
            groups[(violation, row.theirs)].append(row)
    lines = ["", f"## vLLM decisions that break an invariant ({sum(map(len, groups.values()))})", "",
             "| invariant | vLLM's component | configs | example |", "|---|---|---|---|"]
    for (violation, theirs), group in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        lines.append(f"| {violation} | {theirs} | {len(group)} | `{group[0].cell}` |")
    return lines


def _deviation_counts(rows: Sequence[Comparison]) -> list[str]:
    """How many configs each named deviation (or our pin policy) accounts for."""
    counts = Counter(rule for row in rows if row.verdict == Verdict.deviation for rule in row.rules.split())
    lines = ["", f"## Configs each named deviation accounts for ({len(counts)} rules)", "",
             "| rule | configs |", "|---|---|"]
    lines += [f"| {rule} | {count} |" for rule, count in counts.most_common()]
    return lines
