"""The decision matrix: every cell of the categorical config space, decided and recorded.

The committed golden table (`matrix/decisions/`, see matrix_golden) makes any change of any cell
visible in review and in CI; `diff` compares two rule sets over the same cells plus random configs.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

from moerules.activation import Activation
from moerules.config import VLLM_INSTALL, All2AllBackend, MoEConfig, Package, Routing, Switches
from moerules.quant import QuantFamily
from moerules.decision import Decision
from moerules.errors import BackendRejectedError, EngineError
from moerules.tools import pool
from moerules.engine.decide import Engine
from moerules.engine.evaluate import effective_order
from moerules.tools.progress import Progress
from moerules.engine.ruleset import Declared, RuleSet

PLATFORMS = [("cuda", "sm_70"), ("cuda", "sm_75"), ("cuda", "sm_80"), ("cuda", "sm_89"), ("cuda", "sm_90"),
             ("cuda", "sm_100"), ("cuda", "sm_110"), ("cuda", "sm_120"), ("rocm", "gfx942"), ("rocm", "gfx950"),
             ("rocm", "gfx1100"), ("rocm", "gfx1201"), ("xpu", "xe_hpc"), ("cpu", "x86_64")]
QUANTS = [{"family": f.value} for f in QuantFamily] + [
    {"family": "fp8_w8a8", "weight_granularity": "channel", "checkpoint": "compressed_tensors"},
    {"family": "fp8_w8a8", "weight_granularity": "block128"},
    {"family": "fp8_w8a16", "weight_granularity": "block128"},
    # llm-compressor's INT4 checkpoints: the only WNA16 layout vLLM's RDNA3 and Triton WNA16 experts take
    {"family": "wna16", "checkpoint": "compressed_tensors"},
]
# Layouts off the product's defaults, where per-layout key rules (AITER, Humming, CUTLASS, RDNA3) refuse: each on
# every platform, in auto mode and pinned to every backend, with AITER switched on.
LAYOUTS = [{"family": "fp8_w8a8", "weight_granularity": "channel", "activation_granularity": "tensor"},
           {"family": "fp8_w8a8", "weight_granularity": "block128", "activation_granularity": "tensor"},
           {"family": "fp8_w8a8", "weight_granularity": "block128", "activation_granularity": "tensor",
            "activation_dynamic": False},
           {"family": "fp8_w8a8", "weight_granularity": "block128", "checkpoint": "compressed_tensors"},
           {"family": "fp8_w8a8", "activation_granularity": "token"},
           {"family": "wna16", "weight_granularity": "channel", "checkpoint": "compressed_tensors"}]
ACTIVATIONS = ["silu", "swigluoai"]
ALIGNMENTS = {"aligned": dict(hidden_size=4096, moe_intermediate_size=4096),
              "unaligned": dict(hidden_size=2880, moe_intermediate_size=2880)}
PARALLELS = {"single": {}, "tp4": {"tp": 4}, "dp2": {"dp": 2}, "tp2_ep": {"tp": 2, "expert_parallel": True},
             "a2a_torch": {"dp": 2, "expert_parallel": True, "all2all_backend": "torch_all2all"},
             "a2a_deepep_ll": {"dp": 2, "expert_parallel": True, "all2all_backend": "deepep_low_latency"},
             "a2a_mori": {"dp": 2, "expert_parallel": True, "all2all_backend": "mori"},
             "a2a_deepep_ht": {"dp": 2, "expert_parallel": True, "all2all_backend": "deepep_high_throughput"}}
# Every package; what `pip install vllm` brings (on CUDA); Triton alone. (A bare torch install is a variation.)
PACKAGES = {"all": [p.value for p in Package], "vllm": sorted(p.value for p in VLLM_INSTALL), "triton": ["triton"]}
COLUMNS = ["cell", "outcome", "backend", "alternatives", "prepare_finalize", "selected_by", "fallback_rule", "quantized_by",
           "expects_unquantized_inputs", "dispatch_dtype", "scale_dim", "weight_block", "hidden_pad",
           "intermediate_pad", "expert_placement", "failure_reason", "refused_by", "rules"]


@dataclass(frozen=True)
class Cell:
    key: str
    config: MoEConfig


def _quant_name(quant: dict) -> str:
    return (quant["family"] + ("/" + quant["weight_granularity"] if "weight_granularity" in quant else "")
            + ("/act=" + quant["activation_granularity"] if "activation_granularity" in quant else "")
            + ("/static" if quant.get("activation_dynamic") is False else "")
            + ("@" + quant["checkpoint"] if "checkpoint" in quant else ""))


# One factor at a time on top of a plain layer: the dimensions the product above leaves at
# their defaults (each entry: label -> changes to the model/parallel/platform/features sections).
VARIATIONS: dict[str, dict] = {
    **{f"act={a.value}": {"model": {"activation": a.value}} for a in Activation if a.value not in ACTIVATIONS},
    **{f"routing={r.value}": {"model": {"routing": r.value}} for r in Routing if r != Routing.softmax_renormalize},
    **{f"dtype={d}": {"model": {"in_dtype": d}} for d in ("fp16", "fp32")},
    "experts=4096": {"model": {"num_experts": 4096}},
    "bias": {"model": {"has_bias": True}},
    "batch_invariant": {"features": {"batch_invariant": True}},
    "eplb": {"parallel": {"eplb": True}},
    "lora+eplb": {"features": {"lora": True}, "parallel": {"eplb": True}},
    "no_grouped_mm": {"platform": {"torch_grouped_mm": False}},
    "hidden=2880": {"model": {"hidden_size": 2880}},
    "intermediate=2880": {"model": {"moe_intermediate_size": 2880}},
    "hidden=2000+intermediate=2848": {"model": {"hidden_size": 2000, "moe_intermediate_size": 2848}},
    "experts=6+tp4_ep": {"model": {"num_experts": 6}, "parallel": {"tp": 4, "expert_parallel": True}},
    "act=relu2_no_mul+a2a=torch_all2all_batched": {
        "model": {"activation": "relu2_no_mul"},
        "parallel": {"dp": 2, "expert_parallel": True, "all2all_backend": "torch_all2all_batched"}},
    **{f"a2a={b.value}": {"parallel": {"dp": 2, "expert_parallel": True, "all2all_backend": b.value}}
       for b in All2AllBackend},
    **{f"a2a={b.value}+triton_only": {"parallel": {"dp": 2, "expert_parallel": True, "all2all_backend": b.value},
                                      "platform": {"packages": ["triton"]}} for b in All2AllBackend},
    **{f"without={p.value}": {"platform": {"packages": [q.value for q in Package if q != p]}} for p in Package},
    "pkg=none": {"platform": {"packages": []}},
    "cpu_amx": {"platform": {"cpu_amx": True}},
    **{f"router_logits={d}": {"model": {"router_logits_dtype": d}} for d in ("bf16", "fp32")},
    **{f"switch={name}={value.value}": {"switches": {name: value.value}}
       for name, field in Switches.model_fields.items() for value in field.annotation if value.value != "unset"},
    # Humming's batched experts, reached only with VLLM_HUMMING_MOE_GEMM_TYPE=grouped_masked
    "switch=humming_moe_gemm_type=grouped_masked+a2a=deepep_low_latency": {
        "switches": {"humming_moe_gemm_type": "grouped_masked"},
        "parallel": {"dp": 2, "expert_parallel": True, "all2all_backend": "deepep_low_latency"}},
    **{f"checkpoint={c}": {"quant": {"checkpoint": c}} for c in ("compressed_tensors", "quark")},
    "checkpoint=modelopt": {"quant": {"checkpoint": "modelopt", "activation_dynamic": False}},
    "static_activation_scales": {"quant": {"activation_dynamic": False}},
    **{f"arch={a}": {"model": {"architecture": a}} for a in ("qwen3_5_moe_text", "gpt_oss", "deepseek_v3", "kolibri1")},
    # Each alignment boundary a rule tests, on hidden and on the per-partition intermediate separately:
    # a multiple of 128 but not 256, of 64 but not 128, of 32 but not 64.
    **{f"hidden={h}": {"model": {"hidden_size": h}} for h in (2176, 2112, 2080)},
    **{f"intermediate={i}": {"model": {"moe_intermediate_size": i}} for i in (2176, 2112, 2080)},
    # Llama-4 routes each token to one expert; zentorch's INT4 grouped GEMM needs two.
    "top_k=1": {"model": {"top_k": 1}},
    "switch=rocm_use_aiter=on+rocm_use_aiter_moe=off": {"switches": {"rocm_use_aiter": "on", "rocm_use_aiter_moe": "off"}},
    # AITER pads a small unquantised intermediate (<= 192) to a multiple of 64, a larger one to 128.
    "intermediate=160": {"model": {"moe_intermediate_size": 160}},
    # a multiple of 8, not of 16: FlashInfer's per-tensor FP8 pads to 16 (its per-tensor keys: a ModelOpt checkpoint),
    # vLLM's CPU experts to 32 (16 for bf16 on POWER)
    "intermediate=2056": {"model": {"moe_intermediate_size": 2056}},
    "checkpoint=modelopt+intermediate=2056": {"quant": {"checkpoint": "modelopt", "activation_dynamic": False},
                                              "model": {"moe_intermediate_size": 2056}},
    # POWER's VSX experts take bf16 only: an fp16 layer there gets the generic CPU experts' pad to 32
    "dtype=fp16+intermediate=2056": {"model": {"in_dtype": "fp16", "moe_intermediate_size": 2056}},
    "act=relu2_no_mul+intermediate=2080": {"model": {"activation": "relu2_no_mul", "moe_intermediate_size": 2080}},
    # a decode batch of 1 token: the measured Hopper MXFP4 order for gpt-oss (swigluoai) applies
    "act=swigluoai+num_tokens_hint=1": {"model": {"activation": "swigluoai"}, "features": {"num_tokens_hint": 1}},
    # a non-gated layer (Nemotron-H style) whose intermediate is a multiple of 64, not of 128: TRT-LLM/CuteDSL
    # NVFP4 pad it to 128 there, to 64 when gated
    "act=relu2_no_mul+intermediate=2112": {"model": {"activation": "relu2_no_mul", "moe_intermediate_size": 2112}},
    # vLLM's CPU BF16 experts need hidden a multiple of 32 unless zentorch runs the layer
    "hidden=2000+without=zentorch": {"model": {"hidden_size": 2000},
                                     "platform": {"packages": [q.value for q in Package if q != Package.zentorch]}},
    "lora+a2a=flashinfer_nvlink": {"features": {"lora": True},
                                   "parallel": {"dp": 2, "expert_parallel": True, "all2all_backend": "flashinfer_nvlink"}},
    "a2a=moonep+eplb": {"parallel": {"dp": 2, "expert_parallel": True, "eplb": True, "all2all_backend": "moonep"}},
    # vLLM's LoRA shortcut returns Triton before looking at the dispatcher: only the engine's EPLB check stops it
    "lora+a2a=moonep+eplb": {"features": {"lora": True},
                             "parallel": {"dp": 2, "expert_parallel": True, "eplb": True, "all2all_backend": "moonep"}},
    # triton_kernels' MXFP4 MoE asserts bf16 inputs; swigluoai is the only activation it takes
    "act=swigluoai+dtype=fp16": {"model": {"activation": "swigluoai", "in_dtype": "fp16"}},
    "a2a=flashinfer_nvlink+eplb": {"parallel": {"dp": 2, "expert_parallel": True, "eplb": True,
                                                "all2all_backend": "flashinfer_nvlink"}},
    "a2a=deepep_low_latency+without=triton": {
        "parallel": {"dp": 2, "expert_parallel": True, "all2all_backend": "deepep_low_latency"},
        "platform": {"packages": [q.value for q in Package if q != Package.triton]}},
}


# (CPU arch, variation) beyond the product's x86_64 cells, for vLLM's CPU experts (see cells()).
CPU_ISA_CELLS = [("aarch64", ""), ("ppc64le", ""), ("x86_64", "intermediate=2056"), ("aarch64", "intermediate=2056"),
                 ("ppc64le", "intermediate=2056"), ("ppc64le", "dtype=fp16+intermediate=2056")]


# What a vendor's own experts wait for before they are considered at all (AITER: VLLM_ROCM_USE_AITER=1; vLLM's
# CPU MXFP4/INT4 experts: AMX): every single-factor variation is also tried with it, on that vendor only, so
# the limits of those experts (activations, routing, dtypes, biases, dispatchers) show in some decision.
ENABLERS = {"switch=rocm_use_aiter=on": ("rocm", {"switches": {"rocm_use_aiter": "on"}}),
            "cpu_amx": ("cpu", {"platform": {"cpu_amx": True}})}


def _with_enabler(variation: str, enabler: str) -> dict:
    changes = {section: dict(values) for section, values in VARIATIONS[variation].items()}
    for section, values in ENABLERS[enabler][1].items():
        changes[section] = {**changes.get(section, {}), **values}
    return changes


def _cell(platform, quant, parallel, lora, align, activation, packages, pin, variation: str = "",
          changes: Optional[dict] = None) -> Cell:
    """One cell; `changes` (default: the named variation's) are applied on top of the plain layer."""
    vendor, arch = platform
    key = "|".join([f"{vendor}:{arch}", _quant_name(quant), parallel, "lora" if lora else "-", align, activation,
                    f"pkg={packages}", f"pin={pin}"] + ([variation] if variation else []))
    sections = {"model": dict(num_experts=16, top_k=2, activation=activation, **ALIGNMENTS[align]),
                "quant": dict(quant), "parallel": dict(PARALLELS[parallel]),
                "platform": {"vendor": vendor, "arch": arch, "packages": PACKAGES[packages]},
                "features": {"lora": lora, "backend": pin}, "switches": {}}
    for section, values in (VARIATIONS.get(variation, {}) if changes is None else changes).items():
        sections[section] = {**sections[section], **values}
    return Cell(key, MoEConfig(**sections))


def cells(backends: Mapping[str, Declared]) -> Iterator[Cell]:
    """The auto-mode product, then every backend pinned on a plain single-GPU layer per platform/scheme."""
    for platform, quant, parallel, lora, align, activation, packages in itertools.product(
            PLATFORMS, QUANTS, PARALLELS, (False, True), ALIGNMENTS, ACTIVATIONS, PACKAGES):
        yield _cell(platform, quant, parallel, lora, align, activation, packages, "auto")
    for platform, quant, align, pin in itertools.product(PLATFORMS, QUANTS, ALIGNMENTS, sorted(backends)):
        yield _cell(platform, quant, "single", False, align, "silu", "all", pin)
    # An intermediate size that is a multiple of 32 but not 64, gated and not: the round-ups of pin-only backends
    # act here, and the gated-only ones (b12x NVFP4) must not act on a non-gated layer.
    for platform, quant, pin, variation in itertools.product(PLATFORMS, QUANTS, sorted(backends),
                                                             ("intermediate=2080", "act=relu2_no_mul+intermediate=2080")):
        yield _cell(platform, quant, "single", False, "aligned", "silu", "all", pin, variation)
    for platform, quant, variation in itertools.product(PLATFORMS, QUANTS, VARIATIONS):
        yield _cell(platform, quant, "single", False, "aligned", "silu", "all", "auto", variation)
    for enabler, (vendor, _) in ENABLERS.items():
        for platform, quant, variation in itertools.product(PLATFORMS, QUANTS, VARIATIONS):
            if platform[0] == vendor and enabler.split("=")[0] not in variation:
                yield _cell(platform, quant, "single", False, "aligned", "silu", "all", "auto",
                            f"{variation}+{enabler}", _with_enabler(variation, enabler))
    # Each pinned backend with every package but its own (AITER switched on, behind the dispatcher its format
    # needs): there the generated package gate alone refuses it, so a mutant of that gate changes a decision.
    for platform, quant, (pin, declared) in itertools.product(PLATFORMS, QUANTS, sorted(backends.items())):
        own = {package.value for package in declared.item.packages}
        if own:
            parallel = "a2a_deepep_ll" if declared.item.format.value == "batched" else "single"
            yield _cell(platform, quant, parallel, False, "aligned", "silu", "all", pin, "without_own_packages",
                        {"platform": {"packages": sorted(set(PACKAGES["all"]) - own)},
                         "switches": {"rocm_use_aiter": "on"}})
    for platform, quant, pin in itertools.product(PLATFORMS, LAYOUTS, ["auto", *sorted(backends)]):
        yield _cell(platform, quant, "single", False, "aligned", "silu", "all", pin, "switch=rocm_use_aiter=on")
    # Each pin under expert parallelism with fp16 inputs: the MoE-EP megakernels, which run only under EP and
    # only when pinned, show their dtype limit here, and every backend's fp16 refusal is recorded pinned.
    for platform, quant, pin in itertools.product(PLATFORMS, QUANTS, sorted(backends)):
        yield _cell(platform, quant, "tp2_ep", False, "aligned", "silu", "all", pin, "dtype=fp16")
    # vLLM's CPU experts differ by ISA (AMX, NEON, VSX) and pad the intermediate by ISA and dtype: auto and
    # pinned on CPUs other than x86, and on every CPU at a multiple of 8 that is not one of 16 (vLLM's CPU experts
    # pad to 32, to 16 for bf16 on POWER).
    for (arch, variation), quant, pin in itertools.product(CPU_ISA_CELLS, QUANTS, ("auto", "vllm_cpu")):
        if (arch, pin) != ("x86_64", "auto"):   # x86_64 in auto mode: the variations above
            yield _cell(("cpu", arch), quant, "single", False, "aligned", "silu", "all", pin, variation)


def random_cells(count: int, seed: int = 0) -> Iterator[Cell]:
    """Seeded random configs beyond the categorical grid: other sizes, TP degrees, packages."""
    rng = random.Random(seed)
    for index in range(count):
        vendor, arch = rng.choice(PLATFORMS)
        hidden = rng.choice([256, 512, 1024]) * rng.randint(1, 8) + rng.choice([0, 0, 64, 128, 192])
        inter = rng.choice([256, 512]) * rng.randint(1, 12) + rng.choice([0, 0, 64, 128])
        tp = rng.choice([1, 2, 4, 8])
        tp = tp if inter % tp == 0 else 1
        packages = rng.sample(PACKAGES["all"], rng.randint(0, len(PACKAGES["all"])))
        config = MoEConfig(
            model=dict(num_experts=rng.choice([8, 64, 256]), top_k=2, hidden_size=hidden, moe_intermediate_size=inter,
                       activation=rng.choice(ACTIVATIONS + ["relu2_no_mul", "gelu"]), has_bias=rng.random() < 0.2),
            quant=rng.choice(QUANTS), parallel={**rng.choice(list(PARALLELS.values())), "tp": tp}
            if rng.random() < 0.5 else rng.choice(list(PARALLELS.values())),
            platform={"vendor": vendor, "arch": arch, "packages": sorted({"triton", *packages})},
            features={"lora": rng.random() < 0.2})
        yield Cell(f"random#{seed}:{index}", config)


def decide_config(engine: Engine, config: MoEConfig) -> Decision:
    try:
        return engine.decide(config, quiet=True)
    except BackendRejectedError as error:
        return error.decision


def ranking(engine: Engine, decision: Decision) -> tuple[list[str], list[str]]:
    """The platform priority this decision applied, and the ids of the priority rules that made it
    (the base order first)."""
    fired = set(decision.trace)
    applied = [r for r in engine.ruleset.priorities if r.id in fired]
    order, base = effective_order(applied)
    return order, [r.id for r in applied if r is base] + [r.id for r in applied if r is not base]


def beaten(order: list[str], decision: Decision) -> list[str]:
    """The backends the decision had to rule out: those ranked before the winner (every ranked one when
    none was selected; for a pinned cell the pin and every ranked one)."""
    if decision.requested != "auto":
        return [decision.requested, *order]
    return order[:order.index(decision.backend)] if decision.backend in order else order


def responsible_rules(engine: Engine, decision: Decision) -> list[str]:
    """The rules a reader needs to explain this cell: what blocked the better-ranked backends
    (every ranked backend when none was selected or the backend was pinned), what picked the
    dispatcher and the plan."""
    fired = set(decision.trace)
    ahead = beaten(ranking(engine, decision)[0], decision)
    rules = {r.rule for r in decision.rejections if r.backend in ahead or r.backend == decision.prepare_finalize}
    rules |= {r.id for r in engine.ruleset.dispatch if r.id in fired}
    if decision.quant is not None:
        rules |= set(decision.quant.rules)
    return sorted(rules)


def record(engine: Engine, config: MoEConfig) -> dict:
    """A config's row, less its cell name; a config the rules cannot decide (a coverage hole) is an 'error' row."""
    try:
        d = decide_config(engine, config)
    except EngineError as error:
        return {**dict.fromkeys(COLUMNS[1:], ""), "outcome": "error", "failure_reason": str(error)}
    q, pad = d.quant, d.padding
    return {"outcome": d.outcome.value, "backend": d.backend or "",
            "alternatives": " ".join(d.alternatives),
            "prepare_finalize": d.prepare_finalize or "", "selected_by": d.selected_by.value if d.selected_by else "",
            "fallback_rule": d.fallback_rule or "", "quantized_by": q.quantized_by.value if q else "",
            "expects_unquantized_inputs": str(q.expects_unquantized_inputs) if q else "",
            "dispatch_dtype": q.dispatch_dtype if q else "", "scale_dim": str(q.scale_dim) if q else "",
            "weight_block": str(q.weight_block) if q else "", "hidden_pad": str(pad.hidden_pad) if pad else "",
            "intermediate_pad": str(pad.intermediate_pad) if pad else "",
            "expert_placement": d.expert_placement.value if d.expert_placement else "",
            "failure_reason": d.failure_reason.value if d.failure_reason else "",
            "refused_by": _refused_by(d),
            "rules": " ".join(responsible_rules(engine, d))}


def _refused_by(decision: Decision) -> str:
    """A pinned cell's every rule that refuses the requested backend: what a user who pinned it is told. Only
    the decisive one is `failure_reason`; recording them all makes every rule that can refuse a pin visible."""
    if decision.requested == "auto":
        return ""
    return " ".join(sorted({r.rule for r in decision.rejections_of(decision.requested)}))


def row(engine: Engine, cell: Cell) -> dict:
    return {"cell": cell.key, **record(engine, cell.config)}


def build_rows(ruleset: RuleSet, evaluator: str = "auto", cells_: Optional[Sequence[Cell]] = None, *,
               cache_root=None, workers: Optional[int] = None, progress: Optional[Progress] = None) -> list[dict]:
    """The rows of `cells_` (default: the whole matrix), on every core, through the decision cache."""
    chosen = list(cells(ruleset.backends)) if cells_ is None else cells_
    records = pool.evaluate_all(record, ruleset, [c.config for c in chosen], evaluator=evaluator,
                                cache_root=cache_root, workers=workers, progress=progress)
    return [{"cell": c.key, **r} for c, r in zip(chosen, records)]


@dataclass(frozen=True)
class Change:
    cell: str
    old: dict
    new: dict

    @property
    def rules(self) -> list[str]:
        """Rule ids that explain the difference: in one record's explanation but not the other's (a row
        read from the golden files has none, so against them these are the rules now responsible)."""
        old, new = set(self.old.get("rules", "").split()), set(self.new.get("rules", "").split())
        return sorted(old ^ new)

    def fields(self) -> list[str]:
        return [c for c in COLUMNS[1:-1] if self.old.get(c) != self.new.get(c)]

    def describe(self) -> str:
        old_b = self.old.get("backend") or self.old.get("outcome", "(absent)")
        new_b = self.new.get("backend") or self.new.get("outcome", "(absent)")
        changed = ", ".join(f"{f}: {self.old.get(f)!r} -> {self.new.get(f)!r}" for f in self.fields()
                            if f != "backend")
        return (f"{self.cell}: {old_b} -> {new_b}" + (f" ({changed})" if changed else "") +
                f"; rules: {', '.join(self.rules) or '(same rules, different outcome)'}")

    def to_dict(self) -> dict:
        return {"cell": self.cell, "old_backend": self.old.get("backend"), "new_backend": self.new.get("backend"),
                "changed_fields": self.fields(), "rules": self.rules, "old": self.old, "new": self.new}


def compare(old: dict[str, dict], new: dict[str, dict]) -> list[Change]:
    """Cells whose record differs (rules explanations alone do not count as a change)."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, {}), new.get(key, {})
        if any(a.get(c) != b.get(c) for c in COLUMNS[1:-1]):
            changes.append(Change(key, a, b))
    return changes


def summary(changes: list[Change], total: Optional[int] = None) -> str:
    moved: dict[tuple, int] = {}
    for change in changes:
        pair = (change.old.get("backend") or change.old.get("outcome", "-"),
                change.new.get("backend") or change.new.get("outcome", "-"))
        moved[pair] = moved.get(pair, 0) + 1
    lines = [f"{len(changes)} changed decision(s)" + (f" of {total}" if total else "")]
    lines += [f"  {count:6d}  {a} -> {b}" for (a, b), count in sorted(moved.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)
