"""`MoEConfig`: the closed, typed input of a decision.

Everything a rule may read is a field or a computed field here. Rules compare values;
they never do arithmetic, so every derived quantity they need (alignment, the
per-partition intermediate size, whether all2all is in use) is computed once, here.
"""

from __future__ import annotations

import re
from enum import Enum
from functools import lru_cache
from typing import ClassVar, Optional

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, computed_field, field_serializer, field_validator,
                      model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

from moerules.activation import Activation, Dtype, SwigluParams
from moerules.limits import MAX_ARCH_LENGTH, MAX_CUDA_CC_DIGITS, MAX_LAYER_DIM, MAX_RANKS
from moerules.quant import QuantConfig
from moerules.resources import default_rules_dir

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class _Record(BaseModel):
    """A frozen config section whose computed fields may appear in input (e.g. a Decision's JSON).

    They are derived, so they are dropped on input and recomputed, never trusted.
    """

    model_config = _FROZEN

    @model_validator(mode="before")
    @classmethod
    def _drop_derived(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in cls.model_computed_fields}
        return data


def pow2_alignment(value: int) -> int:
    """Largest power of two dividing `value` (capped at 4096, which every rule treats as 'aligned')."""
    return min(value & -value, 4096) if value > 0 else 0


class Routing(str, Enum):
    """How router logits become top-k expert ids and weights."""

    softmax_renormalize = "softmax_renormalize"   # Mixtral, Qwen3 MoE (vLLM RenormalizeNaive)
    renormalize = "renormalize"                   # top-k of the logits, then softmax (vLLM Renormalize)
    softmax = "softmax"                           # no renormalisation after top-k (vLLM Default)
    deepseek_v3 = "deepseek_v3"                   # sigmoid + grouped top-k + correction bias
    minimax2 = "minimax2"                         # sigmoid + correction bias, no groups
    sigmoid = "sigmoid"
    sigmoid_renormalize = "sigmoid_renormalize"
    llama4 = "llama4"


# Old field names that now mean something else, with why and the new name: refused, never read as the new one.
RENAMED_MODEL_FIELDS = {
    "intermediate_size": "model.intermediate_size was renamed model.moe_intermediate_size: the per-expert size. "
                         "Hugging Face's `intermediate_size` is the dense MLP's on most MoE models (Qwen3-30B-A3B: "
                         "6144 dense, 768 per expert); take `moe_intermediate_size` from config.json, or use "
                         "MoEConfig.from_hf",
}


