"""Load rule files into a validated `RuleSet`, reporting every error with file:line:col.

Three passes: safe YAML with positions, the pydantic structure of each file, then the
cross-file checks (unique ids, references to declared components, typed conditions).
All errors of a load are collected and raised together.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Optional, Union

from pydantic import BaseModel, ValidationError

from moerules.decision import SourceRef
from moerules.errors import FileError, RuleFileError, RuleSetError
from moerules.quant import QuantDtype
from moerules.resources import default_rules_dir
from moerules.config import PACKAGES_FILE
from moerules.engine import fields as F
from moerules.engine.expr import ExprError, parse, suggest
from moerules.engine.rulefile import MESSAGE_PLACEHOLDER, Constraint, PlanRule, PlanStage, RuleFile
from moerules.engine.ruleset import Declared, Rule, RuleSet
from moerules.engine.textfile import is_folder, is_regular_file
from moerules.engine.yamlsource import YamlDocument

def load_rules(path: Union[str, Path, None] = None, *, display: Optional[str] = None) -> RuleSet:
    """Load a folder of `*.yaml` rule files (or one file); None loads the shipped default rules.

    `display` is how messages name `path` when it was read under another name (a resolved
    symlink); by default the shipped rules are `rules/` and any other path is named as given.
    """
    root = Path(path) if path is not None else default_rules_dir()
    if is_folder(root):
        files = sorted(root.glob("*.yaml"))
        if not files:
            raise RuleSetError([RuleFileError("no *.yaml rule files in this folder", file=str(root))])
    elif is_regular_file(root):
        files = [root]
    else:
        raise RuleSetError([RuleFileError("no such rules file or folder", file=str(root))])
    shown = Path(display) if display is not None else Path("rules") if path is None else root
    prefix = f"{shown if is_folder(root) else shown.parent}/"
    return _Loader([(f, prefix + f.name) for f in files]).load()


class _Loader:
    def __init__(self, files: list[tuple[Path, str]]):
        self.files = files
        self.errors: list[RuleFileError] = []
        self.docs: list[tuple[YamlDocument, RuleFile]] = []

    def load(self) -> RuleSet:
        for path, display in self.files:
            self._read(path, display)
        ruleset = RuleSet(files=[display for _, display in self.files])
        if not self.errors:
            self._declare(ruleset)
        if not self.errors:
            self._add_rules(ruleset)
        if self.errors:
            raise RuleSetError(self.errors)
        return ruleset

    # -- pass 1 and 2: YAML and structure -------------------------------------------------
    def _read(self, path: Path, display: str) -> None:
        try:
            doc = YamlDocument(path, display)
        except RuleFileError as error:
            self.errors.append(error)
            return
        try:
            self.docs.append((doc, RuleFile.model_validate(doc.data)))
        except ValidationError as error:
            self.errors.extend(structure_error(doc, detail, RuleFile) for detail in error.errors())

    # -- pass 3: cross-file checks ----------------------------------------------------------
    def _declare(self, ruleset: RuleSet) -> None:
        seen: dict[str, SourceRef] = {}
        upstream: dict[str, SourceRef] = {}   # each vLLM class names one component, or conformance is ambiguous
        packages: dict[str, SourceRef] = {}   # a package may share its name with a backend (aiter)
        for doc, parsed in self.docs:
            ruleset.content.append([doc.display.rsplit("/", 1)[-1], parsed.model_dump(mode="json")])
            for index, package in enumerate(parsed.packages):
                source = _source(doc, ("packages", index))
                if self._unique(package.id.value, source, packages, doc, ("packages", index, "id"), what="package"):
                    ruleset.packages[package.id.value] = Declared(package, source)
            for section, table in (("backends", ruleset.backends), ("dispatchers", ruleset.dispatchers)):
                for index, item in enumerate(getattr(parsed, section)):
                    source = _source(doc, (section, index))
                    for position, name in enumerate(item.upstream):
                        self._unique(name, source, upstream, doc, (section, index, "upstream", position),
                                     what="vLLM class", owner=item.id)
                    if self._unique(item.id, source, seen, doc, (section, index, "id")):
                        table[item.id] = Declared(item, source)
                        ruleset.constraints.extend(_package_gate(item, source))

    def _add_rules(self, ruleset: RuleSet) -> None:
        seen: dict[str, SourceRef] = dict()
        components = list(ruleset.backends) + list(ruleset.dispatchers)
        cfg = F.config_fields()
        for doc, parsed in self.docs:
            check = _Checker(self, doc, ruleset)
            for section, target in (("constraints", ruleset.constraints), ("priorities", ruleset.priorities),
                                    ("dispatch", ruleset.dispatch), ("plan", ruleset.plan)):
                for index, item in enumerate(getattr(parsed, section)):
                    loc = (section, index)
                    source = _source(doc, loc)
                    if not self._unique(item.id, source, seen, doc, loc + ("id",)):
                        continue
                    rule = check.rule(section, item, loc, source, cfg, components)
                    if rule is not None:
                        target.append(rule)

    def _unique(self, name: str, source: SourceRef, seen: dict, doc: YamlDocument, loc, what: str = "id",
                owner: Optional[str] = None) -> bool:
        if name in seen:
            self.errors.append(doc.error(f"{what} {name!r} is already used at {seen[name]}", loc, rule=owner or name))
            return False
        seen[name] = source
        return True


class _Checker:
    """Reference and condition checks for the rules of one file."""

    def __init__(self, loader: _Loader, doc: YamlDocument, ruleset: RuleSet):
        self.loader, self.doc, self.ruleset = loader, doc, ruleset

    def fail(self, message: str, loc, rule: str, *, offset: int = 0, hint: Optional[str] = None) -> None:
        self.loader.errors.append(self.doc.error(message, loc, offset=offset, rule=rule, hint=hint))

    def refs(self, names, allowed, what: str, loc, rule: str) -> None:
        for index, name in enumerate(names or ()):
            if name not in allowed:
                close = suggest(name, allowed)
                self.fail(f"unknown {what} {name!r}", loc + (index,), rule,
                          hint=f"did you mean {close!r}?" if close else f"declared: {', '.join(allowed)}")

    def expr(self, text: Optional[str], fields: dict, loc, rule: str):
        if text is None:
            return None
        try:
            return parse(text, fields)
        except ExprError as error:
            self.fail(error.message, loc, rule, offset=error.offset, hint=error.hint)
            return None

    def rule(self, section: str, item, loc, source: SourceRef, cfg: dict, components: list[str]) -> Optional[Rule]:
        before = len(self.loader.errors)
        backends, dispatchers = list(self.ruleset.backends), list(self.ruleset.dispatchers)
        fields, require = cfg, None
        if isinstance(item, Constraint):
            if item.applies_to == "all_backends":
                fields = {**cfg, **F.backend_fields(backends)}
            else:
                self.refs(item.applies_to, components, "backend or dispatcher", loc + ("applies_to",), item.id)
            require = self.expr(item.require, fields, loc + ("require",), item.id)
            self._placeholders(item, loc)
        elif section == "priorities":
            self.refs(item.backends, backends, "backend", loc + (item.action,), item.id)
        elif section == "dispatch":
            self.refs([item.use], dispatchers, "dispatcher", loc + ("use",), item.id)
        elif isinstance(item, PlanRule):
            self.refs(item.backends, backends, "backend", loc + ("backends",), item.id)
            self.refs(item.dispatchers, dispatchers, "dispatcher", loc + ("dispatchers",), item.id)
            quant_stage = item.set.stage == PlanStage.quantization
            fields = {**cfg, **F.plan_fields(backends, dispatchers, quant_stage)}
            self._plan_values(item, loc, cfg)
        when = self.expr(item.when, fields, loc + ("when",), item.id)
        if len(self.loader.errors) > before:
            return None
        return Rule(item, source, when, require)

    def _placeholders(self, item: Constraint, loc) -> None:
        known = set(F.config_fields()) | {"backend"}
        for match in MESSAGE_PLACEHOLDER.finditer(item.message):
            if match.group(1) not in known:
                close = suggest(match.group(1), known)
                self.fail(f"unknown placeholder {{{match.group(1)}}} in message", loc + ("message",), item.id,
                          hint=f"did you mean {{{close}}}?" if close else None)

    def _plan_values(self, item: PlanRule, loc, cfg: dict) -> None:
        """scale_dim and dispatch_dtype may name a config field; check that it exists and fits."""
        scale_dim, dtype = item.set.scale_dim, item.set.dispatch_dtype
        if isinstance(scale_dim, str) and (scale_dim not in cfg or cfg[scale_dim].kind != "int"):
            close = suggest(scale_dim, [p for p, s in cfg.items() if s.kind == "int"])
            self.fail(f"scale_dim {scale_dim!r} is neither a number nor a number field of the config",
                      loc + ("set", "scale_dim"), item.id, hint=f"did you mean {close!r}?" if close else None)
        dtypes = ["input"] + [q.value for q in QuantDtype] + [p for p in cfg if p.endswith(".dtype")]
        if dtype is not None and dtype not in dtypes:
            close = suggest(dtype, dtypes)
            self.fail(f"dispatch_dtype {dtype!r} is not 'input', a quant dtype or a dtype field",
                      loc + ("set", "dispatch_dtype"), item.id, hint=f"did you mean {close!r}?" if close else None)


def _package_gate(component, source: SourceRef) -> list[Rule]:
    """The constraint an `external:`/`requires:` declaration implies, located at the declaration."""
    if not component.packages:
        return []
    names = [package.value for package in component.packages]
    require = " and ".join(f"platform.packages.{name}" for name in names)
    item = Constraint(id=f"package.{component.id}", applies_to=[component.id], require=require,
                      reason="package_missing",
                      message=f"needs the {', '.join(names)} package(s), which platform.packages does not list; "
                              "install it, or state it in a what-if config")
    return [Rule(item, source, None, parse(require, F.config_fields()))]


def _source(doc: YamlDocument, loc) -> SourceRef:
    """A rule's source line is the line of its `id` key (where a reader looks first)."""
    return SourceRef(file=doc.display, line=doc.position(loc + ("id",)).line)


