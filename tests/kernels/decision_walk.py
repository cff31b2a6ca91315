"""The decisions the default rules produce on one platform, reduced to what a build depends on.

Configs: every model preset x every quant scheme of the decision matrix x LoRA on/off x
packages (ours only, or every package) x explicit pins of our backends, plus the non-gated activations on a Mixtral-like model. Each is decided with the
real model shapes; decisions that build the same layer collapse into one `BuildCase`, which
is then built on tiny weights of the same alignment class (see `tiny_dims`).

Decisions for several ranks (TP, DP, EP) build only over a process group with a weight shard;
tests/ep builds those with real gloo groups. Here every config is one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from moerules import decide
from moerules.config import MoEConfig, Package
from moerules.decision import Decision, Outcome
from moerules.errors import BackendRejectedError
from moerules.tools.matrix import QUANTS
from moerules.presets import PRESETS

OUR_BACKENDS = ("triton", "batched_triton", "torch_grouped_mm", "torch_reference")
NON_GATED = ("silu_no_mul", "gelu_no_mul", "relu2_no_mul")


@dataclass(frozen=True)
class BuildCase:
    """Everything of a decision that changes the layer `build` makes (shapes reduced by `tiny_dims`)."""

    decision: Decision

    @property
    def key(self) -> tuple:
        d, m = self.decision, self.decision.config.model
        q = d.config.quant
        return (d.kernel or d.adapter, d.prepare_finalize_kernel, q.family.value, str(q.weight_key), str(q.activation_key),
                m.activation.value, m.in_dtype.value, m.has_bias, d.config.features.lora, d.padding.hidden_pad,
                d.padding.intermediate_pad, d.quant.weight_block, d.quant.defer_input_quant,
                m.hidden_size % 128 == 0, d.config.intermediate_per_partition % 128 == 0)

    def __str__(self) -> str:
        d, m = self.decision, self.decision.config.model
        return (f"{d.backend}[{d.config.quant.family.value}/{m.activation.value}/{m.in_dtype.value}"
                f"{'/bias' if m.has_bias else ''}{'/lora' if d.config.features.lora else ''}"
                f"/pad{d.padding.hidden_pad}+{d.padding.intermediate_pad}]")


def tiny_dims(config: MoEConfig) -> tuple[int, int, int]:
    """(experts, hidden, intermediate per partition) small enough for the interpreter.

    Dimensions stay congruent modulo 128 to the real ones (4096 -> 128, 2880 -> 192, 2848 -> 160),
    so every alignment our kernels and their round-ups test (32, 64, 128) holds or fails alike, and
    the decision's pads bring them to the same multiples.
    """
    m = config.model
    return (min(m.num_experts, 8), 128 + m.hidden_size % 128, 128 + config.intermediate_per_partition % 128)


def configs(platform: dict, in_dtype: str) -> Iterator[MoEConfig]:
    all_packages = [p.value for p in Package]
    for name, preset in PRESETS.items():
        model = {**preset["model"], "in_dtype": in_dtype}
        for quant in QUANTS:
            for lora in (False, True):
                for packages in (["triton"], all_packages):
                    for pin in ("auto",) + OUR_BACKENDS:
                        yield _config(model, quant, platform, packages, lora, pin)
    mixtral = {**PRESETS["mixtral-8x7b"]["model"], "in_dtype": in_dtype}
    for activation in NON_GATED:
        for quant in QUANTS:
            yield _config({**mixtral, "activation": activation}, quant, platform, ["triton"], False, "auto")
    # Shapes the MX round-ups pad (hidden to 32, intermediate to 64 / 32): the pads must reach the kernels.
    unaligned = {**mixtral, "hidden_size": 2000, "moe_intermediate_size": 2848}
    for quant in QUANTS:
        for lora in (False, True):
            yield _config(unaligned, quant, platform, ["triton"], lora, "auto")


def _config(model, quant, platform, packages, lora, pin) -> MoEConfig:
    return MoEConfig(model=model, quant=quant, platform={**platform, "packages": packages},
                     features={"lora": lora, "backend": pin})


def build_cases(platform: dict, in_dtype: str) -> tuple[list[BuildCase], list[Decision]]:
    """(distinct buildable cases: our kernels, and adapters whose package is installed here; decisions naming an
    external kernel that cannot run here)."""
    ours: dict[tuple, BuildCase] = {}
    external: dict[tuple, Decision] = {}
    for config in configs(platform, in_dtype):
        try:
            decision = decide(config)
        except BackendRejectedError:  # a pin the rules reject is an error, not a decision to build
            continue
        if decision.outcome != Outcome.selected:
            continue
        if not _runs_here(decision):
            external.setdefault((decision.backend, decision.prepare_finalize), decision)
            continue
        case = BuildCase(decision)
        ours.setdefault(case.key, case)
    return list(ours.values()), list(external.values())


def _runs_here(decision: Decision) -> bool:
    from moerules.kernels.registry import adapter_refusal
    if decision.prepare_finalize_kernel is None:
        return False
    return decision.kernel is not None or (
        decision.adapter is not None and adapter_refusal(decision.adapter, decision.config.quant) is None)


def representatives(cases: list[BuildCase]) -> list[BuildCase]:
    """One case per (kernel, scheme, LoRA, padded or not): the interpreter's share of a walk (activations and
    biases of every scheme are covered by the kernel tests; the GPU walks every case)."""
    seen: dict[tuple, BuildCase] = {}
    for case in cases:
        d, m = case.decision, case.decision.config.model
        key = (d.kernel or d.adapter, str(d.config.quant.weight_key), str(d.config.quant.activation_key), m.activation.gated,
               d.config.features.lora, bool(d.padding.hidden_pad or d.padding.intermediate_pad))
        seen.setdefault(key, case)
    return list(seen.values())