class ModelShape(_Record):

    num_experts: int = Field(ge=1, le=4096, description="Global number of routed experts.")
    top_k: int = Field(ge=1, le=4096, description="Experts per token.")
    hidden_size: int = Field(ge=1, le=MAX_LAYER_DIM, description="Model hidden size (K of GEMM1, N of GEMM2).")
    moe_intermediate_size: int = Field(ge=1, le=MAX_LAYER_DIM,
                                       description="Per-expert intermediate size before tensor-parallel sharding "
                                                   "(Hugging Face `moe_intermediate_size`; Mixtral's "
                                                   "`intermediate_size`).")
    activation: Activation = Field(Activation.silu, description="Expert activation; gated ones compute act(gate) * "
                                                                "up (swigluoai: gpt-oss's clamped SwiGLU).")
    has_bias: bool = Field(False, description="Experts carry w13/w2 biases (gpt-oss).")
    in_dtype: Dtype = Field(Dtype.bf16, description="dtype of the layer's activations and unquantised weights.")
    routing: Routing = Field(Routing.softmax_renormalize, description="How router logits become top-k expert ids "
                                                                      "and weights.")
    router_logits_dtype: Dtype = Field(
        Dtype.bf16, description="dtype of the router logits the monolithic kernels read (default: in_dtype).")
    architecture: str = Field("unknown", pattern=r"^[a-z0-9_]{1,64}$",
                              description="Hugging Face model_type (deepseek_v3, gpt_oss, qwen3_moe ...): vLLM "
                                          "turns some kernels off per model type.")
    swiglu_limit: float = Field(SwigluParams.limit, gt=0, le=1e4, allow_inf_nan=False,
                                description="swigluoai clamp: gate <= limit, -limit <= up <= limit (gpt-oss "
                                            "swiglu_limit).")
    swiglu_alpha: float = Field(SwigluParams.alpha, gt=0, le=1e4, allow_inf_nan=False,
                                description="swigluoai sigmoid gain: gate * sigmoid(alpha * gate) (gpt-oss).")
    routing_groups: int = Field(1, ge=1, le=4096, description="Expert groups of group-limited routing (Hugging Face "
                                                              "n_group; 1: no groups).")
    routing_topk_groups: int = Field(1, ge=1, le=4096, description="Groups a token may pick experts from "
                                                                   "(Hugging Face topk_group).")
    routed_scaling_factor: float = Field(1.0, gt=0, le=1e4, allow_inf_nan=False,
                                         description="Factor on the routed experts' weights (DeepSeek, GLM-4-MoE).")
    shared_experts: int = Field(0, ge=0, le=64, description="Shared experts every token runs besides the routed ones "
                                                            "(a dense MLP of shared_intermediate_size).")
    shared_intermediate_size: int = Field(0, ge=0, le=MAX_LAYER_DIM,
                                          description="Intermediate size of the shared experts' MLP, all of them "
                                                      "together.")

    # Kernel math, not kernel choice: floats, which rules cannot compare, so they are not facts.
    MATH_ONLY_FIELDS: ClassVar[frozenset[str]] = frozenset({"swiglu_limit", "swiglu_alpha", "routed_scaling_factor"})

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data):
        """Refuse a field's old name, at that field, naming the new one (extra="forbid" would only say 'unknown')."""
        if isinstance(data, dict):
            errors = [InitErrorDetails(type=PydanticCustomError("renamed_field", message), loc=(old,), input=data[old])
                      for old, message in RENAMED_MODEL_FIELDS.items() if old in data]
            if errors:
                raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @model_validator(mode="before")
    @classmethod
    def _router_logits_default(cls, data):
        """Unset router-logits dtype means the layer's in_dtype (vLLM FusedMoEConfig.__post_init__)."""
        if isinstance(data, dict) and data.get("router_logits_dtype") is None:
            data = {**data, "router_logits_dtype": data.get("in_dtype", Dtype.bf16)}
        return data

    @model_validator(mode="after")
    def _top_k_within_experts(self) -> "ModelShape":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        return self

    @model_validator(mode="after")
    def _groups_fit(self) -> "ModelShape":
        groups, picked = self.routing_groups, self.routing_topk_groups
        if self.num_experts % groups:
            raise ValueError(f"num_experts={self.num_experts} does not split into routing_groups={groups}")
        if picked > groups:
            raise ValueError(f"routing_topk_groups={picked} exceeds routing_groups={groups}")
        if self.top_k > picked * (self.num_experts // groups):
            raise ValueError(f"top_k={self.top_k} exceeds the {picked * (self.num_experts // groups)} experts of "
                             f"routing_topk_groups={picked} groups of {self.num_experts // groups}")
        return self

    @model_validator(mode="after")
    def _shared_experts_sized(self) -> "ModelShape":
        if (self.shared_experts > 0) != (self.shared_intermediate_size > 0):
            raise ValueError(f"shared_experts={self.shared_experts} and shared_intermediate_size="
                             f"{self.shared_intermediate_size} must both be set, or both 0")
        return self

    @property
    def swiglu(self) -> SwigluParams:
        """The swigluoai parameters as the kernels take them."""
        return SwigluParams(limit=self.swiglu_limit, alpha=self.swiglu_alpha)

    @computed_field
    @property
    def gated(self) -> bool:
        return self.activation.gated

    @computed_field
    @property
    def hidden_align(self) -> int:
        """Largest power-of-two divisor of hidden_size (for alignment gates)."""
        return pow2_alignment(self.hidden_size)

    @computed_field
    @property
    def hidden_groups_128(self) -> int:
        """Activation scales per token with 1x128 groups (block-FP8 dispatch)."""
        return -(-self.hidden_size // 128)

    @computed_field
    @property
    def hidden_groups_32(self) -> int:
        """Activation scales per token with MX 1x32 groups."""
        return -(-self.hidden_size // 32)

    @computed_field
    @property
    def hidden_groups_16(self) -> int:
        """Activation scales per token with NVFP4 1x16 groups."""
        return -(-self.hidden_size // 16)


class All2AllBackend(str, Enum):
    """The expert-parallel token exchange requested by the deployment."""

    allgather_reducescatter = "allgather_reducescatter"
    torch_all2all = "torch_all2all"               # ours, over torch.distributed
    torch_all2all_batched = "torch_all2all_batched"  # ours, into per-expert batches
    deepep_high_throughput = "deepep_high_throughput"
    deepep_low_latency = "deepep_low_latency"
    deepep_v2 = "deepep_v2"
    mori = "mori"
    nixl_ep = "nixl_ep"
    moonep = "moonep"
    flashinfer_nvlink = "flashinfer_nvlink"       # two-sided (vLLM flashinfer_nvlink_two_sided)
    flashinfer_nvlink_one_sided = "flashinfer_nvlink_one_sided"


# Backends that hand experts a [E_local, max_tokens, K] batch instead of a token list.
BATCHED_ALL2ALL = frozenset({All2AllBackend.deepep_low_latency, All2AllBackend.nixl_ep,
                             All2AllBackend.torch_all2all_batched})


class Parallel(_Record):

    tp: int = Field(1, ge=1, le=MAX_RANKS, description="Tensor-parallel size.")
    dp: int = Field(1, ge=1, le=MAX_RANKS, description="Data-parallel size.")
    expert_parallel: bool = Field(False, description="Shard experts over the tp*dp ranks instead of tensor-sharding them.")
    all2all_backend: All2AllBackend = Field(All2AllBackend.allgather_reducescatter,
                                            description="Expert-parallel token exchange (used when "
                                                        "expert_parallel and tp*dp > 1).")
    eplb: bool = Field(False, description="Expert-parallel load balancing (redundant experts).")

    @computed_field
    @property
    def use_ep(self) -> bool:
        return self.expert_parallel and self.tp * self.dp > 1

    @computed_field
    @property
    def ep_size(self) -> int:
        return self.tp * self.dp if self.use_ep else 1

    @computed_field
    @property
    def moe_tp(self) -> int:
        """TP degree the expert weights are sharded over (flattened across DP; 1 under EP)."""
        return 1 if self.use_ep else self.tp * self.dp

    @computed_field
    @property
    def use_all2all(self) -> bool:
        """EP with DP>1 exchanges tokens; TP+EP with dp=1 uses an expert map and all-reduce instead."""
        return self.use_ep and self.dp > 1

    @computed_field
    @property
    def batched_format(self) -> bool:
        return self.use_all2all and self.all2all_backend in BATCHED_ALL2ALL


class Vendor(str, Enum):
    cuda = "cuda"
    rocm = "rocm"
    xpu = "xpu"
    cpu = "cpu"


PACKAGES_FILE = "05-packages.yaml"


def _declared_packages() -> dict[str, dict]:
    """The shipped rule set's `packages:` section, by id, read as plain YAML (the engine's loader validates
    the same file with file:line errors; here it is only the vocabulary)."""
    import yaml
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    document = yaml.load((default_rules_dir() / PACKAGES_FILE).read_text(), Loader=loader)
    return {entry["id"]: entry for entry in document["packages"]}


PACKAGE_DECLARATIONS = _declared_packages()
# Declared once, with their probes, in rules/05-packages.yaml: a new package is a line there, not an edit here.
Package = Enum("Package", {name: name for name in PACKAGE_DECLARATIONS}, type=str, module=__name__,
               qualname="Package")
Package.__doc__ = "Kernel packages a backend may need; `detect()` probes them, a what-if config states them."


# What `pip install vllm==0.33.0` brings on CUDA: its own Marlin/CUTLASS ops, the vendored deep_gemm and
# triton_kernels (vllm/third_party), and its flashinfer-python and humming-kernels requirements.
VLLM_INSTALL = frozenset({Package.triton, Package.vllm, Package.marlin, Package.vllm_cutlass, Package.deep_gemm,
                          Package.triton_kernels, Package.flashinfer, Package.humming})


_ARCH_PREFIX = {Vendor.cuda: "sm_", Vendor.rocm: "gfx", Vendor.xpu: "xe", Vendor.cpu: ""}
# ASCII only: str.isdigit/isalnum accept '²' and full-width '９０', which int() reads as another arch.
_ARCH = re.compile(rf"[A-Za-z0-9_]{{1,{MAX_ARCH_LENGTH}}}")
_CUDA_ARCH = re.compile(rf"sm_[0-9]{{1,{MAX_CUDA_CC_DIGITS}}}")


class Platform(_Record):

    vendor: Vendor = Field(Vendor.cuda, description="GPU/CPU vendor the layer runs on.")
    arch: str = Field("sm_90", description="sm_90, sm_100, gfx942, gfx950, gfx1200, xe_hpc, x86_64, aarch64 ...")
    packages: frozenset[Package] = Field(frozenset({Package.triton}),
                                         description="Kernel packages importable on the platform.")
    torch_grouped_mm: bool = Field(True, description="torch provides _grouped_mm/_scaled_grouped_mm (torch>=2.8).")
    cpu_amx: bool = Field(False, description="The CPU is x86 with AMX tiles (Intel Sapphire Rapids or newer): vLLM's "
                                             "x86 CPU MoE kernels need them (read on vendor cpu only).")

    @field_serializer("packages", when_used="json")
    def _sorted_packages(self, packages: frozenset[Package]) -> list[Package]:
        """Sorted: a set iterates in hash-seed order, and the JSON record must be byte-stable."""
        return sorted(packages, key=lambda package: package.value)

    @field_validator("arch")
    @classmethod
    def _arch_shape(cls, arch: str) -> str:
        if not _ARCH.fullmatch(arch):
            raise ValueError(f"arch {arch[:MAX_ARCH_LENGTH]!r} must be a name of at most {MAX_ARCH_LENGTH} ASCII "
                             "letters, digits and '_', such as sm_90, gfx950 or x86_64")
        return arch.lower()

    @model_validator(mode="after")
    def _arch_matches_vendor(self) -> "Platform":
        prefix = _ARCH_PREFIX[self.vendor]
        if prefix and not self.arch.startswith(prefix):
            raise ValueError(f"arch {self.arch!r} does not belong to vendor {self.vendor.value!r} "
                             f"(expected a name starting with {prefix!r})")
        if self.vendor == Vendor.cuda and not _CUDA_ARCH.fullmatch(self.arch):
            raise ValueError(f"CUDA arch {self.arch!r} must be sm_<capability> with at most {MAX_CUDA_CC_DIGITS} "
                             "digits, e.g. sm_90 or sm_120")
        return self

    @computed_field
    @property
    def cc(self) -> int:
        """CUDA compute capability as an integer (sm_90 -> 90); 0 on other vendors."""
        return int(self.arch[3:]) if self.vendor == Vendor.cuda else 0

    @computed_field
    @property
    def cc_family(self) -> int:
        """SM family (90, 100, 110, 120); 0 on other vendors."""
        return self.cc // 10 * 10

    @computed_field
    @property
    def gfx9(self) -> bool:
        return self.vendor == Vendor.rocm and self.arch.startswith("gfx9")

    @computed_field
    @property
    def gfx12(self) -> bool:
        return self.vendor == Vendor.rocm and self.arch.startswith("gfx12")


class Switch(str, Enum):
    """A vLLM environment switch as vLLM reads it: unset (its default applies), on or off.
    vLLM treats *set* differently from *default*: e.g. VLLM_USE_DEEP_GEMM=1 forces DeepGEMM."""

    unset = "unset"
    on = "on"
    off = "off"


# The environment variables behind each switch field (vllm/envs.py; vLLM reads either DeepGEMM variable).
SWITCH_VARIABLES = {"rocm_use_aiter": ("VLLM_ROCM_USE_AITER",), "rocm_use_aiter_moe": ("VLLM_ROCM_USE_AITER_MOE",),
                    "use_deep_gemm": ("VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM")}


class HummingGemmType(str, Enum):
    """VLLM_HUMMING_MOE_GEMM_TYPE as vLLM reads it (experts/fused_humming_moe.py:112-126): unset (or `auto`)
    lets vLLM choose (indexed, grouped under EP); a value forces that GEMM, and with it one Humming class."""

    unset = "unset"
    indexed = "indexed"
    grouped = "grouped"                    # vLLM's grouped_contiguous
    grouped_masked = "grouped_masked"      # the batched class


HUMMING_GEMM_VARIABLE = "VLLM_HUMMING_MOE_GEMM_TYPE"


class Switches(_Record):
    """vLLM's environment switches that change the kernel decision; `detect()` reads them."""

    rocm_use_aiter: Switch = Field(Switch.unset, description="VLLM_ROCM_USE_AITER (default off): on forces AITER.")
    rocm_use_aiter_moe: Switch = Field(Switch.unset, description="VLLM_ROCM_USE_AITER_MOE (default on).")
    use_deep_gemm: Switch = Field(Switch.unset, description="VLLM_USE_DEEP_GEMM / VLLM_MOE_USE_DEEP_GEMM: on forces "
                                                            "DeepGEMM for FP8, off removes it.")
    humming_moe_gemm_type: HummingGemmType = Field(HummingGemmType.unset, description=(
        "VLLM_HUMMING_MOE_GEMM_TYPE: the GEMM Humming runs (default: indexed, grouped under EP); grouped_masked "
        "selects its batched experts, behind a batched dispatcher."))

    @field_validator(*SWITCH_VARIABLES, mode="before")
    @classmethod
    def _yaml_booleans(cls, value):
        """YAML 1.1 reads a bare `on`/`off` as a boolean: take it as the switch it was written as."""
        if isinstance(value, bool):
            return Switch.on if value else Switch.off
        return value


class Features(BaseModel):
    model_config = _FROZEN

    lora: bool = Field(False, description="LoRA adapters on the experts.")
    batch_invariant: bool = Field(False, description="Results must not depend on batch composition.")
    backend: str = Field("auto", description="Requested experts backend: 'auto' or a backend id of the rule set.")
    num_tokens_hint: int = Field(0, ge=0, description=(
        "Tokens per forward the decision serves, where the engine knows it (e.g. the batch size of the CUDA graph "
        "it builds the layer for); 0 = not known: rules that rank by it stay silent, as vLLM 0.33 decides."))

    @field_validator("backend")
    @classmethod
    def _normalise(cls, name: str) -> str:
        return name.strip().lower().replace("-", "_")


class MoEConfig(_Record):
    """One MoE layer in one deployment."""

    model: ModelShape
    quant: QuantConfig = QuantConfig()
    parallel: Parallel = Parallel()
    platform: Platform = Platform()
    features: Features = Features()
    switches: Switches = Switches()

    @classmethod
    def from_hf(cls, config_json_or_dict, *, platform=None, parallel=None, layer: Optional[int] = None,
                features=None, switches=None) -> "MoEConfig":
        """The config of a Hugging Face model's MoE layers (or of MoE layer `layer`) in a deployment.

        `config_json_or_dict`: a config.json path, a model folder, or the dict; `platform`, `parallel`,
        `features`, `switches`: the other sections (records or dicts; default as in MoEConfig). Raises
        HFConfigError naming the config.json field that does not map (see moerules.hf_config).
        """
        from moerules.hf_config import hf_sections
        sections = hf_sections(config_json_or_dict, layer=layer)
        given = {"platform": platform, "parallel": parallel, "features": features, "switches": switches}
        return cls.model_validate({**sections, **{name: value for name, value in given.items() if value is not None}})

    @model_validator(mode="after")
    def _intermediate_shards_evenly(self) -> "MoEConfig":
        tp = self.parallel.moe_tp
        if self.model.moe_intermediate_size % tp:
            raise ValueError(f"model.moe_intermediate_size={self.model.moe_intermediate_size} is not divisible by "
                             f"the MoE tensor-parallel size {tp} (parallel.tp * parallel.dp without expert_parallel)")
        return self

    @computed_field
    @property
    def intermediate_per_partition(self) -> int:
        return self.model.moe_intermediate_size // self.parallel.moe_tp

    @computed_field
    @property
    def intermediate_align(self) -> int:
        """Largest power-of-two divisor of the per-partition intermediate size."""
        return pow2_alignment(self.intermediate_per_partition)

    @computed_field
    @property
    def experts_per_rank_remainder(self) -> int:
        """Experts left over when they are split over the EP ranks (0: every rank holds E/ranks)."""
        return self.model.num_experts % self.parallel.ep_size

    def facts(self) -> dict:
        """The config as the fully-populated fact the rule engines match against, flat: dotted
        names such as `platform.arch` (durable-rules flattens nested objects the same way)."""
        flat = {}
        for name in type(self).model_fields:
            if name != "quant":
                flat.update(_section_facts(name, getattr(self, name)))
        flat.update((name, getattr(self, name)) for name in type(self).model_computed_fields)
        flat.update(_quant_facts(self.quant))
        return flat


@lru_cache(maxsize=4096)
def _section_facts(name: str, section: BaseModel) -> dict:
    """One section of a config as facts. Sections recur across configs (one platform and parallel
    layout, many shapes), and serialising one costs more than finding it here."""
    data = section.model_dump(mode="json", exclude=ModelShape.MATH_ONLY_FIELDS if name == "model" else None)
    flat = {f"{name}.{field}": value for field, value in data.items() if field != "packages"}
    if name == "platform":
        flat.update((fact, package in section.packages) for fact, package in _PACKAGE_FACTS)
    return flat


_PACKAGE_FACTS = [(f"platform.packages.{package.value}", package) for package in Package]


@lru_cache(maxsize=1024)
def _quant_facts(quant: QuantConfig) -> dict:
    """Few distinct quant configs recur across many layers; deriving their keys costs ~10 us."""
    facts = {"quant.family": quant.family.value, "quant.checkpoint": quant.checkpoint.value}
    for operand, key in (("weight", quant.weight_key), ("activation", quant.activation_key)):
        facts.update((f"quant.{operand}.{name}", value) for name, value in _key_fact(key).items())
    return facts


def _key_fact(key) -> dict:
    """Weight/activation key as facts; an absent key is spelled out so no field is ever missing."""
    if key is None:
        return {"quantized": False, "dtype": "none", "granularity": "none", "dynamic": False, "scale_dtype": "none"}
    return {"quantized": True, **key.model_dump(mode="json")}

