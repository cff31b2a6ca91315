"""Fuzzing the readers: adversarial YAML, configs and mutated real rule files end in a typed
moerules error or a result, never another exception, a crash or a hang.

`--hypothesis-profile=deep` runs 10,000 examples per target (reports/fuzz.md has the last run).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moerules import load_rules
from moerules.tools.cli.main import build_config, make_parser
from moerules.engine.decide import decide
from moerules.errors import ConfigFileError, MoeRulesError, RuleFileError, RuleSetError
from moerules.resources import default_rules_dir

# The deep profile's 100,000 examples per property would take hours here (a rule load costs
# milliseconds); 10,000 per target is the deep fuzz run.
FUZZ = settings(max_examples=min(settings.default.max_examples, 10_000),
               suppress_health_check=[*settings.default.suppress_health_check, HealthCheck.function_scoped_fixture])

RULE_FILES = sorted(default_rules_dir().glob("*.yaml"))
RULE_LINES = [line for file in RULE_FILES for line in file.read_text().splitlines()]
EXAMPLE_LINES = [line for file in sorted(Path(__file__).parents[2].glob("examples/*.yaml"))
                 for line in file.read_text().splitlines()]
HOSTILE = ["!!int ", "!!float ", "!!timestamp ", "!!binary ", "!!python/object:os.system ", "!foo ", "!!set ",
           "!!omap ", "<<: ", "&a ", "*a ", "&b ", "*b ", "? ", "- ", ": ", "{", "}", "[", "]", ",", "'", '"',
           "\t", "\x00", "\x07", "\x1b", "\ufeff", "\u00b2", "\uff19\uff10", ".inf", ".nan", "-.inf", "1e999",
           "0x" + "f" * 40, "9" * 30, "9" * 5000, "[" * 200, "not " * 100, "(" * 100, "~", "null", "yes", "%YAML 1.1",
           "---", "...", "#", "\n", "  "]
SCALARS = st.one_of(st.integers(), st.floats(), st.booleans(), st.none(), st.text(max_size=20),
                    st.sampled_from(HOSTILE))


def adversarial_text(lines: list[str]) -> st.SearchStrategy[bytes]:
    piece = st.one_of(st.sampled_from(lines), st.sampled_from(HOSTILE), st.text(max_size=30),
                      st.integers(0, 2000).map(lambda n: "[" * n))
    text = st.lists(piece, max_size=40).map(lambda parts: "\n".join(parts).encode("utf-8", "surrogatepass"))
    return st.one_of(text, st.binary(max_size=300))


@pytest.fixture
def folder(request, tmp_path_factory):
    """One folder per test, reused by its examples (hypothesis runs them all in one test call)."""
    return tmp_path_factory.mktemp(request.node.name)


def load_typed(folder: Path, name: str, data: bytes) -> None:
    """Load `folder` with `data` as `name`; a rule set or a RuleSetError of RuleFileErrors, nothing else."""
    (folder / name).write_bytes(data)
    try:
        load_rules(folder)
        event("loaded")
    except RuleSetError as error:
        assert error.errors and all(isinstance(e, RuleFileError) and e.file for e in error.errors)
        event("typed error")


@FUZZ
@given(data=adversarial_text(RULE_LINES))
def test_adversarial_rule_file(folder, data):
    shutil.copy(RULE_FILES[0], folder)  # the components, so conditions get past the reference checks
    load_typed(folder, "99-fuzz.yaml", data)


def config_dicts() -> st.SearchStrategy[dict]:
    value = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                         max_leaves=10)
    fields = st.sampled_from(["num_experts", "top_k", "hidden_size", "moe_intermediate_size", "activation", "tp", "dp",
                              "expert_parallel", "vendor", "arch", "packages", "family", "backend", "lora", "model"])
    section = st.dictionaries(fields, value, max_size=5)
    model = st.one_of(st.sampled_from(["mixtral-8x7b", "gpt-oss-120b", "mixtrall"]), section)
    return st.fixed_dictionaries({"model": model}, optional={s: section for s in
                                                             ("quant", "parallel", "platform", "features")})


@FUZZ
@given(data=st.one_of(adversarial_text(EXAMPLE_LINES),
                      config_dicts().map(lambda d: yaml.safe_dump(d, allow_unicode=True).encode())))
def test_adversarial_config_file(folder, data):
    path = folder / "config.yaml"
    path.write_bytes(data)
    try:
        config = build_config(make_parser().parse_args(["decide", str(path)]))
    except ConfigFileError as error:
        assert error.file == str(path)
        event("typed error")
        return
    try:
        decide(config)
        event("decided")
    except MoeRulesError:  # a pinned backend that is unknown or rejected
        event("typed error")


def mutate(data: dict, rng: random.Random, values: list) -> None:
    """One random edit of a parsed rule file: drop, replace, duplicate or swap a value somewhere in it."""
    node = data
    while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        if not isinstance(node[key], (dict, list)) or not node[key]:
            break
        node = node[key]
    if not node or not isinstance(node, (dict, list)):
        return
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    key, other = rng.choice(keys), rng.choice(keys)
    operation = rng.choice(["drop", "replace", "duplicate", "swap"])
    if operation == "drop":
        del node[key]
    elif operation == "replace":
        node[key] = rng.choice(values)
    elif operation == "duplicate" and isinstance(node, list):
        node.append(node[key])
    else:
        node[key], node[other] = node[other], node[key]


def leaves(data) -> list:
    if isinstance(data, dict):
        return [leaf for value in data.values() for leaf in leaves(value)]
    if isinstance(data, list):
        return [leaf for value in data for leaf in leaves(value)]
    return [data]


PARSED = {file.name: yaml.safe_load(file.read_text()) for file in RULE_FILES}
VALUES = sorted({repr(v): v for v in leaves(list(PARSED.values()))}.values(), key=repr)


@FUZZ
@given(name=st.sampled_from(sorted(PARSED)), seed=st.integers(0, 2 ** 32), edits=st.integers(1, 4),
       values=st.lists(SCALARS, max_size=3))
def test_mutated_rule_file(folder, name, seed, edits, values):
    rng = random.Random(seed)
    data = yaml.safe_load(yaml.safe_dump(PARSED[name]))  # a deep copy
    for _ in range(edits):
        mutate(data, rng, VALUES + values)
    for stale in folder.glob("*.yaml"):
        stale.unlink()
    shutil.copy(RULE_FILES[0], folder)
    load_typed(folder, name, yaml.safe_dump(data, allow_unicode=True).encode())
