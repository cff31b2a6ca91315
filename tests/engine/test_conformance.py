"""Conformance accounting: agreement, the rules charged with a difference, named deviations, the report."""

import shutil

import pytest
import yaml

from moerules.config import VLLM_INSTALL, MoEConfig
from moerules.tools import conformance
from moerules.tools.cli.main import main
from moerules.engine.loader import load_rules
from moerules.tools.matrix import Cell
from moerules.resources import default_rules_dir

FULL = sorted(p.value for p in VLLM_INSTALL)
BIASED_BLACKWELL = MoEConfig(model={"num_experts": 16, "top_k": 2, "hidden_size": 4096, "moe_intermediate_size": 4096,
                                    "has_bias": True},
                             platform={"vendor": "cuda", "arch": "sm_100", "packages": FULL})


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("vllm")
    from moerules.tools.vllm_oracle import VllmOracle
    return VllmOracle()


def rules_with_deviation(tmp_path, rule_id: str, deviation):
    """The default rules with `deviation:` set on (or, for None, removed from) one rule."""
    out = tmp_path / "rules"
    shutil.copytree(default_rules_dir(), out)
    for file in out.glob("*.yaml"):
        data = yaml.safe_load(file.read_text())
        for item in data.get("constraints", []):
            if item["id"] == rule_id:
                item.pop("deviation", None)
                if deviation:
                    item["deviation"] = deviation
                file.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_rules(out)


@pytest.mark.parametrize("deviation, verdict", [(None, "disagree"),
                                                ("vLLM's TRT-LLM BF16 experts drop expert biases", "deviation")])
def test_a_difference_is_charged_to_the_rule_that_made_it(tmp_path, oracle, deviation, verdict):
    """vLLM picks TRT-LLM BF16 for a biased layer (experts/trtllm_bf16_moe.py drops the biases); our
    bias rule rejects it. Unnamed, that is a disagreement; with `deviation:` it is a named deviation."""
    ruleset = rules_with_deviation(tmp_path, "bias.never_dropped", deviation)
    row = conformance.Conformance(ruleset, oracle).compare(Cell("biased", BIASED_BLACKWELL))
    assert (row.theirs, row.verdict, row.rules) == ("flashinfer_trtllm", verdict, "bias.never_dropped")
    assert row.violations == "bias_dropped"   # vLLM's own choice drops the biases
    assert row.ours != "flashinfer_trtllm" and row.source.startswith("model_executor/layers/fused_moe/experts/")


def test_a_refused_dispatcher_is_charged_when_vllms_experts_stand(oracle):
    """FlashInfer NVLink on a ROCm machine that reports FlashInfer: vLLM builds it behind AITER's MXFP8 experts,
    we refuse the dispatcher off CUDA; the difference is the dispatcher rule's, not 'missing in ours'."""
    config = MoEConfig(model={"num_experts": 16, "top_k": 2, "hidden_size": 4096, "moe_intermediate_size": 4096},
                       quant={"family": "mxfp8"}, switches={"rocm_use_aiter": "on"},
                       parallel={"dp": 2, "expert_parallel": True, "all2all_backend": "flashinfer_nvlink"},
                       platform={"vendor": "rocm", "arch": "gfx950", "packages": ["triton", "vllm", "aiter", "flashinfer"]})
    row = conformance.Conformance(load_rules(None), oracle).compare(Cell("fi-on-rocm", config))
    assert (row.ours, row.theirs, row.rules, row.verdict) == ("unsupported", "aiter_mxfp8", "flashinfer_nvlink.cuda",
                                                              "deviation")


def test_inexpressible_configs_are_counted_apart(oracle):
    ours_only = MoEConfig(model={"num_experts": 16, "top_k": 2, "hidden_size": 4096, "moe_intermediate_size": 4096},
                          parallel={"dp": 2, "expert_parallel": True, "all2all_backend": "torch_all2all"},
                          platform={"vendor": "cuda", "arch": "sm_90", "packages": FULL})
    row = conformance.Conformance(load_rules(None), oracle).compare(Cell("ours-only", ours_only))
    assert row.verdict == "inexpressible" and "torch_all2all is ours" in row.source
    summary = conformance.Summary([row])
    assert summary.agreement([row]) == (0, 0, 0, 0)


def test_report_and_csv_round_trip():
    rows = [conformance.Comparison("a", "auto", "fp8", "cuda:sm_90", "triton", "triton", "agree", "", ""),
            conformance.Comparison("b", "auto", "fp8", "cuda:sm_90", "triton", "marlin", "disagree", "priority.x",
                                   "experts/marlin_moe.py:681"),
            conformance.Comparison("c", "pinned", "fp8", "cuda:sm_90", "unsupported", "marlin", "deviation",
                                   "marlin.bias", "experts/marlin_moe.py:681")]
    assert list(conformance.from_csv(conformance.to_csv(rows)).values()) == rows
    report = conformance.report_markdown(conformance.Summary(rows), "0" * 64, "0.33.0")
    assert "| auto | 2 | 1 | 0 | 1 | 50.0% |" in report
    assert "| pinned | 1 | 0 | 1 | 0 | 100.0% |" in report
    assert "| 1 | priority.x | triton | marlin | experts/marlin_moe.py:681 | `b` |" in report
    assert "## Configs each named deviation accounts for (1 rules)\n\n| rule | configs |\n|---|---|\n| marlin.bias | 1 |" in report


def test_check_without_a_committed_report_says_how_to_make_one(tmp_path, capsys):
    assert main(["conformance", "--check", "--out", str(tmp_path), "--quiet"]) == 2
    assert "no committed conformance report; run `moerules conformance` and commit it" in capsys.readouterr().err


def test_a_vllm_class_named_by_two_components_is_a_load_error(tmp_path):
    from moerules.errors import RuleSetError
    out = tmp_path / "rules"
    shutil.copytree(default_rules_dir(), out)
    extra = {"version": 1, "backends": [{"id": "triton_again", "external": "vllm", "upstream": ["TritonExperts"]}]}
    (out / "99-extra.yaml").write_text(yaml.safe_dump(extra, sort_keys=False))
    with pytest.raises(RuleSetError, match=r"99-extra.yaml:\d+:\d+: \[triton_again\] vLLM class 'TritonExperts' is already used at "
                                           r"\S*10-components.yaml:\d+"):
        load_rules(out)


def test_a_pin_vllm_replaces_is_charged_to_the_pin_policy(oracle):
    """vLLM's unquantized LoRA branch returns Triton before it reads moe_backend (oracle/unquantized.py:234-248);
    we honour a pin or refuse the layer."""
    pinned = MoEConfig(model={"num_experts": 16, "top_k": 2, "hidden_size": 4096, "moe_intermediate_size": 4096},
                       platform={"vendor": "cuda", "arch": "sm_90", "packages": FULL},
                       features={"lora": True, "backend": "flashinfer_cutlass"})
    row = conformance.Conformance(load_rules(None), oracle).compare(Cell("lora-pin", pinned))
    assert (row.ours, row.theirs, row.verdict, row.rules) == ("unsupported", "triton", "deviation",
                                                             conformance.PIN_POLICY)
    assert row.violations == "pin_replaced"
