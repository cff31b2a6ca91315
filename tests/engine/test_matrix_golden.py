"""The golden matrix files: one line per cell, every compared field kept, and a rule change that
rewrites only the lines of the cells whose decision changed."""

from __future__ import annotations

import difflib
import shutil

import pytest
import yaml

from moerules.tools import matrix, matrix_golden
from moerules.engine.loader import load_rules
from moerules.errors import TableFileError
from moerules.resources import default_rules_dir

PLAIN = {"cell": "cuda:sm_90|x", "outcome": "selected", "backend": "triton", "alternatives": "",
         "fallback_rule": "", "failure_reason": "", "refused_by": "", "rules": "dispatch.local quant.unquantized",
         **{k: v for k, v in matrix_golden.USUAL.items() if k != "outcome"}}


def decided(row: dict) -> dict:
    """A row as the golden files keep it: without the explanation."""
    return {k: v for k, v in row.items() if k != "rules"}


def test_a_cell_at_the_usual_values_is_its_key_and_backend():
    assert matrix_golden.format_line(PLAIN) == "cuda:sm_90|x: triton"


def test_unusual_values_are_written_readably_and_read_back():
    selected = {**PLAIN, "alternatives": "marlin humming", "scale_dim": "1", "prepare_finalize": "deepep_ll"}
    error = {**dict.fromkeys(matrix.COLUMNS, ""), "cell": "cuda:sm_90|y", "outcome": "error",
             "failure_reason": 'no rule decides "x"\n  at 10-x.yaml:3'}
    assert matrix_golden.format_line(selected) == \
        'cuda:sm_90|x: triton alternatives="marlin humming" prepare_finalize=deepep_ll scale_dim=1'
    assert matrix_golden.format_line(error) == \
        r'cuda:sm_90|y: (error) failure_reason="no rule decides \"x\"\n  at 10-x.yaml:3"'
    [text] = matrix_golden.to_files([error, selected]).values()
    assert matrix_golden.parse(text, "t.txt") == {"cuda:sm_90|x": decided(selected), "cuda:sm_90|y": decided(error)}


@pytest.fixture(scope="module")
def ruleset():
    return load_rules()


def test_the_files_keep_every_compared_field_of_real_cells(ruleset, tmp_path):
    sample = list(matrix.cells(ruleset.backends))[::300]
    rows = matrix.build_rows(ruleset, cells_=sample, workers=1)
    matrix_golden.write(tmp_path, rows)
    (tmp_path / "rocm-gfx000.txt").write_text("# a platform the matrix no longer has\n")
    matrix_golden.write(tmp_path, rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {matrix_golden.file_name(matrix_golden.platform_of(r["cell"])) for r in rows})
    assert matrix_golden.read(tmp_path, "regen") == {r["cell"]: decided(r) for r in rows}
    assert {r["outcome"] for r in rows} == {"selected", "unsupported"}


@pytest.mark.parametrize("line, message, col", [
    ("cuda:sm_90|x triton", "not a matrix line: expected `<cell>: <backend> <field>=<value> ...`", 1),
    ("cuda:sm_90|x: triton bogus=1", "unknown field 'bogus'; a matrix line has backend, alternatives,", 22),
    ("cuda:sm_90|x: triton scale_dim=1 junk", "not a matrix line: fields are ` <field>=<value>`", 1),
    ("cuda:sm_90|x: triton\ncuda:sm_90|x: marlin", "cell cuda:sm_90|x appears twice", 1),
])
def test_a_malformed_line_is_a_table_error_at_its_place(line, message, col):
    with pytest.raises(TableFileError) as caught:
        matrix_golden.parse("# header\n" + line + "\n", "m/cuda-sm_90.txt")
    assert caught.value.message.startswith(message)
    assert (caught.value.file, caught.value.line, caught.value.col) == ("m/cuda-sm_90.txt", line.count("\n") + 2, col)


