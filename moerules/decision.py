"""`Decision`: the explained output of `decide`.

A Decision keeps "could not run" (rejections) apart from "ran second" (alternatives):
a reader debugging a slow layer wants the alternatives, one debugging a crash wants
the rejections. Field names are part of the JSON artifact format; change them only
with a format version bump.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moerules.config import MoEConfig

FORMAT_VERSION = 1
_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ReasonCode(str, Enum):
    """Why a backend (or dispatcher) was rejected. Closed: tests assert on these, never on message text."""

    vendor_unsupported = "vendor_unsupported"
    arch_unsupported = "arch_unsupported"
    package_missing = "package_missing"
    quant_unsupported = "quant_unsupported"
    dtype_unsupported = "dtype_unsupported"
    activation_unsupported = "activation_unsupported"
    routing_unsupported = "routing_unsupported"
    shape_unaligned = "shape_unaligned"
    parallel_unsupported = "parallel_unsupported"
    format_mismatch = "format_mismatch"
    expert_map_unsupported = "expert_map_unsupported"
    lora_unsupported = "lora_unsupported"
    bias_unsupported = "bias_unsupported"
    batch_invariance_unsupported = "batch_invariance_unsupported"
    not_in_priority = "not_in_priority"
    no_dispatcher = "no_dispatcher"
    no_eligible_backend = "no_eligible_backend"  # auto mode: every backend of the platform priority was rejected


class Outcome(str, Enum):
    selected = "selected"
    unsupported = "unsupported"


class SelectedBy(str, Enum):
    pinned = "pinned"        # the user named the backend and it was eligible
    auto = "auto"            # first eligible backend of the platform priority
    fallback = "fallback"    # auto, but a better-ranked backend was lost to a named fallback rule


class ActivationFormat(str, Enum):
    standard = "standard"
    batched = "batched"


class ExpertPlacement(str, Enum):
    """How global experts map onto EP ranks: blocks of E/ranks, or expert e on rank e % ranks."""

    contiguous = "contiguous"
    round_robin = "round_robin"


class QuantizedBy(str, Enum):
    none = "none"            # nothing to quantise: activations travel in the input dtype
    dispatcher = "dispatcher"  # prepare() quantises before the network / experts
    experts = "experts"      # the experts quantise internally (defer_input_quant)


class SourceRef(BaseModel):
    """Where a rule lives: a rules file and the line of its id."""

    model_config = _FROZEN
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


class Rejection(BaseModel):
    model_config = _FROZEN

    backend: str
    reason: ReasonCode
    detail: str = Field(min_length=1)
    rule: str
    source: SourceRef

    def describe(self) -> str:
        return f"{self.backend}: {self.reason.value} ({self.rule} at {self.source}): {self.detail}"


class RankStep(BaseModel):
    """One step of the platform priority that changed it: the base order, or a promote/demote that moved backends.

    `order` is the whole priority after the step, so a reader (and `explain`) can replay the ranking.
    """

    model_config = _FROZEN

    rule: str
    source: SourceRef
    action: Literal["order", "promote", "demote"]
    moved: tuple[str, ...] = Field(description="The backends the step placed: the whole list for a base order.")
    order: tuple[str, ...]
    cite: Optional[str] = None


class QuantPlacement(BaseModel):
    """Who quantises the activations, and what crosses the dispatcher."""

    model_config = _FROZEN

    quantized_by: QuantizedBy
    expects_unquantized_inputs: bool
    defer_input_quant: bool
    dispatch_dtype: str
    scale_dim: int = Field(ge=0)
    scale_type_size: int = Field(ge=0)
    weight_block: int = Field(0, ge=0, description="Weight scale block along K (0: no block); set before conversion.")
    rules: tuple[str, ...] = ()


class Padding(BaseModel):
    model_config = _FROZEN

    hidden_pad: int = Field(ge=0)
    intermediate_pad: int = Field(ge=0)
    hidden_padded: int
    intermediate_padded: int


class Decision(BaseModel):
    """Everything `decide` concluded for one config under one rule set."""

    model_config = _FROZEN

    format_version: int = FORMAT_VERSION
    outcome: Outcome
    backend: Optional[str] = None
    kernel: Optional[str] = None
    external_package: Optional[str] = None
    # Registry id of the adapter that runs the external backend through its package (None: build() refuses it).
    adapter: Optional[str] = None
    prepare_finalize: Optional[str] = None
    prepare_finalize_kernel: Optional[str] = None
    activation_format: Optional[ActivationFormat] = None
    monolithic: Optional[bool] = None
    quant: Optional[QuantPlacement] = None
    padding: Optional[Padding] = None
    expert_placement: Optional[ExpertPlacement] = None
    selected_by: Optional[SelectedBy] = None
    fallback_rule: Optional[str] = None
    requested: str = "auto"
    alternatives: tuple[str, ...] = ()
    # How the platform priority was built: the base order, then each promote/demote that moved something.
    ranking: tuple[RankStep, ...] = ()
    rejections: tuple[Rejection, ...] = ()
    error: Optional[str] = None
    failure_reason: Optional[ReasonCode] = None
    # An unsupported decision's closest candidate and what would make it eligible ("marlin: only package_missing - ...").
    nearest_miss: Optional[str] = None
    rules_hash: str
    engine: str
    # The rules that fired, phase by phase (screen, placement, quantization), each phase in rule-file order.
    trace: tuple[str, ...] = ()
    config: MoEConfig

    @model_validator(mode="after")
    def _outcome_is_consistent(self) -> "Decision":
        # Invalid states are unrepresentable: a selection has a backend and a plan,
        # a failure has a reason and no backend.
        if self.outcome == Outcome.selected:
            missing = [name for name in ("backend", "prepare_finalize", "activation_format", "quant",
                                         "padding", "expert_placement", "selected_by") if getattr(self, name) is None]
            if missing:
                raise ValueError(f"selected decision lacks {', '.join(missing)}")
            if (self.selected_by == SelectedBy.fallback) != (self.fallback_rule is not None):
                raise ValueError("fallback_rule is set exactly when selected_by is 'fallback'")
        elif self.backend is not None or not self.error or self.failure_reason is None:
            raise ValueError("an unsupported decision names no backend and carries an error and a failure_reason")
        return self

    def ranked_ahead(self) -> tuple[str, ...]:
        """The backends the final platform priority ranks above the winner (none without a winner in it)."""
        order = self.ranking[-1].order if self.ranking else ()
        return order[:order.index(self.backend)] if self.backend in order else ()

    def rejections_of(self, backend: str) -> tuple[Rejection, ...]:
        return tuple(r for r in self.rejections if r.backend == backend)

    def describe(self) -> str:
        """One log line that reads as a sentence."""
        if self.outcome == Outcome.unsupported:
            return f"moerules: no MoE backend for this layer: {self.error}"
        how = self.selected_by.value if self.fallback_rule is None else f"fallback via {self.fallback_rule}"
        alts = ", ".join(self.alternatives) or "none"
        return (f"moerules: {self.backend} experts ({how}) behind {self.prepare_finalize}, "
                f"{self.activation_format.value} format, activations quantised by {self.quant.quantized_by.value}; "
                f"{len(self.rejections)} rejections, alternatives: {alts} [rules {self.rules_hash[:12]}, {self.engine}]")

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)
