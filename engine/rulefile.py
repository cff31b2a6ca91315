"""The rule-file format: pydantic models that YAML rule files are validated against.

A rule file may hold any of the sections below; a rule set is the union of the files of
one folder. Conditions are strings in the expression language of `expr.py`; they are
parsed after this structural validation, so both kinds of error carry file:line:col.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moerules.config import Package
from moerules.decision import ActivationFormat, ExpertPlacement, QuantizedBy, ReasonCode

_ID = r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)*$"
# `{field.path}` in a constraint message is filled in from the config (or `{backend}`).
MESSAGE_PLACEHOLDER = re.compile(r"\{([A-Za-z_][\w.]*)\}")
_STRICT = ConfigDict(extra="forbid", frozen=True)
DEVIATION = Field(None, min_length=1, description=(
    "Why this rule decides differently from vLLM 0.33 on purpose, with the upstream file:line or issue that "
    "shows vLLM's bug; conformance counts the configs it accounts for."))


VllmPin = Annotated[str, Field(pattern=r"^[a-z0-9_]+$")]
VllmFamily = Literal["unquantized", "fp8", "int8", "mxfp8", "mxfp4", "nvfp4", "wna16", "w4a8"]


class PackageDeclaration(BaseModel):
    """A kernel package: the config vocabulary (Platform.packages) is the shipped rules' list of these."""

    model_config = _STRICT

    id: Package = Field(description="The package's name in configs, `external:` and `requires:`.")
    probe: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", description=(
        "The module whose presence on this machine proves the package (detect() looks it up, never imports it)."))
    install: str = Field("", description="How to install it, for the error that says it is missing.")
    description: str = ""


class _Component(BaseModel):
    """Something a decision can name: an experts backend or a prepare/finalize."""

    model_config = _STRICT

    id: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    kernel: Optional[str] = Field(None, pattern=_ID, description="Registry id of our own kernel, e.g. triton.fused_moe.")
    external: Optional[Package] = Field(None, description="Package an external kernel comes from; selectable only where present.")
    adapter: Optional[str] = Field(None, pattern=_ID, description=(
        "Registry id of the adapter (moerules.kernels.registry.ADAPTERS) that runs this external backend through its "
        "package; only with 'external'. Without one, build() refuses the backend naming its package."))
    requires: list[Package] = Field([], description="Packages our own kernel needs (e.g. triton).")
    format: ActivationFormat = ActivationFormat.standard
    description: str = ""
    upstream: list[str] = Field([], description=(
        "vLLM 0.33 experts (or prepare/finalize) classes this component stands for: `moerules conformance` "
        "names vLLM's choice by them. Each class belongs to one component."))
    cite: Optional[str] = Field(None, description="The upstream source this component models (file:line).")

    @property
    def packages(self) -> list[Package]:
        """Every package this component needs; each gets a generated `package.<id>` constraint."""
        return ([self.external] if self.external else []) + list(self.requires)

    @model_validator(mode="after")
    def _kernel_xor_external(self):
        if (self.kernel is None) == (self.external is None):
            raise ValueError("give exactly one of 'kernel' (a registered kernel id) or 'external' (a package)")
        if self.adapter is not None and self.external is None:
            raise ValueError("'adapter' runs an external package: give it together with 'external', not 'kernel'")
        return self


class Backend(_Component):
    """An experts backend and its static capabilities (the `backend.*` fields of conditions)."""

    vllm_backend: Optional[Union[VllmPin, dict[VllmFamily, VllmPin]]] = Field(None, description=(
        "vLLM's `moe_backend` value that pins this backend there (or one per vLLM select family, where the same "
        "value means another backend in another family); conformance pins both sides with it, and a pin with no "
        "vLLM value for the config's family is ours only."))

    def vllm_pin(self, family: str) -> Optional[str]:
        if isinstance(self.vllm_backend, dict):
            return self.vllm_backend.get(family)
        return self.vllm_backend

    pin_only: bool = Field(False, description=(
        "vLLM 0.33 runs it only when pinned (no auto-mode order of its lists it), so no priority rule may list it; "
        "a backend without this flag must be listed by one, or lint reports it as unranked."))
    monolithic: bool = False
    lora: bool = False
    bias: bool = True
    expert_map: bool = True
    batch_invariant: bool = False
    expects_unquantized_inputs: bool = Field(
        False, description="Default; `plan` rules may override it depending on the dispatcher.")


class Dispatcher(_Component):
    """A prepare/finalize: how tokens reach the experts and come back."""


