"""Hypothesis strategies for `MoEConfig`, for moerules' own property suite and for yours.

    from hypothesis import given
    from moerules.testing import configs

    @given(configs(vendor="cuda", family="fp8_w8a8"))
    def test_my_engine_accepts_every_decision(config):
        ...

Every strategy draws valid configs only (the pydantic validators never reject a draw).
`near_boundary(256)` draws sizes at and around multiples of 256, where alignment gates flip.
Requires `hypothesis` (installed with the `test` extra).
"""

from __future__ import annotations

from typing import Optional, Sequence

from hypothesis import strategies as st

from moerules.activation import Activation, Dtype
from moerules.config import All2AllBackend, MoEConfig, Package, Routing, Vendor
from moerules.quant import ALLOWED_GRANULARITY, QuantConfig, QuantFamily

ARCHS = {
    Vendor.cuda: ["sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_103", "sm_110", "sm_120"],
    Vendor.rocm: ["gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1200", "gfx1250"],
    Vendor.xpu: ["xe_hpc", "xe_lpg"],
    Vendor.cpu: ["x86_64", "aarch64"],
}


def _mostly(common: Sequence, everything: Sequence) -> st.SearchStrategy:
    """Half the draws from the common values, half from all: realistic configs reach the
    selection logic (a uniform draw is nearly always unsupported) and rare ones still occur."""
    return st.one_of(st.sampled_from(list(common)), st.sampled_from(list(everything)))


def near_boundary(multiple: int = 256, max_factor: int = 64) -> st.SearchStrategy[int]:
    """Sizes at, just below and just above multiples of `multiple` (and of its halves)."""
    base = st.integers(1, max_factor).flatmap(
        lambda k: st.sampled_from([k * multiple, k * multiple // 2, k * multiple - 32, k * multiple + 32,
                                   k * multiple - 1, k * multiple + 1]))
    return base.filter(lambda n: n >= 1)


def platforms(vendor: Optional[str] = None, packages: Optional[Sequence[str]] = None):
    """A platform of `vendor` (any if None); packages drawn from all known ones unless given."""
    vendors = [Vendor(vendor)] if vendor else list(Vendor)
    package_sets = (st.just(list(packages)) if packages is not None
                    else st.lists(st.sampled_from([p.value for p in Package]), unique=True).map(
                        lambda extra: sorted({"triton", *extra})))
    return st.sampled_from(vendors).flatmap(lambda v: st.fixed_dictionaries({
        "vendor": st.just(v.value), "arch": st.sampled_from(ARCHS[v]), "packages": package_sets,
        "torch_grouped_mm": st.booleans()}))


def quants(family: Optional[str] = None):
    families = [QuantFamily(family)] if family else list(QuantFamily)

    def for_family(f: QuantFamily):
        weights, acts = ALLOWED_GRANULARITY.get(f, (set(), set()))
        return st.fixed_dictionaries({
            "family": st.just(f.value),
            "weight_granularity": st.sampled_from([None] + sorted(g.value for g in weights)),
            "activation_granularity": st.sampled_from([None] + sorted(g.value for g in acts)),
            "activation_dynamic": st.booleans()})
    return st.sampled_from(families).flatmap(for_family).map(lambda d: QuantConfig(**d))


def models(sizes: Optional[st.SearchStrategy[int]] = None):
    """A model shape; hidden and intermediate sizes from `sizes` (default: near 256-boundaries)."""
    sizes = near_boundary(256, 32) if sizes is None else sizes
    return st.integers(1, 512).flatmap(lambda experts: st.fixed_dictionaries({
        "num_experts": st.just(experts), "top_k": st.integers(1, min(experts, 16)),
        "hidden_size": sizes, "moe_intermediate_size": sizes,
        "activation": _mostly(["silu", "swigluoai"], [a.value for a in Activation]), "has_bias": st.booleans(),
        "in_dtype": _mostly(["bf16"], [d.value for d in Dtype]),
        "routing": st.sampled_from([r.value for r in Routing])}))


def parallels():
    return st.fixed_dictionaries({
        "tp": st.sampled_from([1, 2, 4, 8]), "dp": _mostly([1], [1, 2, 4]),
        "expert_parallel": st.booleans(), "all2all_backend": st.sampled_from([b.value for b in All2AllBackend]),
        "eplb": _mostly([False], [False, True])})


def features(backends: Sequence[str] = ()):
    """Features; the pin is `auto` or one of `backends` (pass a rule set's names to draw pins)."""
    return st.fixed_dictionaries({"lora": st.booleans(), "batch_invariant": _mostly([False], [False, True]),
                                  "backend": st.sampled_from(["auto", *backends])})


def configs(*, vendor: Optional[str] = None, family: Optional[str] = None, packages: Optional[Sequence[str]] = None,
            pins: Sequence[str] = ()) -> st.SearchStrategy[MoEConfig]:
    """Whole configs. Drawn TP sizes that do not divide the intermediate size are rounded to 1."""
    def assemble(parts) -> MoEConfig:
        model, quant, parallel, platform, feature = parts
        if model["moe_intermediate_size"] % (parallel["tp"] * parallel["dp"]):
            parallel = {**parallel, "tp": 1, "dp": 1}
        return MoEConfig(model=model, quant=quant, parallel=parallel, platform=platform, features=feature)
    return st.tuples(models(), quants(family), parallels(), platforms(vendor, packages),
                     features(pins)).map(assemble)
