"""The golden decision matrix on disk: one sorted text file per platform, one line per cell.

A line reads `<cell>: <winner> <field>=<value> ...`. The winner is the selected backend, or the
outcome in parentheses (`(unsupported)`, `(error)`); a field appears only where it differs from its
usual value (`USUAL`), so most lines are a cell and a backend, and a rule change rewrites exactly
the lines of the cells whose decision changed. Every field `matrix.compare` checks is recorded.

The explanation column (`rules`) is not: it is derived from the rules, `compare` never looks at it,
and stored it was three quarters of a 42 MB table and changed lines whose decision had not.
`moerules diff OLD NEW` gives both sides' explanations of a change.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from moerules.tools.matrix import COLUMNS
from moerules.engine.textfile import is_folder, read_text
from moerules.errors import TableFileError
from moerules.limits import MAX_TABLE_BYTES

FIELDS = COLUMNS[1:-1]  # what `compare` checks: everything but the cell name and the explanation
# The value most selected cells have (a single-GPU bf16 layer picked in auto mode); a field of a cell
# that is not selected is usually empty.
USUAL = {"outcome": "selected", "prepare_finalize": "local", "selected_by": "auto", "quantized_by": "none",
         "expects_unquantized_inputs": "False", "dispatch_dtype": "bf16", "scale_dim": "0", "weight_block": "0",
         "hidden_pad": "0", "intermediate_pad": "0", "expert_placement": "contiguous"}
HEADER = ("# moerules decision matrix, {platform}: `<cell>: <backend or (outcome)> <field>=<value> ...`, "
          "sorted by cell; fields at their usual value are left out: " +
          " ".join(f"{k}={v}" for k, v in USUAL.items() if k != "outcome") +
          " (other fields empty). Regenerate with `moerules matrix`.\n")
_BARE = re.compile(r'[^\s"]+')
_FIELD = re.compile(r' (\w+)=("(?:[^"\\]|\\.)*"|[^\s"]+)')
_LINE = re.compile(r'(?P<cell>\S+): (?P<winner>\S+)(?P<fields>.*)')


def _usual(field: str, outcome: str) -> str:
    return USUAL.get(field, "") if outcome == "selected" else ""


def _value(text: str) -> str:
    return text if _BARE.fullmatch(text) else json.dumps(text)


def format_line(row: dict) -> str:
    outcome = row["outcome"]
    winner = row["backend"] if outcome == "selected" else f"({outcome})"
    shown = [f for f in FIELDS if f != "outcome" and not (f == "backend" and outcome == "selected")]
    extra = "".join(f" {f}={_value(row.get(f, ''))}" for f in shown if row.get(f, "") != _usual(f, outcome))
    return f"{row['cell']}: {winner}{extra}"


def platform_of(cell: str) -> str:
    return cell.split("|", 1)[0]


def file_name(platform: str) -> str:
    return platform.replace(":", "-") + ".txt"


def to_files(rows: list[dict]) -> dict[str, str]:
    """file name -> text: the rows of each platform, sorted by cell."""
    by_platform: dict[str, list[dict]] = {}
    for row in rows:
        by_platform.setdefault(platform_of(row["cell"]), []).append(row)
    return {file_name(platform): HEADER.format(platform=platform) +
            "".join(format_line(r) + "\n" for r in sorted(chosen, key=lambda r: r["cell"]))
            for platform, chosen in sorted(by_platform.items())}


def write(folder: Path, rows: list[dict]) -> None:
    """Write the golden files into `folder`, removing the files of platforms no longer in the matrix."""
    files = to_files(rows)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in sorted(folder.glob("*.txt")):
        if stale.name not in files:
            stale.unlink()
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")


def parse_line(line: str, source: str, number: int) -> dict:
    """The row of one line (all of FIELDS, no explanation), or a TableFileError at `source`:`number`."""
    match = _LINE.fullmatch(line)
    if match is None:
        raise TableFileError("not a matrix line: expected `<cell>: <backend> <field>=<value> ...`",
                             file=source, line=number, col=1)
    winner = match["winner"]
    outcome = winner[1:-1] if winner.startswith("(") and winner.endswith(")") else "selected"
    row = {"cell": match["cell"], **{f: _usual(f, outcome) for f in FIELDS}, "outcome": outcome}
    if outcome == "selected":
        row["backend"] = winner
    rest = match["fields"]
    for field in _FIELD.finditer(rest):
        if field[1] not in FIELDS or field[1] == "outcome":
            raise TableFileError(f"unknown field {field[1]!r}; a matrix line has {', '.join(FIELDS[1:])}",
                                 file=source, line=number, col=match.start("fields") + field.start() + 2)
        row[field[1]] = json.loads(field[2]) if field[2].startswith('"') else field[2]
    if "".join(f[0] for f in _FIELD.finditer(rest)) != rest:
        raise TableFileError("not a matrix line: fields are ` <field>=<value>`, a value with spaces in quotes",
                             file=source, line=number, col=1)
    return row


def parse(text: str, source: str) -> dict[str, dict]:
    """cell -> row of one golden file written by `to_files`; anything else is a TableFileError naming `source`."""
    rows: dict[str, dict] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        row = parse_line(line, source, number)
        if row["cell"] in rows:
            raise TableFileError(f"cell {row['cell']} appears twice", file=source, line=number, col=1)
        rows[row["cell"]] = row
    return rows


def read(folder: Path, regenerate: str) -> dict[str, dict]:
    """cell -> row over every golden file in `folder`; a missing or empty folder is a TableFileError too."""
    files = sorted(folder.glob("*.txt")) if is_folder(folder) else []
    if not files:
        raise TableFileError("no golden matrix here (no <platform>.txt files)", file=str(folder),
                             hint=f"run `{regenerate}` and commit the files")
    rows: dict[str, dict] = {}
    hint = f"regenerate it with `{regenerate}` and commit it"
    for path in files:
        part = parse(read_text(path, str(path), TableFileError, limit=MAX_TABLE_BYTES, split_hint=hint), str(path))
        if part.keys() & rows.keys():
            raise TableFileError(f"cell {min(part.keys() & rows.keys())} is also in another file", file=str(path))
        rows.update(part)
    return rows
