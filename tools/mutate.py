"""Rule mutation testing: delete, negate or weaken each rule in turn and check that the
decision matrix notices. A surviving mutant is a rule no decision depends on (dead) or a
behaviour nothing pins down (a missing test); either way a reviewer must look at it."""

from __future__ import annotations

import multiprocessing
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

from moerules.errors import MoeRulesError
from moerules.tools import matrix
from moerules.engine.decide import Engine
from moerules.engine.expr import And, Not, render
from moerules.engine.ruleset import Rule, RuleSet

SECTIONS = ("constraints", "priorities", "dispatch", "plan")

# Guards that the default rules never exercise on their own: a rule that only matters once
# another rule is gone (e.g. "MoRI quantises unless the experts defer" needs experts that
# defer behind MoRI). Each scenario re-decides some matrix cells with its rules removed, from
# the mutant as from the original, so mutating the guard shows up. They mirror seed tests.
SCENARIOS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("aiter.prequantized_behind_mori",): ("rocm:gfx942|fp8_w8a8", "a2a=mori+switch=rocm_use_aiter=on"),
    # MoonEP experts run only behind the MoonEP dispatcher, which needs the same package: their own package
    # gate shows only once the pairing is gone.
    ("moonep.gate",): ("|unquantized|", "pin=moonep", "without_own_packages"),
}


@dataclass(frozen=True)
class Mutant:
    rule: str
    operator: str      # delete | negate | weaken
    detail: str
    ruleset: RuleSet = field(repr=False, compare=False)


@dataclass
class Outcome:
    mutant: Mutant
    killed: bool
    evidence: Optional[str] = None   # the first cell whose decision changed
    cells_checked: int = 0

    def to_dict(self) -> dict:
        return {"rule": self.mutant.rule, "operator": self.mutant.operator, "detail": self.mutant.detail,
                "killed": self.killed, "evidence": self.evidence, "cells_checked": self.cells_checked}


def mutants(ruleset: RuleSet) -> Iterator[Mutant]:
    for section in SECTIONS:
        for index, rule in enumerate(getattr(ruleset, section)):
            yield _with(ruleset, section, index, None, rule.id, "delete", "rule removed")
            target = "require" if section == "constraints" else "when"
            condition = getattr(rule, target)
            if condition is not None:
                yield _with(ruleset, section, index, replace(rule, **{target: Not(condition)}), rule.id, "negate",
                            f"{target}: not ({render(condition)})")
            if isinstance(condition, And) and len(condition.items) > 1:
                weaker = condition.items[0] if len(condition.items) == 2 else And(condition.items[:-1])
                yield _with(ruleset, section, index, replace(rule, **{target: weaker}), rule.id, "weaken",
                            f"{target}: {render(weaker)} (last conjunct dropped)")


def _with(ruleset: RuleSet, section: str, index: int, new: Optional[Rule], rule_id: str, operator: str,
          detail: str) -> Mutant:
    rules = list(getattr(ruleset, section))
    if new is None:
        del rules[index]
    else:
        rules[index] = new
    parts = {s: list(getattr(ruleset, s)) for s in SECTIONS}
    parts[section] = rules
    mutated = RuleSet(files=ruleset.files, backends=ruleset.backends, dispatchers=ruleset.dispatchers,
                      content=ruleset.content + [["mutant", rule_id, operator]], **parts)
    return Mutant(rule_id, operator, detail, mutated)


def run(ruleset: RuleSet, *, sample: Optional[int] = None, seed: int = 0, workers: int = 1,
        progress: Optional[Callable[[Outcome, int, int], None]] = None) -> list[Outcome]:
    """Test every mutant (or a seeded sample) against the decision matrix of `ruleset`."""
    chosen = list(mutants(ruleset))
    if sample is not None:
        chosen = random.Random(seed).sample(chosen, min(sample, len(chosen)))
    base = Engine(ruleset)
    # Shuffled once, so a mutant of a rare platform's rule is not found only after every CUDA cell.
    cells = list(matrix.cells(ruleset.backends))
    random.Random(seed).shuffle(cells)
    scenarios = [(drop, [c for c in cells if all(f in c.key for f in fragments)])
                 for drop, fragments in SCENARIOS.items()]
    _STATE.update(cells=cells, mutants=chosen, base=base, expected={}, scenarios=scenarios)
    outcomes: list[Outcome] = []
    if workers > 1:  # forked workers share the mutants; each fills its own baseline rows as it goes
        context = multiprocessing.get_context("fork")
        with context.Pool(workers) as pool:
            for outcome in pool.imap(_test_index, range(len(chosen))):
                outcomes.append(outcome)
                if progress:
                    progress(outcome, len(outcomes), len(chosen))
        return outcomes
    for index in range(len(chosen)):
        outcomes.append(_test_index(index))
        if progress:
            progress(outcomes[-1], len(outcomes), len(chosen))
    return outcomes


_STATE: dict = {}


def _test_index(index: int) -> Outcome:
    cells, expected, base = (_STATE[k] for k in ("cells", "expected", "base"))
    mutant = _STATE["mutants"][index]
    try:
        engine = Engine(mutant.ruleset)
    except MoeRulesError as error:  # e.g. a negated plan condition no longer splits into plan/config tests
        return Outcome(mutant, True, f"rejected by the compiler: {error}")
    for checked, cell in enumerate(cells, 1):
        if cell.key not in expected:  # the baseline row, computed once per process on first need
            expected[cell.key] = matrix.row(base, cell)
        change = matrix.compare({cell.key: expected[cell.key]}, {cell.key: matrix.row(engine, cell)})
        if change:
            return Outcome(mutant, True, change[0].describe(), checked)
    for drop, scenario_cells in _STATE["scenarios"]:
        try:
            before, after = Engine(_without(base.ruleset, drop)), Engine(_without(mutant.ruleset, drop))
        except MoeRulesError as error:
            return Outcome(mutant, True, f"scenario without {', '.join(drop)}: rejected by the compiler: {error}")
        change = matrix.compare({c.key: matrix.row(before, c) for c in scenario_cells},
                                {c.key: matrix.row(after, c) for c in scenario_cells})
        if change:
            return Outcome(mutant, True, f"scenario without {', '.join(drop)}: {change[0].describe()}", len(cells))
    return Outcome(mutant, False, None, len(cells))


def _without(ruleset: RuleSet, rule_ids: tuple[str, ...]) -> RuleSet:
    parts = {s: [r for r in getattr(ruleset, s) if r.id not in rule_ids] for s in SECTIONS}
    return RuleSet(files=ruleset.files, backends=ruleset.backends, dispatchers=ruleset.dispatchers,
                   content=ruleset.content + [["without", *rule_ids]], **parts)


def report_markdown(outcomes: list[Outcome], ruleset_hash: str) -> str:
    killed = sum(o.killed for o in outcomes)
    lines = ["# Rule mutation report", "",
             f"Rules {ruleset_hash[:16]}: {killed}/{len(outcomes)} mutants killed "
             f"({100 * killed / max(len(outcomes), 1):.1f}%) by the decision matrix.", "",
             "| rule | operator | mutation | killed | first changed cell |", "|---|---|---|---|---|"]
    for o in outcomes:
        evidence = (o.evidence or "").replace("|", "/")
        lines.append(f"| {o.mutant.rule} | {o.mutant.operator} | `{o.mutant.detail}` | "
                     f"{'yes' if o.killed else '**SURVIVED**'} | {evidence[:160]} |")
    return "\n".join(lines) + "\n"
