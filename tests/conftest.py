"""Shared test setup: the Triton interpreter on CPUs, hypothesis profiles (`ci` by default,
`deep` for >= 100k examples per property: `pytest tests/properties --hypothesis-profile=deep`)
and mutated copies of the rules.
"""

import os
import shutil
from pathlib import Path

import torch

# On a CPU, Triton kernels run in Triton's interpreter. TRITON_INTERPRET must be set before
# triton is first imported by any test module, so it is set here, at the top of collection.
# The interpreter computes tl.dot wrongly for bf16 operands, so interpreter tests use fp16.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import yaml
from hypothesis import HealthCheck, settings

from moerules.resources import default_rules_dir

# Properties about selected decisions `assume()` a selection; many drawn configs are (rightly)
# unsupported, so filtering is expected.
_QUIET = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=50, deadline=None, derandomize=True, suppress_health_check=_QUIET)
settings.register_profile("deep", max_examples=100_000, deadline=None, suppress_health_check=_QUIET)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _private_decision_cache(tmp_path_factory, monkeypatch):
    """Tools under test keep their decision cache in this run's temp folder, never the user's."""
    monkeypatch.setenv("MOERULES_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "decision-cache"))


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
