"""The condition language of rule files: a small, typed, side-effect-free expression syntax.

    platform.arch == gfx950 and quant.family in [mxfp4_w4a16, mxfp4_w4a4]
    not features.lora or model.hidden_align >= 256

Grammar (no arithmetic: derived numbers are computed fields of the config schema):

    expr   := conj ('or' conj)*
    conj   := unary ('and' unary)*
    unary  := 'not' unary | '(' expr ')' | test
    test   := FIELD [('=='|'!='|'<'|'<='|'>'|'>=') VALUE | ['not'] 'in' '[' VALUE (',' VALUE)* ']']

A bare FIELD must be boolean. Parsing never evaluates anything; names are checked against
the declared field table with did-you-mean suggestions, and values against the field's type.
`normalize` pushes negation down to the comparisons, because durable-rules silently
ignores an expression-level `$not`.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Union

from moerules.limits import MAX_EXPR_DEPTH, MAX_INT_DIGITS

Scalar = Union[int, bool, str]


@dataclass(frozen=True)
class FieldSpec:
    """What a rule may read: a dotted path, its kind and (for enums) the allowed values."""

    path: str
    kind: str  # "int" | "bool" | "enum" | "str"
    values: tuple[str, ...] = ()
    fact: str = "cfg"  # which fact carries it: the config, or the dispatch plan


class ExprError(Exception):
    """A syntax or type error at `offset` characters into the expression text."""

    def __init__(self, message: str, offset: int, hint: Optional[str] = None):
        super().__init__(message)
        self.message, self.offset, self.hint = message, offset, hint


@dataclass(frozen=True)
class Cmp:
    field: FieldSpec
    op: str  # == != < <= > >=
    value: Scalar


@dataclass(frozen=True)
class In:
    field: FieldSpec
    values: tuple[Scalar, ...]
    negated: bool


@dataclass(frozen=True)
class And:
    items: tuple["Expr", ...]


@dataclass(frozen=True)
class Or:
    items: tuple["Expr", ...]


@dataclass(frozen=True)
class Not:
    item: "Expr"


Expr = Union[Cmp, In, And, Or, Not]

_TOKEN = re.compile(r"\s*(?:(?P<op>==|!=|<=|>=|<|>|\(|\)|\[|\]|,)|(?P<num>-?[0-9]+)(?![\w.])"
                    r"|(?P<str>'[^']*'|\"[^\"]*\")|(?P<name>[A-Za-z_][\w.]*))")
_TRAILING_SPACE = re.compile(r"\s*\Z")
_NEGATED_OP = {"==": "!=", "!=": "==", "<": ">=", ">=": "<", ">": "<=", "<=": ">"}
# Operators people write from other languages, and what this language spells them as.
_OPERATOR_HINTS = {"=>": ">=", "=<": "<=", "<>": "!=", "=": "==", "&&": "and", "||": "or", "!": "not",
                   "is": "==", "equals": "==", "eq": "==", "ne": "!=", "contains": "in", "&": "and", "|": "or"}


def _operator_hint(word: str) -> str:
    known = _OPERATOR_HINTS.get(word)
    return f"did you mean {known!r}?" if known else "operators: == != < <= > >= in, not in, and, or, not"


def suggest(name: str, candidates) -> Optional[str]:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


class _Parser:
    def __init__(self, text: str, fields: Mapping[str, FieldSpec]):
        self.text, self.fields = text, fields
        self.tokens = self._tokenize(text)
        self.pos = 0
        self.depth = 0  # open `not`s and parentheses: each costs stack frames

    @staticmethod
    def _tokenize(text: str) -> list[tuple[str, str, int]]:
        tokens, at = [], 0
        while at < len(text):
            if _TRAILING_SPACE.match(text, at):  # not text[at:].strip(): that copies, quadratic in the length
                break
            match = _TOKEN.match(text, at)
            if not match or match.end() == at:
                bad = at + len(text[at:]) - len(text[at:].lstrip())
                word = next((w for w in ("=>", "=<", "<>", "&&", "||", "=", "!", "&", "|") if text.startswith(w, bad)),
                            text[bad])
                raise ExprError(f"unknown operator {word!r}", bad, _operator_hint(word))
            kind = match.lastgroup
            tokens.append((kind, match.group(kind), match.start(kind)))
            at = match.end()
        tokens.append(("end", "", len(text)))
        return tokens

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.pos]

    def take(self) -> tuple[str, str, int]:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def expect(self, value: str) -> None:
        kind, text, at = self.take()
        if text != value:
            raise ExprError(f"expected {value!r}, found {text or 'end of expression'!r}", at)

    def is_word(self, word: str) -> bool:
        kind, text, _ = self.peek()
        return kind == "name" and text == word

    def parse(self) -> Expr:
        expr = self.disjunction()
        kind, text, at = self.peek()
        if kind != "end":
            raise ExprError(f"unexpected {text!r}; join tests with 'and' / 'or'", at)
        return expr

    def disjunction(self) -> Expr:
        items = [self.conjunction()]
        while self.is_word("or"):
            self.take()
            items.append(self.conjunction())
        return items[0] if len(items) == 1 else Or(tuple(items))

    def conjunction(self) -> Expr:
        items = [self.unary()]
        while self.is_word("and"):
            self.take()
            items.append(self.unary())
        return items[0] if len(items) == 1 else And(tuple(items))

    def unary(self) -> Expr:
        if not (self.is_word("not") or self.peek()[1] == "("):
            return self.test()
        kind, text, at = self.take()
        self.depth += 1
        if self.depth > MAX_EXPR_DEPTH:
            raise ExprError(f"conditions nest at most {MAX_EXPR_DEPTH} levels of 'not' and parentheses", at,
                            "simplify the condition, or split it into several rules")
        if text == "not":
            inner: Expr = Not(self.unary())
        else:
            inner = self.disjunction()
            self.expect(")")
        self.depth -= 1
        return inner

    def field(self) -> FieldSpec:
        kind, name, at = self.take()
        if kind != "name" or name in ("and", "or", "not", "in", "true", "false"):
            raise ExprError(f"expected a field name, found {name or 'end of expression'!r}", at)
        spec = self.fields.get(name)
        if spec is None:
            close = suggest(name, self.fields)
            raise ExprError(f"unknown field {name!r}", at, f"did you mean {close!r}?" if close else
                            "see `moerules schema` for the fields rules may read")
        return spec

    def test(self) -> Expr:
        spec = self.field()
        kind, text, at = self.peek()
        if kind == "op" and text in _NEGATED_OP:
            self.take()
            return self._comparison(spec, text, at)
        if self.is_word("not") or self.is_word("in"):
            negated = self.is_word("not")
            if negated:
                self.take()
                if not self.is_word("in"):
                    raise ExprError("expected 'in' after 'not'", self.peek()[2])
            self.take()
            return In(spec, self._value_list(spec), negated)
        if kind == "name" and text in _OPERATOR_HINTS:
            raise ExprError(f"unknown operator {text!r}", at, _operator_hint(text))
        if spec.kind != "bool":
            raise ExprError(f"field {spec.path!r} is {spec.kind}; compare it with an operator", at)
        return Cmp(spec, "==", True)

    def _comparison(self, spec: FieldSpec, op: str, at: int) -> Cmp:
        if op in ("<", "<=", ">", ">=") and spec.kind != "int":
            raise ExprError(f"operator {op!r} needs a number field; {spec.path!r} is {spec.kind}", at)
        return Cmp(spec, op, self._value(spec))

    def _value_list(self, spec: FieldSpec) -> tuple[Scalar, ...]:
        self.expect("[")
        values = [self._value(spec)]
        while self.peek()[1] == ",":
            self.take()
            values.append(self._value(spec))
        self.expect("]")
        if len(set(values)) != len(values):
            raise ExprError(f"duplicate value in the list for {spec.path!r}", self.tokens[self.pos - 1][2])
        return tuple(values)

    def _value(self, spec: FieldSpec) -> Scalar:
        kind, text, at = self.take()
        if spec.kind == "int":
            if kind != "num":
                raise ExprError(f"{spec.path!r} is a number; {text!r} is not", at)
            if len(text.lstrip("-")) > MAX_INT_DIGITS:
                raise ExprError(f"numbers have at most {MAX_INT_DIGITS} digits", at,
                                "rule engines carry 64-bit numbers")
            return int(text)
        if spec.kind == "bool":
            if text not in ("true", "false"):
                raise ExprError(f"{spec.path!r} is a boolean; use true or false, not {text!r}", at)
            return text == "true"
        if kind not in ("name", "str", "num"):
            raise ExprError(f"expected a value for {spec.path!r}, found {text or 'end of expression'!r}", at)
        value = text[1:-1] if kind == "str" else text
        if spec.kind == "enum" and value not in spec.values:
            close = suggest(value, spec.values)
            raise ExprError(f"{value!r} is not a value of {spec.path!r}", at,
                            f"did you mean {close!r}?" if close else f"valid: {', '.join(spec.values)}")
        return value


def parse(text: str, fields: Mapping[str, FieldSpec]) -> Expr:
    """Parse and type-check `text`; raises ExprError with the offending offset."""
    if not isinstance(text, str) or not text.strip():
        raise ExprError("empty condition", 0)
    return _Parser(text, fields).parse()


def normalize(expr: Expr, negate: bool = False) -> Expr:
    """Negation normal form: `Not` disappears, comparisons absorb it (De Morgan)."""
    if isinstance(expr, Not):
        return normalize(expr.item, not negate)
    if isinstance(expr, Cmp):
        return Cmp(expr.field, _NEGATED_OP[expr.op], expr.value) if negate else expr
    if isinstance(expr, In):
        return In(expr.field, expr.values, expr.negated != negate)
    items = tuple(normalize(item, negate) for item in expr.items)
    flip = isinstance(expr, And) == negate
    return Or(items) if flip else And(items)


def fields_of(expr: Expr) -> set[str]:
    if isinstance(expr, (Cmp, In)):
        return {expr.field.path}
    if isinstance(expr, Not):
        return fields_of(expr.item)
    return set().union(*(fields_of(item) for item in expr.items))


def render(expr: Expr) -> str:
    """Canonical text of an expression (used in messages and content hashes)."""
    if isinstance(expr, Cmp):
        return f"{expr.field.path} {expr.op} {_lit(expr.value)}"
    if isinstance(expr, In):
        values = ", ".join(_lit(v) for v in expr.values)
        return f"{expr.field.path} {'not in' if expr.negated else 'in'} [{values}]"
    if isinstance(expr, Not):
        return f"not ({render(expr.item)})"
    joiner = " and " if isinstance(expr, And) else " or "
    return "(" + joiner.join(render(item) for item in expr.items) + ")"


def _lit(value: Scalar) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)
