"""Safe YAML with positions: plain Python data plus the line:col of every node.

Uses PyYAML's composer and SafeConstructor only, so loading can never run code or build
arbitrary objects. Duplicate keys are errors (PyYAML would silently keep the last one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

from moerules.errors import RuleFileError

Loc = tuple  # path of keys and indices from the document root


@dataclass(frozen=True)
class Position:
    line: int
    col: int
    quoted: bool  # a quoted scalar's text starts one column after the mark


class YamlDocument:
    """The data of one YAML file and where each part of it was written."""

    def __init__(self, path: Path, display: str):
        self.path, self.display = path, display
        self.positions: dict[Loc, Position] = {}
        self.key_positions: dict[Loc, Position] = {}
        self._constructor = SafeConstructor()
        try:
            node = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            raise RuleFileError(f"invalid YAML: {error.problem or error.context}", file=display,
                                line=mark.line + 1 if mark else 0, col=mark.column + 1 if mark else 0) from None
        except (OSError, UnicodeDecodeError) as error:
            raise RuleFileError(f"cannot read rule file: {error}", file=display) from None
        self.data: Any = {} if node is None else self._convert(node, ())

    def _convert(self, node: yaml.Node, loc: Loc) -> Any:
        if node.tag.startswith("tag:yaml.org,2002:python") or not node.tag.startswith("tag:yaml.org,2002:"):
            raise RuleFileError(f"YAML tag {node.tag!r} is not allowed: rule files are plain data",
                                file=self.display, line=node.start_mark.line + 1, col=node.start_mark.column + 1)
        self.positions[loc] = Position(node.start_mark.line + 1, node.start_mark.column + 1,
                                       isinstance(node, yaml.ScalarNode) and node.style in ("'", '"'))
        if isinstance(node, yaml.MappingNode):
            result: dict = {}
            for key_node, value_node in node.value:
                key = self._constructor.construct_object(key_node)
                if not isinstance(key, str):
                    raise self.error(f"mapping keys must be strings, not {key!r}", loc)
                if key in result:
                    raise RuleFileError(f"duplicate key {key!r}", file=self.display,
                                        line=key_node.start_mark.line + 1, col=key_node.start_mark.column + 1)
                self.key_positions[loc + (key,)] = Position(key_node.start_mark.line + 1,
                                                            key_node.start_mark.column + 1, False)
                result[key] = self._convert(value_node, loc + (key,))
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self._convert(item, loc + (index,)) for index, item in enumerate(node.value)]
        return self._constructor.construct_object(node)

    def position(self, loc: Loc) -> Position:
        """Position of `loc`, or of its nearest written ancestor."""
        loc = tuple(loc)
        while loc and loc not in self.positions:
            loc = loc[:-1]
        return self.positions.get(loc, Position(1, 1, False))

    def error(self, message: str, loc: Loc, *, offset: int = 0, rule=None, hint=None,
              at_key: bool = False) -> RuleFileError:
        pos = self.key_positions[tuple(loc)] if at_key and tuple(loc) in self.key_positions else self.position(loc)
        col = pos.col + int(pos.quoted) + offset
        return RuleFileError(message, file=self.display, line=pos.line, col=col, rule=rule, hint=hint)