def structure_error(doc: YamlDocument, detail: dict, root: type[BaseModel]) -> FileError:
    """One pydantic error of validating `doc` against `root`, at its file:line:col, with a did-you-mean."""
    loc = tuple(part for part in detail["loc"] if not (isinstance(part, str) and part.startswith("function-")))
    rule = _rule_id_at(doc.data, loc)
    hint, at_key = None, detail["type"] == "extra_forbidden"
    if at_key:
        model = _model_at(loc[:-1], root)
        close = suggest(str(loc[-1]), model.model_fields) if model else None
        message = f"unknown field {loc[-1]!r}"
        hint = f"did you mean {close!r}?" if close else (
            f"allowed: {', '.join(model.model_fields)}" if model else None)
    else:
        where = ".".join(str(p) for p in loc) or "file"
        message = f"{where}: {detail['msg']}"
        expected = re.findall(r"'([^']+)'", str(detail.get("ctx", {}).get("expected", "")))
        close = suggest(str(detail.get("input")), expected) if expected else None
        hint = f"did you mean {close!r}?" if close else None
        if "external" in loc or "requires" in loc:   # the package vocabulary is itself a rule file
            hint = f"{hint + ' Or d' if hint else 'D'}eclare a new package in rules/{PACKAGES_FILE} (packages:)"
    return doc.error(message, loc, rule=rule, hint=hint, at_key=at_key)


def _rule_id_at(data, loc) -> Optional[str]:
    if len(loc) >= 2 and isinstance(data, dict):
        items = data.get(loc[0])
        if isinstance(items, list) and isinstance(loc[1], int) and loc[1] < len(items):
            item = items[loc[1]]
            return item.get("id") if isinstance(item, dict) else None
    return None


def _model_at(loc, root: type[BaseModel]) -> Optional[type[BaseModel]]:
    """The model under `root` whose fields are valid at `loc` (for did-you-mean on unknown fields)."""
    model = root
    for part in loc:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(part)
        if info is None:
            return None
        nested = [t for t in _flatten_types(info.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def _flatten_types(annotation) -> list:
    args = typing.get_args(annotation)
    return [annotation] if not args else [t for arg in args for t in _flatten_types(arg)]
