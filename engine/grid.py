"""A categorical sample of the config space: every platform, family, parallel layout and
feature switch, at shapes on both sides of the alignment gates. Lint walks it to find
unreachable backends, priority gaps and plan coverage holes."""

from __future__ import annotations

import itertools
from typing import Iterator

from moerules.config import All2AllBackend, MoEConfig, Package
from moerules.quant import QuantFamily

PLATFORMS = [("cuda", "sm_70"), ("cuda", "sm_75"), ("cuda", "sm_80"), ("cuda", "sm_89"), ("cuda", "sm_90"), ("cuda", "sm_100"),
             ("cuda", "sm_110"), ("cuda", "sm_120"), ("rocm", "gfx942"), ("rocm", "gfx950"), ("rocm", "gfx1200"),
             ("xpu", "xe_hpc"), ("cpu", "x86_64")]
QUANTS = [{"family": f.value} for f in QuantFamily] + [
    {"family": "fp8_w8a8", "weight_granularity": "channel"},
    {"family": "fp8_w8a8", "weight_granularity": "block128"},
    {"family": "fp8_w8a16", "weight_granularity": "block128"},
]
ACTIVATIONS = ["silu", "swigluoai", "relu2_no_mul"]
SHAPES = [dict(hidden_size=4096, intermediate_size=4096), dict(hidden_size=2880, intermediate_size=2880)]
PARALLEL = [{}, {"tp": 4}, {"dp": 2}, {"tp": 2, "expert_parallel": True}] + [
    {"dp": 2, "expert_parallel": True, "all2all_backend": b.value} for b in All2AllBackend]
ALL_PACKAGES = [p.value for p in Package]


def configs(packages: list[str] = ALL_PACKAGES) -> Iterator[MoEConfig]:
    """Every combination, with `packages` present (default: all, to ask what rules *can* select)."""
    for (vendor, arch), quant, activation, shape, parallel, lora in itertools.product(
            PLATFORMS, QUANTS, ACTIVATIONS, SHAPES, PARALLEL, (False, True)):
        yield MoEConfig(model=dict(num_experts=16, top_k=2, activation=activation, **shape),
                        quant=quant, parallel=parallel,
                        platform={"vendor": vendor, "arch": arch, "packages": packages},
                        features={"lora": lora})