def test_a_missing_golden_folder_or_a_cell_in_two_files_is_a_table_error(tmp_path):
    expected = r"no golden matrix here \(no <platform>.txt files\) \(run `moerules matrix --out m` and commit"
    with pytest.raises(TableFileError, match=expected):
        matrix_golden.read(tmp_path / "absent", "moerules matrix --out m")
    (tmp_path / "a.txt").write_text("cuda:sm_90|x: triton\n")
    (tmp_path / "b.txt").write_text("cuda:sm_90|x: triton\n")
    with pytest.raises(TableFileError, match=r"b.txt: cell cuda:sm_90\|x is also in another file"):
        matrix_golden.read(tmp_path, "regen")


def swapped_priority(out):
    """A scratch copy of the rules with one priority changed: on SM90, FP8 Triton ranks before vLLM CUTLASS."""
    shutil.copytree(default_rules_dir(), out)
    path = out / "32-fp8-int8-mxfp8.yaml"
    data = yaml.safe_load(path.read_text())
    [rule] = [p for p in data["priorities"] if p["id"] == "fp8.order.sm90"]
    first, second = rule["order"].index("vllm_cutlass"), rule["order"].index("triton")
    rule["order"][first], rule["order"][second] = "triton", "vllm_cutlass"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def changed_lines(old: dict[str, str], new: dict[str, str]) -> tuple[list[str], list[str]]:
    removed, added = [], []
    for name in sorted(old.keys() | new.keys()):
        for line in difflib.unified_diff(old.get(name, "").splitlines(), new.get(name, "").splitlines(), n=0):
            if line.startswith(("-", "+")) and not line.startswith(("---", "+++")):
                (removed if line[0] == "-" else added).append(line[1:])
    return removed, added


def test_one_priority_change_rewrites_only_the_lines_of_the_changed_cells(ruleset, tmp_path):
    mutant = load_rules(swapped_priority(tmp_path / "rules"))
    cells = [c for c in matrix.cells(ruleset.backends) if c.key.startswith(("cuda:sm_90|fp8_w8a8", "cuda:sm_89|fp8"))]
    before, after = (matrix.build_rows(r, cells_=cells, workers=1) for r in (ruleset, mutant))
    changes = matrix.compare({r["cell"]: r for r in before}, {r["cell"]: r for r in after})
    removed, added = changed_lines(matrix_golden.to_files(before), matrix_golden.to_files(after))
    assert changes and all(c.cell.startswith("cuda:sm_90") for c in changes)   # SM89 cells: one file untouched
    assert [line.split(": ")[0] for line in removed] == [line.split(": ")[0] for line in added] == \
        [c.cell for c in changes]
    new = {r["cell"]: r for r in after}
    assert added == [matrix_golden.format_line(new[c.cell]) for c in changes]


def test_matrix_writes_the_files_and_check_catches_the_changed_priority(ruleset, tmp_path, monkeypatch, capsys):
    from moerules.tools.cli import main as cli
    from moerules.tools import matrix_html
    cells = [c for c in matrix.cells(ruleset.backends) if c.key.startswith("cuda:sm_90|fp8_w8a8/channel")]
    every_page_cell = matrix_html.page_cells
    monkeypatch.setattr(cli, "_matrix_cells", lambda _: cells)
    monkeypatch.setattr(matrix_html, "page_cells", lambda: every_page_cell([("cuda", "sm_90")]))
    out, mutant = tmp_path / "m", swapped_priority(tmp_path / "rules")
    assert cli.main(["matrix", "--out", str(out), "--quiet"]) == 0
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["cuda-sm_90.txt", "index.html"]
    assert cli.main(["matrix", "--check", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["matrix", "--check", "--out", str(out), "--quiet", "--rules", str(mutant), "--limit", "1"]) == 2
    first, more, total = capsys.readouterr().out.splitlines()[:3]
    assert first.startswith("cuda:sm_90|fp8_w8a8/channel@compressed_tensors|") and ": vllm_cutlass -> triton (alternatives: " in first
    assert more.startswith("... and ") and total == f"{int(more.split()[2]) + 1} changed decision(s) of {len(cells)}"
