"""`RuleSet`: the typed, cross-checked, content-hashed union of the rule files of a folder."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Union

from moerules.decision import SourceRef
from moerules.engine.expr import Expr
from moerules.engine.rulefile import (Backend, Constraint, Dispatcher, DispatchRule, PackageDeclaration, PlanRule,
                                     Priority)

RuleItem = Union[Constraint, Priority, DispatchRule, PlanRule]


@dataclass(frozen=True)
class Rule:
    """A rule with its parsed conditions and where it was written."""

    item: RuleItem
    source: SourceRef
    when: Optional[Expr] = None
    require: Optional[Expr] = None

    @property
    def id(self) -> str:
        return self.item.id


@dataclass(frozen=True)
class Declared:
    item: Union[Backend, Dispatcher, PackageDeclaration]
    source: SourceRef


@dataclass
class RuleSet:
    """Everything the compiler needs; built only by `load_rules`, which validates it."""

    files: list[str]
    packages: dict[str, Declared] = field(default_factory=dict)
    backends: dict[str, Declared] = field(default_factory=dict)
    dispatchers: dict[str, Declared] = field(default_factory=dict)
    constraints: list[Rule] = field(default_factory=list)
    priorities: list[Rule] = field(default_factory=list)
    dispatch: list[Rule] = field(default_factory=list)
    plan: list[Rule] = field(default_factory=list)
    content: list = field(default_factory=list)  # canonical per-file data, for the hash

    @cached_property
    def hash(self) -> str:
        """Content hash: same rules (whatever the formatting or comments), same hash."""
        blob = json.dumps(self.content, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def rules(self) -> list[Rule]:
        return self.constraints + self.priorities + self.dispatch + self.plan

    def rule(self, rule_id: str) -> Rule:
        return self._by_id[rule_id]

    def position(self, rule: Rule) -> int:
        """Where a rule stands in file order (sections in order, files in name order)."""
        return self._positions[rule.id]

    @cached_property
    def _by_id(self) -> dict[str, Rule]:
        return {rule.id: rule for rule in self.rules()}

    @cached_property
    def _positions(self) -> dict[str, int]:
        return {rule.id: index for index, rule in enumerate(self.rules())}

    def component(self, name: str) -> Declared:
        return self.backends.get(name) or self.dispatchers[name]
