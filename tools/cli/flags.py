"""Command-line flags generated from the MoEConfig models: one flag per field of every section.

The pydantic models are the one source: each flag's name, type, choices and help come from
its field (the Field description, the Enum/Literal values, the default), so a field added
to a section is a flag without further work, and a test walks the models to prove it.
"""

from __future__ import annotations

import argparse
import enum
import typing
from dataclasses import dataclass
from typing import Callable, Optional

from pydantic.fields import FieldInfo

from moerules.config import MoEConfig
from moerules.engine.expr import suggest

# Short spellings the CLI had before the flags were generated; kept as aliases.
ALIASES = {("quant", "family"): ("--quant",), ("parallel", "expert_parallel"): ("--ep",),
           ("parallel", "all2all_backend"): ("--all2all",)}


@dataclass(frozen=True)
class ConfigFlag:
    """One config field as a command-line option."""

    section: str
    field: str
    names: tuple[str, ...]   # the generated name first, then any alias

    @property
    def dest(self) -> str:
        return f"config__{self.section}__{self.field}"


def config_flags(reserved: frozenset[str] = frozenset()) -> list[ConfigFlag]:
    """Every field of every MoEConfig section: `--<field>`, or `--<section>-<field>` where the bare
    name is another section's field too or `reserved` (an option the command already has)."""
    fields = [(section, name) for section, info in MoEConfig.model_fields.items()
              for name in _model(info).model_fields]
    counts: dict[str, int] = {}
    for _, name in fields:
        counts[name] = counts.get(name, 0) + 1
    flags = []
    for section, name in fields:
        bare = "--" + name.replace("_", "-")
        own = bare if counts[name] == 1 and bare not in reserved else f"--{section}-{name.replace('_', '-')}"
        flags.append(ConfigFlag(section, name, (own,) + ALIASES.get((section, name), ())))
    return flags


def add_config_flags(parser: argparse.ArgumentParser, reserved: frozenset[str] = frozenset()) -> list[ConfigFlag]:
    """Add one option group per config section; the flags' values are read back by `flag_sections`."""
    flags = config_flags(reserved)
    groups = {}
    for flag in flags:
        if flag.section not in groups:
            groups[flag.section] = parser.add_argument_group(
                f"{flag.section} section", f"MoEConfig.{flag.section} fields (override the config file or preset)")
        info = _model(MoEConfig.model_fields[flag.section]).model_fields[flag.field]
        groups[flag.section].add_argument(*flag.names, dest=flag.dest, default=None, **_option(flag.field, info))
    return flags


def flag_sections(args: argparse.Namespace, flags: list[ConfigFlag]) -> dict[str, dict]:
    """The sections the given flags set: {section: {field: value}} (flags left out are absent)."""
    sections: dict[str, dict] = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is not None:
            sections.setdefault(flag.section, {})[flag.field] = value
    return sections


def _model(info: FieldInfo):
    return info.annotation


def _option(name: str, info: FieldInfo) -> dict:
    """argparse keywords for a field: its type or choices, and help from its description."""
    kind, choices = _kind(info.annotation)
    described = info.description or ""
    default = "" if info.is_required() or "default" in described else f" (default: {_shown(info.default)})"
    text = described.rstrip(".") + default
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction, "help": text}
    if choices:
        listed = ", ".join(choices)
        if kind is frozenset:
            return {"type": _comma_list(choices), "metavar": "A,B,...", "help": f"{text}; comma-separated of: {listed}"}
        return {"type": _choice(choices), "metavar": name.upper(), "help": f"{text}; one of: {listed}"}
    return {"type": kind, "metavar": name.upper(), "help": text}


def _kind(annotation) -> tuple[type, Optional[list[str]]]:
    """(python type, the allowed values where closed) of a field annotation, Optional[...] unwrapped."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Union and len(args) == 1:
        return _kind(args[0])
    if origin is typing.Literal:
        return str, [str(a) for a in args]
    if origin is frozenset:
        return frozenset, _kind(args[0])[1]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return str, [member.value for member in annotation]
    if annotation in (bool, int, float, str):
        return annotation, None
    raise TypeError(f"no command-line type for a field of type {annotation!r}: teach tools/cli/flags.py")


def _shown(default) -> str:
    if isinstance(default, enum.Enum):
        return default.value
    if isinstance(default, frozenset):
        return ",".join(sorted(getattr(item, "value", item) for item in default)) or "none"
    return str(default)


def _refusal(text: str, choices: list[str]) -> argparse.ArgumentTypeError:
    close = next((choice for choice in choices if choice.startswith(text)), None) if text else None
    close = close or suggest(text, choices)
    hint = f"; did you mean {close}?" if close else ""
    return argparse.ArgumentTypeError(f"{text[:40]!r} is not one of: {', '.join(choices)}{hint}")


def _choice(choices: list[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise _refusal(text, choices)
        return text
    parse.__name__ = "choice"
    return parse


def _comma_list(choices: list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [item for item in text.split(",") if item]
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise _refusal(unknown[0], choices)
        return items
    parse.__name__ = "list"
    return parse
