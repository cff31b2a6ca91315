"""Every row of moerules.guarantees is triggered here (or, for rows that need several ranks, by a named test
of tests/ep that asserts it), every row has a trigger, and the README's table is the rendered one."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

import moerules
import moerules.errors
from moerules import MoEConfig
from moerules.activation import Activation, Dtype
from moerules.guarantees import GUARANTEES, render
from moerules.kernels import MoEWeights, build_layer, make_random_weights
from moerules.kernels.ep import Placement, shard_weights
from moerules.kernels.scheme import quant_for_cell
from moerules.presets import preset

REPO = Path(__file__).resolve().parents[1]
CPU = {"vendor": "cpu", "arch": "x86_64", "packages": []}


def config(**features) -> MoEConfig:
    return MoEConfig.model_validate({**preset("mixtral-8x7b"), "platform": CPU, "features": features})


def weights(E=4, H=32, I=16) -> MoEWeights:
    return make_random_weights(num_experts=E, hidden=H, intermediate=I, quant=quant_for_cell("unquantized"),
                               in_dtype=Dtype.fp32, has_bias=False, seed=0, device="cpu")


def layer():
    return build_layer(kernel_id="torch.reference", prepare_finalize_id="local", quant=quant_for_cell("unquantized"),
                       activation=Activation.silu, in_dtype=Dtype.fp32, activation_format="standard",
                       weights=weights(), device="cpu")


def rejected_decision():
    with pytest.raises(moerules.BackendRejectedError) as caught:
        moerules.decide(config(backend="aiter"))
    return caught.value.decision


def strided_w2():
    w = weights()
    MoEWeights(w13=w.w13, w2=w.w2.transpose(1, 2).contiguous().transpose(1, 2), scheme=w.scheme, in_dtype=w.in_dtype)


def run_on_meta():
    from moerules.tools.cli.run import run_example
    run_example(moerules.decide(config()), device="meta")


TRIGGERS = {
    ("moerules.decide", "UnknownBackendError"): lambda: moerules.decide(config(backend="nope")),
    ("moerules.decide", "BackendRejectedError"): lambda: moerules.decide(config(backend="aiter")),
    ("moerules.decide", "RuleSetError"): lambda: moerules.decide(config(), rules="/nonexistent/rules"),
    ("moerules.decide", "TypeError"): lambda: moerules.decide(preset("mixtral-8x7b")),
    ("moerules.decide", "ValueError"): lambda: moerules.decide(config(), engine="bogus"),
    ("moerules.explain", "RuleSetError"): lambda: moerules.explain(config(), rules="/nonexistent/rules"),
    ("moerules.load_rules", "RuleSetError"): lambda: moerules.load_rules("x" * 300),
    ("moerules.MoEConfig.model_validate", "pydantic.ValidationError"):
        lambda: MoEConfig.model_validate({"model": {"num_experts": -1}}),
    ("moerules.build", "KernelUnavailableError"): lambda: moerules.build(rejected_decision(), weights()),
    ("moerules.kernels.build_layer", "KernelBuildError"):
        lambda: build_layer(kernel_id="nope", prepare_finalize_id="local", quant=quant_for_cell("unquantized"),
                            activation=Activation.silu, in_dtype=Dtype.fp32, activation_format="standard",
                            weights=weights(), device="cpu"),
    ("moerules.kernels.MoEWeights", "KernelInputError"): strided_w2,
    ("moerules.kernels.MoEWeights", "ValueError"):
        lambda: MoEWeights(w13=torch.zeros(2, 8, 4), w2=torch.zeros(2, 4, 3), scheme=weights().scheme,
                           in_dtype=Dtype.fp32),
    ("moerules.kernels.MoELayer.forward", "KernelInputError"):
        lambda: layer()(torch.zeros(3, 31), topk_ids=torch.zeros(3, 2, dtype=torch.int32),
                        topk_weights=torch.zeros(3, 2)),
    ("moerules.kernels.MoELayer.forward", "InconsistentRanksError"):
        "tests/ep/test_ep_consistency.py::test_inconsistent_ranks_all_end_in_the_same_typed_error",
    ("moerules.kernels.MoELayer.forward", "CollectiveError"):
        "tests/ep/test_ep_faults.py::test_a_rank_that_raises_makes_the_other_fail_within_the_timeout",
    ("moerules.kernels.MoELayer.forward", "CapacityError"):
        "tests/ep/test_ep_capacity.py::test_rows_per_peer_overflow_is_an_error_and_nan_never_a_silent_drop",
    ("moerules.kernels.ep.shard_weights", "PlacementError"):
        lambda: shard_weights(weights(E=6), Placement.contiguous(6, 4), 0),
    ("moerules.kernels.ep.init_distributed", "CollectiveError"):
        "tests/ep/test_ep_faults.py::test_a_rank_that_never_joins_fails_init_within_the_timeout",
    ("moerules.tools.cli.run.run_example", "RequestError"): run_on_meta,
}


def error_class(name: str) -> type:
    if name in ("TypeError", "ValueError"):
        return {"TypeError": TypeError, "ValueError": ValueError}[name]
    if "." in name:
        module, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(module), attr)
    for module in ("moerules.errors", "moerules.kernels", "moerules.kernels.ep", "moerules.kernels.ep.comm"):
        found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            return found
    raise AssertionError(f"{name}: no such error class")


def test_every_guarantee_has_a_trigger_and_every_trigger_a_guarantee():
    assert {(g.function, g.raises) for g in GUARANTEES} == set(TRIGGERS)


@pytest.mark.parametrize("key", sorted(k for k, v in TRIGGERS.items() if callable(v)), ids=" raises ".join)
def test_each_guarantee_holds(key):
    with pytest.raises(error_class(key[1])):
        TRIGGERS[key]()


@pytest.mark.parametrize("key", sorted(k for k, v in TRIGGERS.items() if isinstance(v, str)), ids=" raises ".join)
def test_multi_rank_guarantees_are_asserted_by_the_named_test(key):
    path, _, name = TRIGGERS[key].partition("::")
    tree = ast.parse((REPO / path).read_text())
    function = next((f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == name), None)
    assert function is not None, f"{TRIGGERS[key]} does not exist"
    # The test, or the rank code it runs (its folder's helpers), names the error it expects.
    folder_text = "".join(f.read_text() for f in (REPO / path).parent.glob("*.py"))
    assert error_class(key[1]).__name__ in folder_text
    assert issubclass(error_class(key[1]), Exception)


def test_the_readme_table_is_the_rendered_one():
    readme = (REPO / "README.md").read_text()
    table = re.search(r"<!-- guarantees: generated by `python -m moerules.guarantees` -->\n(.*?)<!-- guarantees: "
                      r"end -->", readme, re.S)
    assert table and table.group(1) == render(), "README is stale: paste `python -m moerules.guarantees` into it"
