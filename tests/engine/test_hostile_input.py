"""Malformed and hostile rule files and configs end in a typed error at file:line:col, never a
crash, a hang or an exception from yaml, pydantic or int(). Limits: `moerules.limits`."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from pydantic import ValidationError

from moerules import MoEConfig, load_rules
from moerules.tools.cli.main import build_config, main, make_parser
from moerules.errors import ConfigFileError, RuleSetError
from moerules.limits import MAX_FILE_BYTES
from moerules.resources import default_rules_dir

CONSTRAINT = "version: 1\nconstraints:\n  - id: x\n    applies_to: [triton]\n    require: '{}'\n" \
             "    reason: lora_unsupported\n    message: m\n"
# Nine lines, each alias level 9 times the one before: 9**8 nodes if aliases were expanded freely.
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))

CASES = {  # name: (file bytes, line, col, message fragment)
    "bad int": (b"version: !!int abc\n", 1, 10, "'abc' is not a valid int"),
    "bad float": (b"version: !!float x\n", 1, 10, "'x' is not a valid float"),
    "bad timestamp": (b"version: !!timestamp nope\n", 1, 10, "'nope' is not a valid timestamp"),
    "bad binary": (b"description: !!binary 'a'\n", 1, 14, "'a' is not a valid binary"),
    "local tag key": (b"!foo a: x\n", 1, 1, "YAML tag '!foo' is not allowed"),
    "int key": (b"!!int 5: x\n", 1, 1, "mapping keys must be strings, not 5"),
    "sequence key": (b"? [a, b]\n: x\n", 1, 3, "mapping keys must be strings, not a sequence"),
    "unhashable key": (b"? {a: [b]}\n: x\n", 1, 3, "mapping keys must be strings, not a mapping"),
    "set tag": (b"version: 1\nbackends: !!set {a: null}\n", 2, 11, "YAML tag 'tag:yaml.org,2002:set' is not allowed"),
    "merge key": (b"base: &x {a: 1}\nother:\n  <<: *x\n", 3, 3, "merge keys (<<) are not supported in rule files"),
    "control character": (b"version: 1\ndescription: a\x07b\n", 2, 15, "control character U+0007"),
    "NUL": (b"version: 1\x00\n", 1, 11, "control character U+0000"),
    "invalid UTF-8": (b"version: 1\ndescription: \xff\xfe\n", 2, 14, "invalid UTF-8 (byte 0xff)"),
    "binary file": (bytes(range(256)), 2, 118, "invalid UTF-8 (byte 0x80)"),
    "empty file": (b"", 1, 1, "empty rule file"),
    "comments only": (b"# nothing\n", 1, 1, "empty rule file"),
    "deep nesting": (b"x: " + b"[" * 10_000, 1, 67, "nesting deeper than 64 levels"),
    "recursive alias": (b"x: &a [*a]\n", 1, 8, "alias *a is inside its own anchor"),
    "billion laughs": (LAUGHS.encode(), 6, 4, "expands to more than 100,000 nodes"),
    "5000 digits": (b"version: " + b"9" * 5000 + b"\n", 1, 10, "is out of range"),
    "19 digits": (b"version: 1234567890123456789\n", 1, 10, "at most 18 digits"),
    "hex over 64 bits": (b"version: 0xffffffffffffffffff\n", 1, 10, "is out of range"),
    "inf": (b"version: .inf\n", 1, 10, "'.inf' is out of range"),
    "nan": (b"version: .nan\n", 1, 10, "'.nan' is out of range"),
    "huge float": (b"version: 1.0e+300\n", 1, 10, "is out of range"),
    "nested parentheses": (CONSTRAINT.format("(" * 5000 + "features.lora" + ")" * 5000).encode(), 5, 47,
                           "conditions nest at most 32 levels"),
    "nested not": (CONSTRAINT.format("not " * 5000 + "features.lora").encode(), 5, 143,
                   "conditions nest at most 32 levels"),
    "5000-digit condition": (CONSTRAINT.format("model.hidden_size > " + "9" * 5000).encode(), 5, 35,
                             "numbers have at most 18 digits"),
    "non-ASCII digits in a condition": (CONSTRAINT.format("model.hidden_size > \u0665").encode(), 5, 35,
                                        "unknown operator"),
}


def load_error(tmp_path, data: bytes):
    shutil.copy(default_rules_dir() / "10-components.yaml", tmp_path)  # conditions name its backends
    (tmp_path / "99-test.yaml").write_bytes(data)
    with pytest.raises(RuleSetError) as raised:
        load_rules(tmp_path)
    [error] = raised.value.errors
    return error


@pytest.mark.parametrize("name", CASES)
def test_hostile_rule_file_is_a_typed_error_at_its_position(tmp_path, name):
    data, line, col, fragment = CASES[name]
    error = load_error(tmp_path, data)
    assert error.file.endswith("99-test.yaml") and (error.line, error.col) == (line, col)
    assert fragment in error.message, error.message


def test_byte_order_mark_is_not_part_of_the_text(tmp_path):
    (tmp_path / "99-test.yaml").write_bytes(b"\xef\xbb\xbfversion: 1\ndispatch: []\n")
    assert load_rules(tmp_path / "99-test.yaml").files


def test_shared_aliases_within_the_node_limit_load(tmp_path):
    (tmp_path / "99-test.yaml").write_text("version: 1\nx: &a [1, 2]\ny: [*a, *a]\n")
    with pytest.raises(RuleSetError) as raised:  # the aliases load; `x` and `y` are no sections
        load_rules(tmp_path)
    assert [(e.line, e.message) for e in raised.value.errors] == [(2, "unknown field 'x'"), (3, "unknown field 'y'")]


def test_directory_and_oversized_file_are_refused_whole(tmp_path):
    (tmp_path / "x.yaml").mkdir()
    error = load_error(tmp_path, b"version: 1\n")  # 99-test.yaml is fine; x.yaml is the error
    assert error.file.endswith("x.yaml") and error.line == 0 and "not a regular file" in error.message
    (tmp_path / "x.yaml").rmdir()
    error = load_error(tmp_path, b"#" * (MAX_FILE_BYTES + 1))
    assert error.line == 0 and f"larger than {MAX_FILE_BYTES:,} bytes" in error.message


def test_billion_laughs_is_refused_promptly_in_a_fresh_process(tmp_path):
    (tmp_path / "99-test.yaml").write_text(LAUGHS)
    script = ("import sys; from moerules import load_rules; from moerules.errors import RuleSetError\n"
              "try: load_rules(sys.argv[1])\nexcept RuleSetError as e: print(e.errors[0].message)")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert "expands to more than 100,000 nodes" in done.stdout, done.stderr


MODEL = {"num_experts": 8, "top_k": 2, "hidden_size": 64, "moe_intermediate_size": 64}


@pytest.mark.parametrize("arch", ["sm_\u00b2", "sm_" + "9" * 5000, "sm_\uff19\uff10", "sm_", "sm_12345",
                                  "gfx9\u0665\u0660", "\u212a", "x" * 33, ""])
def test_arch_is_short_ascii(arch):
    vendor = "rocm" if arch.startswith("gfx") else "cpu" if arch in ("\u212a", "x" * 33, "") else "cuda"
    with pytest.raises(ValidationError, match="arch"):
        MoEConfig(model=MODEL, platform={"vendor": vendor, "arch": arch})


def test_arch_within_limits_is_accepted():
    assert MoEConfig(model=MODEL, platform={"vendor": "cuda", "arch": "SM_1200"}).platform.cc == 1200


@pytest.mark.parametrize("section, field", [("model", "hidden_size"), ("model", "moe_intermediate_size"),
                                            ("model", "top_k"), ("parallel", "tp"), ("parallel", "dp")])
def test_config_numbers_stay_within_what_both_engines_carry(section, field):
    """A number past 64 bits would compare differently in durable (C) and the reference (Python)."""
    data = {"model": dict(MODEL), "parallel": {}}
    data[section][field] = 2 ** 64 + 64
    with pytest.raises(ValidationError, match=f"{section}.{field}"):
        MoEConfig(**data)


def config_error(path) -> ConfigFileError:
    with pytest.raises(ConfigFileError) as raised:
        build_config(make_parser().parse_args(["decide", str(path)]))
    return raised.value


@pytest.mark.parametrize("text, line, col, fragment", [
    ("model: {num_experts: 8, top_k: 2, hidden_size: 64, moe_intermediate_size: 64, activaton: silu}\n", 1, 79,
     "unknown field 'activaton'"),
    ("model: {num_experts: 8, top_k: 2, hidden_size: 64, intermediate_size: 6144}\n", 1, 71,
     "model.intermediate_size: model.intermediate_size was renamed model.moe_intermediate_size"),
    ("model: mixtral-8x7b\nplatform: {vendor: cuda, arch: 'sm_\uff19\uff10'}\n", 2, 33, "platform.arch"),
    ("model: mixtrall\n", 1, 8, "unknown model preset 'mixtrall'"),
    ("model: mixtral-8x7b\nx: &a [*a]\n", 2, 8, "recursive alias"),
    ("model: mixtral-8x7b\nplatform:\n  <<: {vendor: cuda}\n", 3, 3, "merge keys (<<) are not supported in config files"),
    ("model: mixtral-8x7b\nparallel: {tp: !!int two}\n", 2, 16, "'two' is not a valid int"),
    ("[model]\n", 1, 1, "a config is a mapping"),
])
def test_bad_config_file_is_a_typed_error_at_its_position(tmp_path, capsys, text, line, col, fragment):
    path = tmp_path / "layer.yaml"
    path.write_text(text)
    assert main(["decide", str(path)]) == 2
    assert f"layer.yaml:{line}:{col}: " in capsys.readouterr().err
    error = config_error(path)
    assert (error.line, error.col) == (line, col) and fragment in error.message, error.message


def test_unknown_config_key_suggests_the_nearest(tmp_path):
    path = tmp_path / "layer.yaml"
    path.write_text("model: mixtral-8x7b\nplatfrom: {vendor: cuda}\n")
    error = config_error(path)
    assert (error.line, error.col, error.hint) == (2, 1, "did you mean 'platform'?")


def test_a_switch_written_as_bare_yaml_on_or_off_is_that_switch(tmp_path):
    """YAML 1.1 reads `on`/`off` as booleans; a config author means the switch."""
    path = tmp_path / "aiter.yaml"
    path.write_text("model: gpt-oss-120b\nplatform: {vendor: rocm, arch: gfx950, packages: [triton, aiter]}\n"
                    "switches: {rocm_use_aiter: on, use_deep_gemm: off}\n")
    assert main(["decide", str(path)]) == 0
    config = build_config(make_parser().parse_args(["decide", str(path)]))
    assert (config.switches.rocm_use_aiter.value, config.switches.use_deep_gemm.value) == ("on", "off")


def test_detect_reads_vllms_switch_variables_into_the_config():
    from moerules.tools.detect import detect_switches
    switches = detect_switches({"VLLM_ROCM_USE_AITER": "1", "VLLM_USE_DEEP_GEMM": "1", "VLLM_MOE_USE_DEEP_GEMM": "0"})
    assert (switches.rocm_use_aiter.value, switches.rocm_use_aiter_moe.value, switches.use_deep_gemm.value) == (
        "on", "unset", "off")   # DeepGEMM is on only where every variable vLLM reads says so
