"""Reading a text file the user named: bounded, decoded, parsed, and every failure a typed error.

One reader for every file moerules reads on a user's behalf (rule files, configs, golden
tables), so each refuses the same way: a path that is no regular file (a folder, a device, a
name the OS refuses as too long), a file over its size limit (read no further than the limit),
and bytes that are not UTF-8 text, with the line:col of the first bad byte.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Sequence

from moerules.errors import FileError, TableFileError


def is_regular_file(path: Path) -> bool:
    """Path.is_file, with names the OS refuses outright (too long, a NUL byte) counted as absent."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def is_folder(path: Path) -> bool:
    """Path.is_dir, with names the OS refuses outright counted as absent."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def read_text(path: Path, display: str, error_type: type[FileError], *, limit: int, split_hint: str) -> str:
    """The UTF-8 text of `path` (a leading byte-order mark dropped), or `error_type` naming `display`."""
    what = error_type.what
    if not is_regular_file(path):
        raise error_type(f"cannot read {what}: no such file, or not a regular file", file=display)
    try:
        with path.open("rb") as stream:
            data = stream.read(limit + 1)
    except OSError as error:
        raise error_type(f"cannot read {what}: {error.strerror or error}", file=display) from None
    if len(data) > limit:
        raise error_type(f"{what} larger than {limit:,} bytes", file=display, hint=split_hint)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        prefix = data[:error.start].decode("utf-8", "replace")
        line, col = line_col(prefix, len(prefix))
        binary = ": a binary file, not text" if b"\x00" in data[:8192] else ""
        raise error_type(f"invalid UTF-8 (byte {data[error.start]:#04x}){binary}", file=display, line=line, col=col,
                         hint=f"save the {what} as UTF-8 text") from None


def line_col(text: str, offset: int) -> tuple[int, int]:
    start = text.rfind("\n", 0, offset) + 1
    return text.count("\n", 0, offset) + 1, offset - start + 1


def csv_rows(text: str, source: str, columns: Sequence[str]) -> list[dict[str, str]]:
    """The rows of a CSV table with exactly `columns` (as this tool writes them), or a TableFileError."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader, None)
        if header != list(columns):
            shown = ", ".join(header[:12]) if header else "nothing"
            raise TableFileError(f"not a table moerules wrote: its header is {shown[:200]!s}, expected "
                                 f"{', '.join(columns)}", file=source, line=1, col=1)
        rows = []
        for values in reader:
            if len(values) != len(columns):
                raise TableFileError(f"{len(values)} fields where the header has {len(columns)}", file=source,
                                     line=reader.line_num, col=1)
            rows.append(dict(zip(columns, values)))
    except csv.Error as error:
        raise TableFileError(f"not a CSV table: {error}", file=source, line=reader.line_num, col=1) from None
    return rows
