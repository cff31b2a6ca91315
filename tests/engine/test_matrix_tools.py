"""`moerules diff` and `mutate` as a user runs them (small, quick variants of the CI runs)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile

import pytest
import yaml

from moerules.tools import mutate
from moerules.tools.cli.main import main
from moerules.engine.loader import load_rules
from moerules.tools.ruleset_source import resolve
from moerules.resources import default_rules_dir


def test_diff_reports_changed_decisions_with_the_responsible_rule(rules_without, capsys):
    mutant = rules_without("marlin.cc75")   # Marlin then claims sm_70 and sm_75 layers
    assert main(["diff", str(default_rules_dir()), str(mutant), "--no-matrix", "--random", "400", "--json",
                 "--fail-on-change"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["configs"] == 400 and report["changed"] == len(report["changes"]) > 0
    for change in report["changes"]:
        assert change["new_backend"] == "marlin"
        assert "marlin.cc75" in change["rules"]


def test_diff_of_identical_rules_is_empty(capsys):
    assert main(["diff", str(default_rules_dir()), str(default_rules_dir()), "--no-matrix", "--random", "200",
                 "--fail-on-change"]) == 0
    assert "0 changed decision(s) of 200" in capsys.readouterr().out


@pytest.fixture
def rules_repo(tmp_path):
    """A git repository whose one commit holds the default rules."""
    repo = tmp_path / "repo"
    shutil.copytree(default_rules_dir(), repo / "rules")
    git = lambda *args: subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args],  # noqa: E731
                                       check=True, capture_output=True)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "rules v1")
    return repo


def test_diff_reads_git_refs(rules_repo, capsys, monkeypatch):
    repo = rules_repo
    quant = repo / "rules" / "30-quant.yaml"
    data = yaml.safe_load(quant.read_text())
    data["constraints"] = [c for c in data["constraints"] if c["id"] != "batched_triton.no_int8"]
    quant.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(repo)
    assert main(["diff", "HEAD", "rules", "--no-matrix", "--random", "3000", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["old"] == load_rules().hash and report["changed"] > 0
    assert any(c["new_backend"] == "batched_triton" and "batched_triton.no_int8" in c["rules"]
               for c in report["changes"])
    assert main(["diff", "no-such-ref", "rules", "--no-matrix", "--random", "1"]) == 2
    assert "neither a path nor a git ref" in capsys.readouterr().err


def test_a_git_ref_is_read_without_leaving_files_behind(rules_repo, tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert resolve("HEAD", rules_repo).hash == load_rules().hash
    assert list(scratch.iterdir()) == []


def test_mutants_cover_every_rule_and_a_sample_is_killed():
    ruleset = load_rules()
    all_mutants = list(mutate.mutants(ruleset))
    assert {m.rule for m in all_mutants} == {r.id for r in ruleset.rules()}
    assert {m.operator for m in all_mutants} == {"delete", "negate", "weaken"}
    outcomes = mutate.run(ruleset, sample=4, seed=7)
    assert len(outcomes) == 4 and all(o.killed for o in outcomes), [o.to_dict() for o in outcomes if not o.killed]
