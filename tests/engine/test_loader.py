"""Rule files are data: errors name file:line:col, the rule and a fix; loading runs no code."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moerules import load_rules
from moerules.errors import RuleSetError
from moerules.resources import default_rules_dir


def write(tmp_path: Path, text: str) -> Path:
    shutil.copy(default_rules_dir() / "10-components.yaml", tmp_path / "10-components.yaml")
    (tmp_path / "99-test.yaml").write_text(text)
    return tmp_path


def only_error(tmp_path, text):
    with pytest.raises(RuleSetError) as raised:
        load_rules(write(tmp_path, text))
    [error] = raised.value.errors
    return error


def test_invalid_yaml_reports_line_and_column(tmp_path):
    error = only_error(tmp_path, "version: 1\nconstraints:\n  - id: x\n    when: [unclosed\n")
    assert error.file.endswith("99-test.yaml") and error.line == 5 and "invalid YAML" in error.message


def test_unknown_field_suggests_the_nearest(tmp_path):
    with pytest.raises(RuleSetError) as raised:
        load_rules(write(tmp_path, "version: 1\nconstraints:\n  - id: x.y\n    applies_to: [triton]\n"
                                   "    require: features.lora\n    reason: lora_unsupported\n    mesage: hi\n"))
    missing, error = raised.value.errors  # the required field the typo leaves out, and the typo
    assert missing.message == "constraints.0.message: Field required"
    assert (error.line, error.col, error.rule) == (7, 5, "x.y")
    assert error.message == "unknown field 'mesage'" and error.hint == "did you mean 'message'?"


def test_unknown_condition_field_points_into_the_expression(tmp_path):
    error = only_error(tmp_path, "version: 1\nconstraints:\n  - id: x.y\n    applies_to: [triton]\n"
                                 "    require: platform.arhc == gfx950\n    reason: arch_unsupported\n    message: m\n")
    assert (error.line, error.col) == (5, 14)
    assert error.message == "unknown field 'platform.arhc'" and error.hint == "did you mean 'platform.arch'?"


def test_bad_enum_value_in_a_condition(tmp_path):
    error = only_error(tmp_path, "version: 1\nconstraints:\n  - id: x.y\n    applies_to: [triton]\n"
                                 "    require: quant.family == fp8_w8a9\n    reason: quant_unsupported\n    message: m\n")
    assert error.message == "'fp8_w8a9' is not a value of 'quant.family'" and error.hint == "did you mean 'fp8_w8a8'?"
    assert error.col == 14 + len("quant.family == ")


def test_unknown_backend_reference(tmp_path):
    error = only_error(tmp_path, "version: 1\npriorities:\n  - id: p\n    order: [triton, trtion]\n")
    assert (error.line, error.rule, error.message, error.hint) == (4, "p", "unknown backend 'trtion'",
                                                                   "did you mean 'triton'?")


def test_unknown_reason_code(tmp_path):
    error = only_error(tmp_path, "version: 1\nconstraints:\n  - id: c\n    applies_to: [triton]\n"
                                 "    require: features.lora\n    reason: lora_unsuported\n    message: m\n")
    assert (error.line, error.rule, error.hint) == (6, "c", "did you mean 'lora_unsupported'?")


def test_duplicate_ids_and_keys(tmp_path):
    with pytest.raises(RuleSetError) as raised:
        load_rules(write(tmp_path, "version: 1\ndispatch:\n  - id: a\n    when: parallel.use_ep\n    use: local\n"
                                   "  - id: a\n    when: parallel.use_ep\n    use: local\n    use: local\n"))
    assert {e.message for e in raised.value.errors} == {"duplicate key 'use'"}


def test_loading_never_executes_code(tmp_path):
    error = only_error(tmp_path, "version: 1\ndescription: !!python/object/apply:os.system ['echo pwned']\n")
    assert error.message == "YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed: " \
                            "rule files are plain data" and error.line == 2


def test_the_default_rules_load_and_carry_the_schema_line():
    ruleset = load_rules()
    assert len(ruleset.backends) >= 10 and len(ruleset.rules()) > 80
    for file in sorted(default_rules_dir().glob("*.yaml")):
        assert file.read_text().startswith("# yaml-language-server: $schema=../schema/rulefile.schema.json"), file


def test_content_hash_ignores_formatting(tmp_path):
    shutil.copytree(default_rules_dir(), tmp_path / "r")
    file = tmp_path / "r" / "60-dispatch.yaml"
    file.write_text(file.read_text().replace("# Which", "#   reformatted comment\n# Which"))
    assert load_rules(tmp_path / "r").hash == load_rules().hash


@pytest.mark.parametrize("condition,operator,hint", [
    ("platform.cc => 90", "=>", "did you mean '>='?"),
    ("platform.arch = gfx950", "=", "did you mean '=='?"),
    ("features.lora && parallel.use_ep", "&&", "did you mean 'and'?"),
    ("platform.arch is gfx950", "is", "did you mean '=='?"),
])
def test_unknown_operators_suggest_the_right_one(tmp_path, condition, operator, hint):
    error = only_error(tmp_path, f"version: 1\ndispatch:\n  - id: d\n    when: {condition}\n    use: local\n")
    assert (error.message, error.hint, error.line) == (f"unknown operator {operator!r}", hint, 4)
    assert error.col == 11 + condition.index(operator)
