"""`moerules test`: the cases beside each rule file, and which rules no case defends.

Each rule file `rules/NAME.yaml` that holds rules has its cases in `rules/cases/NAME.yaml` (the loader reads
only the folder's own *.yaml, so cases are never taken for rules). A case names the rule it defends, a config,
and what that rule does there: a constraint rejects `rejected` (a backend or a dispatcher); a priority,
dispatch or plan rule fires. `backend:` pins the winner as well. Deleting or weakening the rule fails its case,
so a rule with a case cannot be lost unnoticed, and the case says which rule a test defends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moerules.config import MoEConfig
from moerules.decision import Decision
from moerules.engine.decide import Engine
from moerules.engine.loader import structure_error
from moerules.engine.rulefile import Constraint
from moerules.engine.ruleset import RuleSet
from moerules.engine.textfile import is_folder
from moerules.engine.yamlsource import YamlDocument
from moerules.errors import BackendRejectedError, RuleSetError

CASES = "cases"
# Constraints the loader writes for each component's packages (`package.<id>`): declarations, not rules
# anyone wrote, so coverage does not count them.
GENERATED = "package."


class Case(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rule: str = Field(description="The rule this case defends (declared in the rule file of the same name).")
    config: MoEConfig
    rejected: Optional[str] = Field(None, description="Constraints: the backend or dispatcher the rule rejects.")
    backend: Optional[str] = Field(None, description="The backend the decision selects; 'none' when unsupported.")
    why: str = Field("", description="What the case shows, in one line.")


class CaseFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cases: list[Case] = Field(min_length=1)


@dataclass(frozen=True)
class Result:
    where: str              # file:line of the case
    rule: str
    problem: Optional[str]  # None: the case holds


def case_files(rules_dir: Path) -> dict[str, Path]:
    """The case files of a rules folder, by the rule file they belong to."""
    folder = rules_dir / CASES
    return {path.name: path for path in sorted(folder.glob("*.yaml"))} if is_folder(folder) else {}


def load_cases(path: Path, display: str) -> tuple[YamlDocument, CaseFile]:
    doc = YamlDocument(path, display)
    try:
        return doc, CaseFile.model_validate(doc.data)
    except ValidationError as error:
        raise RuleSetError([structure_error(doc, detail, CaseFile) for detail in error.errors()]) from None


def rule_file(ruleset: RuleSet, rule_id: str) -> str:
    return ruleset.rule(rule_id).source.file.rsplit("/", 1)[-1]


def missing_case_files(rules_dir: Path, ruleset: RuleSet) -> list[str]:
    """Rule files that hold rules (not only declarations) but have no case file beside them."""
    with_rules = {rule_file(ruleset, rule.id) for rule in ruleset.rules() if not rule.id.startswith(GENERATED)}
    return sorted(with_rules - set(case_files(rules_dir)))


def run(rules_dir: Path, ruleset: RuleSet, evaluator: str = "auto") -> list[Result]:
    """Every case of the folder, in file order. A case file that does not load raises RuleSetError."""
    engine = Engine(ruleset, evaluator)
    results = []
    for name, path in case_files(rules_dir).items():
        doc, parsed = load_cases(path, f"{rules_dir.name}/{CASES}/{name}")
        for index, case in enumerate(parsed.cases):
            where = f"{doc.display}:{doc.position(('cases', index)).line}"
            results.append(Result(where, case.rule, check(case, name, ruleset, engine)))
    return results


def check(case: Case, file_name: str, ruleset: RuleSet, engine: Engine) -> Optional[str]:
    """Why the case fails, or None."""
    if case.rule not in {rule.id for rule in ruleset.rules()}:
        return f"no rule {case.rule!r} in this rule set (deleted or renamed? update or remove the case)"
    if rule_file(ruleset, case.rule) != file_name:
        return f"{case.rule} is declared in {rule_file(ruleset, case.rule)}; move the case to its case file"
    decision = decide(engine, case.config)
    if isinstance(ruleset.rule(case.rule).item, Constraint):
        if case.rejected is None:
            return f"{case.rule} is a constraint: give `rejected:`, the backend or dispatcher it rejects here"
        if not any(r.rule == case.rule and r.backend == case.rejected for r in decision.rejections):
            by = sorted({r.rule for r in decision.rejections if r.backend == case.rejected})
            return f"{case.rule} does not reject {case.rejected} here (rejected by: {', '.join(by) or 'nothing'})"
    elif case.rule not in decision.trace:
        return f"{case.rule} does not fire here"
    winner = decision.backend or "none"
    if case.backend is not None and winner != case.backend:
        return f"the decision selects {winner}, not {case.backend}"
    return None


def decide(engine: Engine, config: MoEConfig) -> Decision:
    try:
        return engine.decide(config, quiet=True)
    except BackendRejectedError as error:   # a refused pin is a decision too: its rejections are the point
        return error.decision


@dataclass(frozen=True)
class Coverage:
    total: int
    uncovered: dict[str, list[str]]     # rule file -> rule ids no passing case names
    deviations: list[str]               # rules with `deviation:` that no passing case names

    @property
    def percent(self) -> float:
        missing = sum(map(len, self.uncovered.values()))
        return 100.0 * (self.total - missing) / self.total if self.total else 100.0


def coverage(ruleset: RuleSet, results: Iterable[Result]) -> Coverage:
    defended = {r.rule for r in results if r.problem is None}
    rules = [rule for rule in ruleset.rules() if not rule.id.startswith(GENERATED)]
    uncovered: dict[str, list[str]] = {}
    for rule in rules:
        if rule.id not in defended:
            uncovered.setdefault(rule_file(ruleset, rule.id), []).append(rule.id)
    deviations = [rule.id for rule in rules if getattr(rule.item, "deviation", None) and rule.id not in defended]
    return Coverage(len(rules), uncovered, deviations)


def suggest(engine: Engine, rule_ids: set[str], configs: Iterable[MoEConfig]) -> dict[str, tuple[MoEConfig, dict]]:
    """For each rule, the first config where it acts, and what the case would assert (a draft to review).
    Drafts assert the rule's own effect only; a winner (`backend:`) is the author's to add where it matters."""
    found: dict[str, tuple[MoEConfig, dict]] = {}
    for config in configs:
        decision = decide(engine, config)
        for rejection in decision.rejections:
            if rejection.rule in rule_ids and rejection.rule not in found:
                found[rejection.rule] = (config, {"rejected": rejection.backend})
        for rule_id in rule_ids.intersection(decision.trace) - set(found):
            found[rule_id] = (config, {})
        if len(found) == len(rule_ids):
            break
    return found


def draft(rule_id: str, config: MoEConfig, expected: dict) -> dict:
    """A case as data: the config as its non-default fields, so it reads as what matters."""
    return {"rule": rule_id, "config": config.model_dump(mode="json", exclude_defaults=True,
                                                         exclude=_computed(config)), **expected}


def _computed(model: BaseModel) -> dict:
    """The computed fields of the config and of each section (derived; a config file may not state them)."""
    sections = {name: set(type(getattr(model, name)).model_computed_fields) for name in type(model).model_fields
                if isinstance(getattr(model, name), BaseModel) and type(getattr(model, name)).model_computed_fields}
    return {**sections, **{name: True for name in type(model).model_computed_fields}}

