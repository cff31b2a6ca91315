"""The machinery behind matrix, lint and diff: the decision cache, the process pool, the progress
line. Small cell subsets keep these quick; speed itself is measured by bench/tools.py."""

from __future__ import annotations

import io
import logging

import pytest

from moerules.config import MoEConfig
from moerules.tools import matrix, matrix_golden, pool
from moerules.tools.cli.main import main
from moerules.tools.decision_cache import DecisionCache, config_key
from moerules.engine.loader import load_rules
from moerules.tools.progress import progress
from moerules.resources import default_rules_dir

from decision_helpers import config


@pytest.fixture(scope="module")
def ruleset():
    return load_rules()


@pytest.fixture(scope="module")
def sample(ruleset):
    """Every 400th matrix cell: each platform, scheme and parallel layout shows up."""
    return list(matrix.cells(ruleset.backends))[::400]


def test_the_pool_writes_the_same_golden_files_as_one_process(ruleset, sample):
    one = matrix_golden.to_files(matrix.build_rows(ruleset, cells_=sample, workers=1))
    two = matrix_golden.to_files(matrix.build_rows(ruleset, cells_=sample, workers=2))
    assert one == two


def test_a_cache_hit_gives_identical_rows_without_deciding(ruleset, sample, tmp_path, monkeypatch):
    first = matrix.build_rows(ruleset, cells_=sample, cache_root=tmp_path)

    def must_not_decide(task, ruleset, evaluator, configs, workers, progress):
        assert configs == [], f"{len(configs)} configs decided despite a warm cache"
        return []
    monkeypatch.setattr(pool, "_map", must_not_decide)
    assert matrix.build_rows(ruleset, cells_=sample, cache_root=tmp_path) == first


def test_a_corrupt_cache_file_is_reported_once_and_rebuilt(ruleset, sample, tmp_path, caplog):
    expected = matrix.build_rows(ruleset, cells_=sample[:20], cache_root=tmp_path)
    [file] = tmp_path.glob("*.sqlite")
    for part in tmp_path.glob("*.sqlite*"):
        part.write_bytes(b"not a database" * 100)
    with caplog.at_level(logging.WARNING, logger="moerules"):
        assert matrix.build_rows(ruleset, cells_=sample[:20], cache_root=tmp_path) == expected
    [warning] = caplog.messages
    assert "unusable" in warning and str(file) in warning
    cache = DecisionCache(tmp_path, ruleset.hash, "durable", matrix.record.__qualname__)
    assert len(cache.get_many(config_key(c.config) for c in sample[:20])) == 20   # rebuilt and refilled


def test_rule_sets_do_not_share_cached_rows(ruleset, rules_without, tmp_path):
    cells = [c for c in matrix.cells(ruleset.backends) if c.key.endswith("|a2a=nixl_ep")][:30]
    mutant = load_rules(rules_without("dispatch.a2a.nixl_ep"))
    original = matrix.build_rows(ruleset, cells_=cells, cache_root=tmp_path)
    mutated = matrix.build_rows(mutant, cells_=cells, cache_root=tmp_path)
    assert mutated == matrix.build_rows(mutant, cells_=cells) != original
    assert {r["failure_reason"] for r in mutated} == {"no_dispatcher"}


def test_the_config_key_does_not_depend_on_set_order():
    a = config(platform={"vendor": "cuda", "arch": "sm_90", "packages": ["triton", "aiter", "deep_gemm"]})
    b = config(platform={"vendor": "cuda", "arch": "sm_90", "packages": ["deep_gemm", "aiter", "triton"]})
    assert config_key(a) == config_key(b) and '"packages":["aiter","deep_gemm","triton"]' in config_key(a)
    assert MoEConfig.model_validate_json(config_key(a)) == a


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream, quiet, shown", [(_Terminal(), False, True), (_Terminal(), True, False),
                                                  (io.StringIO(), False, False)])
def test_progress_draws_only_on_a_terminal_and_not_when_quiet(stream, quiet, shown):
    bar = progress(10, "matrix", quiet=quiet, stream=stream)
    for _ in range(10):
        bar.advance()
    bar.close()
    assert ("\rmatrix: 10/10 cells" in stream.getvalue()) == shown
    assert stream.getvalue().count("\r") <= 2 if shown else stream.getvalue() == ""


@pytest.mark.parametrize("quiet", [False, True])
def test_diff_shows_progress_on_a_terminal_unless_quiet(quiet, monkeypatch, capsys):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    rules = str(default_rules_dir())
    assert main(["diff", rules, rules, "--no-matrix", "--random", "40"] + (["--quiet"] if quiet else [])) == 0
    assert ("diff new: 40/40 cells" in terminal.getvalue()) != quiet
