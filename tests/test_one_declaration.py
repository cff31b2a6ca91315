"""Each capability is declared once: the rules say what a backend can do; the kernel registry says what
the code needs to find and run a kernel. Where the code must state a fact of its own (the cells a kernel
implements, whether it takes biases or LoRA, its activation format), it must agree with the rules, and
these tests fail on any drift. Packages and their probes are data in rules/05-packages.yaml only."""

from __future__ import annotations

from functools import lru_cache

import pytest

from moerules.activation import Activation, Dtype
from moerules.config import BATCHED_ALL2ALL, PACKAGE_DECLARATIONS, All2AllBackend, MoEConfig, Package
from moerules.decision import ActivationFormat, ReasonCode
from moerules.engine.decide import decide
from moerules.engine.loader import load_rules
from moerules.kernels.registry import ADAPTERS, EXPERTS, PREPARE_FINALIZE, experts_spec
from moerules.kernels.scheme import IMPLEMENTED_FAMILIES, Scheme, quant_for_cell, scheme_cells
from moerules.quant import QuantConfig, QuantFamily

RULES = load_rules()
# Our kernels and the adapters of external ones, as the rules name them.
KERNEL_BACKENDS = {name: d.item for name, d in RULES.backends.items() if d.item.kernel or d.item.adapter}


# Kernels no rule names: what build_layer callers pair with batched experts on one rank (tests, CPUs).
BUILD_LAYER_ONLY = {"torch.batched_reference", "local_batched"}


def registry_id(backend) -> str:
    return backend.kernel or backend.adapter


@pytest.mark.parametrize("name", sorted(KERNEL_BACKENDS))
def test_the_registry_entry_agrees_with_the_rules_on_format_bias_lora_and_package(name):
    backend = KERNEL_BACKENDS[name]
    spec = experts_spec(registry_id(backend))
    assert spec is not None, f"{name} names {registry_id(backend)!r}, which the registry does not hold"
    assert (spec.activation_format, spec.supports_bias, spec.supports_lora) == \
        (backend.format.value, backend.bias, backend.lora), name
    assert spec.package == backend.external, name   # an adapter runs the package the rules name; ours none


def test_every_dispatcher_kernel_agrees_with_the_rules_on_its_format():
    declared = {d.item.kernel: d.item.format.value for d in RULES.dispatchers.values() if d.item.kernel}
    assert declared == {pf_id: spec.activation_format for pf_id, spec in PREPARE_FINALIZE.items()
                        if pf_id not in BUILD_LAYER_ONLY}


def test_every_registered_kernel_is_named_by_a_rule():
    named = {registry_id(b) for b in KERNEL_BACKENDS.values()} | \
        {d.item.kernel for d in RULES.dispatchers.values() if d.item.kernel}
    assert named | BUILD_LAYER_ONLY == set(EXPERTS) | set(ADAPTERS) | set(PREPARE_FINALIZE)
    assert not named & BUILD_LAYER_ONLY


def test_packages_and_their_probes_are_the_rule_files_declarations():
    declared = [(p.item.id.value, p.item.probe) for p in RULES.packages.values()]
    assert declared == [(name, entry["probe"]) for name, entry in PACKAGE_DECLARATIONS.items()]
    assert [p.value for p in Package] == list(PACKAGE_DECLARATIONS)


# ---- what the rules let a backend take, against what its kernel implements ---------------------------------

def config(quant=QuantConfig(), activation=Activation.silu, in_dtype=Dtype.bf16) -> MoEConfig:
    return MoEConfig(model={"num_experts": 8, "top_k": 2, "hidden_size": 4096, "moe_intermediate_size": 4096,
                            "activation": activation, "in_dtype": in_dtype},
                     quant=quant, platform={"vendor": "cuda", "arch": "sm_90", "packages": list(Package)})


@lru_cache(maxsize=None)
def refused(axis: str, value) -> frozenset[str]:
    """The backends some rule refuses for this value of one axis (its reason code), all else default."""
    reason, made = {"scheme": (ReasonCode.quant_unsupported, lambda v: config(quant=v)),
                    "activation": (ReasonCode.activation_unsupported, lambda v: config(activation=v)),
                    "in_dtype": (ReasonCode.dtype_unsupported, lambda v: config(in_dtype=v))}[axis]
    return frozenset(r.backend for r in decide(made(value)).rejections if r.reason == reason)


QUANTS = [quant_for_cell(cell) for cell in sorted(scheme_cells())] + \
    [QuantConfig(family=f) for f in QuantFamily if f not in IMPLEMENTED_FAMILIES]


OURS = sorted(name for name, backend in KERNEL_BACKENDS.items() if backend.kernel)


@pytest.mark.parametrize("name", OURS)
def test_what_the_rules_allow_our_backend_its_kernel_implements(name):
    spec = EXPERTS[KERNEL_BACKENDS[name].kernel]
    allowed_quants = [q for q in QUANTS if name not in refused("scheme", q)]
    assert {Scheme.from_quant(q).cell for q in allowed_quants} <= spec.cells, name
    # and family by family, the two lists are the same (a family the kernel runs but no rule allows is drift)
    assert {q.family for q in allowed_quants} == {scheme_cells()[cell].family for cell in spec.cells}, name
    assert {a for a in Activation if name not in refused("activation", a)} <= spec.activations, name
    assert {d for d in Dtype if name not in refused("in_dtype", d)} <= spec.in_dtypes, name


@pytest.mark.parametrize("name", sorted(set(KERNEL_BACKENDS) - set(OURS)))
def test_an_adapter_runs_only_what_the_rules_allow_its_backend(name):
    """The reverse of the above: vLLM's backend may take more than our adapter converts (oai_triton: W4A4
    and W4A8 requests, which build() refuses by name), never less."""
    spec = ADAPTERS[KERNEL_BACKENDS[name].adapter]
    allowed = {Scheme.from_quant(q).cell for q in QUANTS
               if q.family in IMPLEMENTED_FAMILIES and name not in refused("scheme", q)}
    assert spec.cells <= allowed, name
    assert {a for a in spec.activations if name in refused("activation", a)} == set(), name
    assert {d for d in spec.in_dtypes if name in refused("in_dtype", d)} == set(), name


def test_the_implemented_families_are_those_the_rules_allow_our_kernels():
    allowed = {q.family for q in QUANTS for name in OURS if name not in refused("scheme", q)}
    assert allowed == IMPLEMENTED_FAMILIES


@pytest.mark.parametrize("backend", list(All2AllBackend))
def test_the_batched_all2all_backends_are_those_whose_dispatcher_the_rules_declare_batched(backend):
    """config.BATCHED_ALL2ALL (the config's batched_format, which rules read) against the `format:` of the
    dispatcher the dispatch rules pick for that all2all backend."""
    decisions = [decide(MoEConfig(model={"num_experts": 8, "top_k": 2, "hidden_size": 4096,
                                         "moe_intermediate_size": 4096},
                                  parallel={"dp": 2, "expert_parallel": True, "all2all_backend": backend},
                                  platform={"vendor": vendor, "arch": arch, "packages": list(Package)}))
                 for vendor, arch in (("cuda", "sm_90"), ("rocm", "gfx942"))]
    dispatcher = next(d.prepare_finalize for d in decisions if d.prepare_finalize)
    assert (RULES.dispatchers[dispatcher].item.format == ActivationFormat.batched) == (backend in BATCHED_ALL2ALL)
