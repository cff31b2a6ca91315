"""Safe YAML with positions: plain Python data plus the line:col of every node.

Uses PyYAML's composer and SafeConstructor only, so loading can never run code or build
arbitrary objects. Duplicate keys are errors (PyYAML would silently keep the last one).
Hostile input (deep nesting, recursive or exploding aliases, control characters, numbers
the engines cannot carry) is refused at the offending node, within the limits of
`moerules.limits`; every failure is the document's typed error with file:line:col.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import SafeConstructor

from moerules.errors import FileError, RuleFileError
from moerules.limits import MAX_FILE_BYTES, MAX_INT_DIGITS, MAX_YAML_DEPTH, MAX_YAML_NODES
from moerules.engine.textfile import line_col, read_text

Loc = tuple  # path of keys and indices from the document root

_CORE = "tag:yaml.org,2002:"
# The tags plain data needs, per kind of node; any other (python/*, !local, !!set, !!omap, ...)
# would build objects or shapes that rule files and configs do not have.
_ALLOWED_TAGS = {
    yaml.ScalarNode: {_CORE + t for t in ("str", "int", "float", "bool", "null", "timestamp", "binary")},
    yaml.SequenceNode: {_CORE + "seq"},
    yaml.MappingNode: {_CORE + "map"},
}
_PLAIN_DATA = "write plain strings, numbers, booleans, lists and mappings"


@dataclass(frozen=True)
class Position:
    line: int
    col: int
    quoted: bool  # a quoted scalar's text starts one column after the mark


class _BoundedLoader(yaml.SafeLoader):
    """A SafeLoader whose composer refuses, at the offending node and before Python's stack or
    memory runs out: nesting deeper than MAX_YAML_DEPTH, an alias inside its own anchor, and
    more than MAX_YAML_NODES nodes once aliases are expanded (our converter expands them)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth, self.open_anchors, self.sizes = 0, set(), {}

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) and event.anchor in self.open_anchors:
            raise ComposerError(None, None, f"alias *{event.anchor} is inside its own anchor (a recursive alias)",
                                event.start_mark)
        if self.depth == MAX_YAML_DEPTH:
            raise ComposerError(None, None, f"nesting deeper than {MAX_YAML_DEPTH} levels", event.start_mark)
        opened = event.anchor if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)) else None
        self.depth += 1
        self.open_anchors.add(opened)  # None when nothing is anchored here; no alias is named None
        node = super().compose_node(parent, index)
        self.depth -= 1
        self.open_anchors.discard(opened)
        self._count(node)
        return node

    def _count(self, node: yaml.Node) -> None:
        if id(node) in self.sizes:  # an alias: its anchor was counted when it was composed
            return
        children = node.value if isinstance(node, yaml.SequenceNode) else (
            [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else [])
        size = 1 + sum(self.sizes[id(child)] for child in children)
        if size > MAX_YAML_NODES:
            raise ComposerError(None, None, f"this node expands to more than {MAX_YAML_NODES:,} nodes "
                                            "(each use of an alias counts its whole anchor)", node.start_mark)
        self.sizes[id(node)] = size


def _shown(text: str) -> str:
    """A value quoted in a message, cut short: it may be megabytes long."""
    return repr(text if len(text) <= 40 else text[:40] + "...")


class YamlDocument:
    """The data of one YAML file and where each part of it was written.

    `error` is the typed error raised for this kind of file (RuleFileError, ConfigFileError).
    """

    def __init__(self, path: Path, display: str, error: type[FileError] = RuleFileError):
        self.path, self.display, self.error_type = path, display, error
        self.positions: dict[Loc, Position] = {}
        self.key_positions: dict[Loc, Position] = {}
        self._constructor = SafeConstructor()
        node = self._compose(self._read(path))
        if node is None:
            raise self._at(1, 1, f"empty {error.what}", "write at least one section, or delete the file")
        self.data: Any = self._convert(node, ())

    def _at(self, line: int, col: int, message: str, hint=None) -> FileError:
        return self.error_type(message, file=self.display, line=line, col=col, hint=hint)

    def _at_node(self, node: yaml.Node, message: str, hint=None) -> FileError:
        return self._at(node.start_mark.line + 1, node.start_mark.column + 1, message, hint)

    def _read(self, path: Path) -> str:
        return read_text(path, self.display, self.error_type, limit=MAX_FILE_BYTES,
                         split_hint="split it into several files")

    def _compose(self, text: str):
        try:
            return yaml.compose(text, Loader=_BoundedLoader)
        except yaml.reader.ReaderError as error:  # a control character; PyYAML gives only its offset
            raise self._at(*line_col(text, error.position), f"control character U+{error.character:04X} is "
                           "not allowed in YAML", "delete it, or write it as an escape in a double-quoted string") from None
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            raise self._at(mark.line + 1 if mark else 0, mark.column + 1 if mark else 0,
                           f"invalid YAML: {error.problem or error.context}") from None
        except RecursionError:  # the composer bounds nesting; this is the last line of defence
            raise self._at(0, 0, "invalid YAML: nested too deeply", f"nest at most {MAX_YAML_DEPTH} levels") from None

    def _convert(self, node: yaml.Node, loc: Loc) -> Any:
        self._check_tag(node)
        self.positions[loc] = Position(node.start_mark.line + 1, node.start_mark.column + 1,
                                       isinstance(node, yaml.ScalarNode) and node.style in ("'", '"'))
        if isinstance(node, yaml.MappingNode):
            result: dict = {}
            for key_node, value_node in node.value:
                key = self._key(key_node)
                if key in result:
                    raise self._at_node(key_node, f"duplicate key {key!r}")
                self.key_positions[loc + (key,)] = Position(key_node.start_mark.line + 1,
                                                            key_node.start_mark.column + 1, False)
                result[key] = self._convert(value_node, loc + (key,))
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self._convert(item, loc + (index,)) for index, item in enumerate(node.value)]
        return self._scalar(node)

    def _check_tag(self, node: yaml.Node) -> None:
        if node.tag == _CORE + "merge":
            raise self._at_node(node, f"merge keys (<<) are not supported in {self.error_type.what}s: "
                                      "write the keys out")
        if node.tag not in _ALLOWED_TAGS[type(node)]:
            raise self._at_node(node, f"YAML tag {node.tag!r} is not allowed: {self.error_type.what}s are plain data",
                                _PLAIN_DATA)

    def _key(self, node: yaml.Node) -> str:
        self._check_tag(node)
        key = self._scalar(node) if isinstance(node, yaml.ScalarNode) else None
        if not isinstance(key, str):
            shown = repr(key) if isinstance(node, yaml.ScalarNode) else f"a {node.id}"
            raise self._at_node(node, f"mapping keys must be strings, not {shown}", "quote the key")
        return key

    def _scalar(self, node: yaml.ScalarNode) -> Any:
        """The scalar's value; a value its tag cannot read, or a number the engines cannot carry, is an error."""
        # Checked before int() runs: a long literal is out of range anyway, and int() refuses 4,300 digits.
        if node.tag == _CORE + "int" and len(node.value.replace("_", "")) > MAX_INT_DIGITS + 3:  # sign, 0x
            raise self._out_of_range(node)
        try:
            value = self._constructor.construct_object(node)
        except Exception as error:  # noqa: BLE001 - each constructor fails its own way (ValueError, binascii.Error, ...)
            raise self._at_node(node, f"{_shown(node.value)} is not a valid {node.tag[len(_CORE):]}: {error}",
                                "fix the value, or quote it (without a tag) to make it a string") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not abs(value) < 10 ** MAX_INT_DIGITS:
            raise self._out_of_range(node)  # also inf and nan, which compare False
        return value

    def _out_of_range(self, node: yaml.ScalarNode) -> FileError:
        return self._at_node(node, f"number {_shown(node.value)} is out of range: numbers are finite and have at "
                                   f"most {MAX_INT_DIGITS} digits", "rule engines carry 64-bit numbers; quote it if it is text")

    def position(self, loc: Loc) -> Position:
        """Position of `loc`, or of its nearest written ancestor."""
        loc = tuple(loc)
        while loc and loc not in self.positions:
            loc = loc[:-1]
        return self.positions.get(loc, Position(1, 1, False))

    def error(self, message: str, loc: Loc, *, offset: int = 0, rule=None, hint=None,
              at_key: bool = False) -> FileError:
        pos = self.key_positions[tuple(loc)] if at_key and tuple(loc) in self.key_positions else self.position(loc)
        col = pos.col + int(pos.quoted) + offset
        return self.error_type(message, file=self.display, line=pos.line, col=col, rule=rule, hint=hint)
