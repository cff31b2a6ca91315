"""The README's console examples are the real output: each ```console block that starts with
`$ moerules ...` is run and compared line by line (a line `...` skips lines, a trailing `...`
elides the rest of a line), at 100 columns."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from moerules.tools.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```console\n\$ (moerules [^\n]+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
EXAMPLES = _BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8"))


def mismatch(shown: list[str], real: list[str]) -> str:
    """'' if `shown` matches `real` (with `...` elisions), else the first shown line that does not."""
    at = 0
    for index, line in enumerate(shown):
        if line == "...":
            continue
        skipping = index > 0 and shown[index - 1] == "..."
        while at < len(real) and not _same(line, real[at]) and skipping:
            at += 1
        if at == len(real) or not _same(line, real[at]):
            return f"README line {line!r} is not the output (next real line: {real[at] if at < len(real) else 'EOF'!r})"
        at += 1
    return ""


def _same(shown: str, real: str) -> bool:
    return real.startswith(shown[:-3]) if shown.endswith("...") else real == shown


def test_the_readme_has_console_examples():
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("command,shown", EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_a_readme_example_is_the_real_output(command, shown, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "100")
    assert main(shlex.split(command)[1:]) in (0, 1)
    problem = mismatch(shown.rstrip("\n").split("\n"), capsys.readouterr().out.rstrip("\n").split("\n"))
    assert problem == "", f"{command}: {problem}"


def test_the_matcher_catches_a_drift():
    real = ["a", "b", "c d", "e"]
    assert mismatch(["a", "...", "c ...", "e"], real) == ""
    assert mismatch(["a", "c d"], real) != ""            # consecutive unless `...`
    assert mismatch(["a", "...", "x"], real) != ""       # a line not in the output
    assert mismatch(["a", "b", "c e..."], real) != ""    # a wrong prefix


def test_every_moerules_command_line_the_readme_shows_parses():
    from moerules.tools.cli.main import make_parser
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = [line.split("#")[0].strip() for line in re.findall(r"^\$? ?(moerules [^\n`]+)$", text, re.MULTILINE)]
    assert len(lines) >= 5
    for line in lines:
        make_parser().parse_args(shlex.split(line)[1:])  # argparse exits 2 on an option the CLI lost
