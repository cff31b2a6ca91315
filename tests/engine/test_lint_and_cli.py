"""`moerules lint`, `schema` and the CLI as a user meets them (exit codes 0/1/2)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from moerules.config import All2AllBackend
from moerules.tools.cli.main import main
from moerules.tools.lint import lint, static_checks
from moerules.tools import schema_export
from moerules.resources import default_rules_dir, schema_dir

from decision_helpers import config, cuda, rocm

SMALL_GRID = [config(platform=cuda("sm_90", "deep_ep", "nixl_ep", "flashinfer"),
                     parallel={"dp": 2, "expert_parallel": True, "all2all_backend": b})
              for b in All2AllBackend if b != All2AllBackend.mori] + [
    config(platform=rocm("gfx942", "aiter", "mori"), parallel={"dp": 2, "expert_parallel": True,
                                                                "all2all_backend": "mori"}),
    config(platform=cuda("sm_90")), config(platform=cuda("sm_90"), parallel={"dp": 2})]


def test_lint_of_the_default_rules_finds_no_error():
    report = lint(configs=SMALL_GRID)
    assert report.errors == [] and report.configs_checked == len(SMALL_GRID)


def test_lint_reports_a_dispatch_gap(rules_without):
    report = lint(rules_without("dispatch.a2a.nixl_ep"), configs=SMALL_GRID)
    [error] = report.errors
    assert error.code == "coverage" and "no prepare/finalize rule matches" in error.message
    assert "all2all_backend=nixl_ep" in error.message


def test_lint_reports_unreachable_components(rules_without):
    report = lint(rules_without("dispatch.a2a.nixl_ep"), configs=SMALL_GRID)
    assert any(f.code == "unreachable" and f.message.startswith("nixl_ep ") for f in report.findings)


def _edited_rules(tmp_path, file: str, old: str, new: str):
    out = tmp_path / "rules"
    shutil.copytree(default_rules_dir(), out)
    text = (out / file).read_text()
    assert text.count(old) == 1
    (out / file).write_text(text.replace(old, new))
    return out


def test_lint_reports_a_backend_no_priority_ranks(tmp_path):
    # b12x is pin-only in vLLM 0.33; without the flag nothing would ever rank it in auto mode
    rules = _edited_rules(tmp_path, "15-vllm-components.yaml", "  - id: b12x\n    pin_only: true\n", "  - id: b12x\n")
    [error] = static_checks(rules)[0].errors
    line = (rules / "15-vllm-components.yaml").read_text().split("\n").index("  - id: b12x") + 1
    assert error.code == "priority.unranked" and error.where == f"{rules}/15-vllm-components.yaml:{line}"
    assert error.message.startswith("b12x is listed by no priority rule, so auto mode never selects it")


def test_lint_reports_a_ranked_backend_declared_pin_only(tmp_path):
    rules = _edited_rules(tmp_path, "10-components.yaml", "  - id: triton\n", "  - id: triton\n    pin_only: true\n")
    [error] = static_checks(rules)[0].errors
    assert error.code == "priority.pin_only"
    assert error.message.startswith("triton is declared pin_only but a priority rule lists it")


def test_lint_reports_load_errors_with_location(tmp_path):
    (tmp_path / "bad.yaml").write_text("version: 1\ndispatch:\n  - id: d\n    when: parallel.dpp > 1\n    use: local\n")
    findings = {f.where: f for f in lint(tmp_path).findings}
    assert findings[f"{tmp_path}/bad.yaml:5:10"].message == "unknown dispatcher 'local' (declared: )"
    finding = findings[f"{tmp_path}/bad.yaml:4:11"]
    assert finding.code == "load" and finding.message == "unknown field 'parallel.dpp' (did you mean 'parallel.dp'?)"


def test_committed_schema_files_are_fresh():
    assert schema_export.stale(schema_dir()) == [], "run `moerules schema` and commit schema/"


def test_cli_exit_codes(capsys):
    assert main(["decide", "--model", "mixtral-8x7b", "--platform", "cuda:sm_90"]) == 0
    assert capsys.readouterr().out.startswith("moerules: triton experts (auto) behind local")
    assert main(["decide", "--model", "mixtral-8x7b", "--quant", "w4a8", "--platform", "rocm:gfx942"]) == 1
    assert main(["decide", "--model", "mixtral-8x7b", "--backend", "aiter", "--platform", "cuda:sm_90"]) == 1
    assert main(["decide", "--model", "mixtral-8x7b", "--backend", "trtion"]) == 2
    assert "Did you mean 'triton'?" in capsys.readouterr().err
    assert main(["decide", "--model", "mixtral-8x7b", "--tp", "3"]) == 2
    assert "not divisible by the MoE tensor-parallel size 3" in capsys.readouterr().err
    assert main(["decide", "--model", "mixtrall"]) == 2
    assert "unknown model preset 'mixtrall'" in capsys.readouterr().err


def test_cli_reads_config_files_and_reports_bad_ones(tmp_path, capsys):
    good = tmp_path / "layer.yaml"
    good.write_text("model: gpt-oss-120b\nplatform: {vendor: rocm, arch: gfx950, packages: [triton, aiter]}\n")
    assert main(["explain", str(good)]) == 0
    out = capsys.readouterr().out
    assert "triton experts (auto)" in out
    assert re.search(r"aiter +arch_unsupported +aiter.mxfp4_enabled\n +rules/33-mxfp4.yaml:\d+: ", out)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {num_experts: 8, top_k: 2, hidden_size: 64, moe_intermediate_size: 64, activation: sillu}\n")
    assert main(["decide", str(bad)]) == 2
    assert "model.activation: Input should be" in capsys.readouterr().err
    assert main(["decide", str(tmp_path / "missing.yaml")]) == 2


def test_cli_json_is_the_stable_record(capsys):
    assert main(["explain", "--model", "deepseek-v3", "--platform", "cuda:sm_90", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["format_version"] == 1 and record["backend"] == "triton"
    assert record["quant"]["scale_dim"] == 56 and record["quant"]["weight_block"] == 128


@pytest.mark.parametrize("command", ["decide", "explain", "lint", "schema", "run"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as raised:
        main([command, "--help"])
    assert raised.value.code == 0 and "usage: moerules" in capsys.readouterr().out