class Constraint(BaseModel):
    """Reject each listed component unless `require` holds (whenever `when` holds)."""

    model_config = _STRICT

    id: str = Field(pattern=_ID)
    applies_to: Union[Literal["all_backends"], list[str]] = Field(
        description="Backend/dispatcher ids, or all_backends (then `backend.*` fields are resolved per backend).")
    when: Optional[str] = None
    require: str
    reason: ReasonCode
    message: str = Field(min_length=1, description="Detail for the rejection; {field.path} placeholders are filled in.")
    fallback: bool = Field(False, description="Losing a better-ranked backend to this rule is a recorded degradation.")
    cite: Optional[str] = None
    deviation: Optional[str] = DEVIATION


class Priority(BaseModel):
    """Per-platform preference: a base `order`, or a `demote`/`promote` applied after it, in file order."""

    model_config = _STRICT

    id: str = Field(pattern=_ID)
    when: Optional[str] = None
    order: Optional[list[str]] = None
    demote: Optional[list[str]] = None
    promote: Optional[list[str]] = None
    cite: Optional[str] = None
    deviation: Optional[str] = DEVIATION

    @model_validator(mode="after")
    def _one_action(self):
        given = [name for name in ("order", "demote", "promote") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'order', 'demote' or 'promote'")
        if not getattr(self, given[0]):
            raise ValueError(f"'{given[0]}' must list at least one backend")
        return self

    @property
    def action(self) -> str:
        return "order" if self.order is not None else "demote" if self.demote is not None else "promote"

    @property
    def backends(self) -> list[str]:
        return getattr(self, self.action)


class DispatchRule(BaseModel):
    """Which prepare/finalize serves the parallel configuration. Exactly one must match."""

    model_config = _STRICT

    id: str = Field(pattern=_ID)
    when: str
    use: str
    cite: Optional[str] = None


class PlanStage(str, Enum):
    placement = "placement"          # who expects what: decided once backend and dispatcher are known
    quantization = "quantization"    # what crosses the dispatcher: needs the placement


QUANT_KEYS = frozenset({"quantized_by", "dispatch_dtype", "scale_dim", "scale_type_size"})


class PlanSet(BaseModel):
    """Plan values a rule sets. Placement keys and quantization keys never mix in one rule."""

    model_config = _STRICT

    expects_unquantized_inputs: Optional[bool] = None
    round_up_hidden: Optional[int] = Field(None, ge=1)
    round_up_intermediate: Optional[int] = Field(None, ge=1)
    weight_block: Optional[int] = Field(None, ge=1, description="Scale block along K that weight conversion must use.")
    expert_placement: Optional[ExpertPlacement] = Field(
        None, description="How experts map onto EP ranks (default contiguous).")
    quantized_by: Optional[QuantizedBy] = None
    dispatch_dtype: Optional[str] = Field(
        None, description="'input' for the layer's in_dtype, or a config field such as quant.activation.dtype.")
    scale_dim: Optional[Union[int, str]] = Field(None, description="A number, or an int field such as model.hidden_groups_128.")
    scale_type_size: Optional[int] = Field(None, ge=0)

    @property
    def values(self) -> dict:
        return self.model_dump(exclude_none=True, mode="json")

    @property
    def stage(self) -> PlanStage:
        return PlanStage.quantization if QUANT_KEYS & set(self.values) else PlanStage.placement

    @model_validator(mode="after")
    def _coherent(self):
        keys = set(self.values)
        if not keys:
            raise ValueError("'set' must give at least one plan value")
        if keys & QUANT_KEYS and keys != QUANT_KEYS:
            raise ValueError(f"a quantization rule sets exactly {sorted(QUANT_KEYS)}, "
                             "and placement values go in a separate rule")
        return self


class PlanRule(BaseModel):
    """Dispatch-plan facts that depend on the chosen backend and dispatcher."""

    model_config = _STRICT

    id: str = Field(pattern=_ID)
    backends: Optional[list[str]] = None
    dispatchers: Optional[list[str]] = None
    when: Optional[str] = None
    set: PlanSet
    cite: Optional[str] = None


class RuleFile(BaseModel):
    """One YAML rule file."""

    model_config = _STRICT

    version: Literal[1] = 1
    description: str = ""
    packages: list[PackageDeclaration] = []
    backends: list[Backend] = []
    dispatchers: list[Dispatcher] = []
    constraints: list[Constraint] = []
    priorities: list[Priority] = []
    dispatch: list[DispatchRule] = []
    plan: list[PlanRule] = []
