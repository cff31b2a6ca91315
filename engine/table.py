"""Plain aligned text tables whose last column wraps to fit a width (a terminal's)."""

from __future__ import annotations

import textwrap

_MIN_LAST = 40   # narrower than this, the last column would wrap a few words a line: put it under the row
_UNDER = "    "  # the indent of a last column put under its row


def table(headers: list[str], rows: list[list[str]], width: int) -> list[str]:
    """Left-aligned columns two spaces apart. The last column wraps to keep each line within
    `width`; where the other columns leave it too little room it goes, wrapped, under its row."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lead = sum(widths[:-1]) + 2 * (len(widths) - 1)
    beside = width - lead >= _MIN_LAST
    if not beside:
        headers, widths = headers[:-1], widths[:-1]
    else:
        widths[-1] = min(widths[-1], width - lead)
    out = [_line(headers, widths), _line(["-" * w for w in widths], widths)]
    for row in rows:
        if beside:
            pieces = textwrap.wrap(row[-1], width - lead, break_on_hyphens=False) or [""]
            out.append(_line(row[:-1] + [pieces[0]], widths))
            out += [" " * lead + piece for piece in pieces[1:]]
        else:
            out.append(_line(row[:-1], widths))
            out += textwrap.wrap(row[-1], max(width, 2 * _MIN_LAST), initial_indent=_UNDER,
                                 subsequent_indent=_UNDER, break_on_hyphens=False)
    return out


def _line(cells: list[str], widths: list[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()
