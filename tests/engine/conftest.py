"""Helpers for decision-level tests: config builders and mutated copies of the default rules."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from moerules.resources import default_rules_dir

SECTIONS = ("constraints", "priorities", "dispatch", "plan", "backends", "dispatchers")


@pytest.fixture
def rules_without(tmp_path):
    """Copy the default rules with the named rules deleted: the mutant a lost rule creates."""

    def make(*rule_ids: str) -> Path:
        out = tmp_path / ("without-" + "-".join(rule_ids))
        shutil.copytree(default_rules_dir(), out)
        found = set()
        for file in out.glob("*.yaml"):
            data = yaml.safe_load(file.read_text())
            for section in SECTIONS:
                kept = [item for item in data.get(section, []) if item["id"] not in rule_ids]
                found |= {item["id"] for item in data.get(section, [])} - {item["id"] for item in kept}
                if section in data:
                    data[section] = kept
            file.write_text(yaml.safe_dump(data, sort_keys=False))
        missing = set(rule_ids) - found
        assert not missing, f"rules {missing} are not in the default rule set"
        return out

    return make
