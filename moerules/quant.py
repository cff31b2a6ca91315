"""Quantisation vocabulary: scheme families and the (weight, activation) keys they imply.

The keys are what rules compare; the family is what people type. A family fixes the
dtypes and, unless the config states them, the scale granularity. Keys are closed,
frozen records so that rules can only ask about things declared here.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class QuantDtype(str, Enum):
    """Element type of a quantised tensor."""

    fp8_e4m3 = "fp8_e4m3"
    int8 = "int8"
    fp4_e2m1 = "fp4_e2m1"
    int4 = "int4"


class Granularity(str, Enum):
    """Which elements share one scale.

    `block128` is a 128x128 weight tile (DeepSeek style); `group128` is a 1x128 slice
    along K of an activation row; `group32`/`group16` are the MX/NV micro-blocks.
    """

    tensor = "tensor"
    channel = "channel"
    token = "token"
    block128 = "block128"
    group128 = "group128"
    group32 = "group32"
    group16 = "group16"


class ScaleDtype(str, Enum):
    fp32 = "fp32"
    e8m0 = "e8m0"
    fp8_e4m3 = "fp8_e4m3"


class QuantFamily(str, Enum):
    """The named schemes of the reference, each with fixed weight/activation dtypes."""

    unquantized = "unquantized"
    fp8_w8a8 = "fp8_w8a8"
    fp8_w8a16 = "fp8_w8a16"
    int8_w8a8 = "int8_w8a8"
    int8_w8a16 = "int8_w8a16"
    mxfp4_w4a16 = "mxfp4_w4a16"
    mxfp4_w4a4 = "mxfp4_w4a4"
    mxfp4_w4a8 = "mxfp4_w4a8"
    mxfp8 = "mxfp8"
    nvfp4 = "nvfp4"
    wna16 = "wna16"
    w4a8 = "w4a8"


class QuantKey(BaseModel):
    """How one operand is quantised: dtype, scale granularity, static or dynamic, scale dtype."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: QuantDtype
    granularity: Granularity
    dynamic: bool = False
    scale_dtype: ScaleDtype = ScaleDtype.fp32


def _key(dtype: QuantDtype, gran: Granularity, dynamic: bool = False,
         scale: ScaleDtype = ScaleDtype.fp32) -> QuantKey:
    return QuantKey(dtype=dtype, granularity=gran, dynamic=dynamic, scale_dtype=scale)


F8, I8, F4, I4 = QuantDtype.fp8_e4m3, QuantDtype.int8, QuantDtype.fp4_e2m1, QuantDtype.int4
G = Granularity

# Default keys per family, and the granularities a config may choose instead.
# (weight default, activation default or None for weight-only schemes)
FAMILY_DEFAULTS: dict[QuantFamily, tuple[Optional[QuantKey], Optional[QuantKey]]] = {
    QuantFamily.unquantized: (None, None),
    QuantFamily.fp8_w8a8: (_key(F8, G.tensor), _key(F8, G.tensor, dynamic=True)),
    QuantFamily.fp8_w8a16: (_key(F8, G.channel), None),
    QuantFamily.int8_w8a8: (_key(I8, G.channel), _key(I8, G.token, dynamic=True)),
    QuantFamily.int8_w8a16: (_key(I8, G.channel), None),
    QuantFamily.mxfp4_w4a16: (_key(F4, G.group32, scale=ScaleDtype.e8m0), None),
    QuantFamily.mxfp4_w4a4: (_key(F4, G.group32, scale=ScaleDtype.e8m0),
                             _key(F4, G.group32, dynamic=True, scale=ScaleDtype.e8m0)),
    QuantFamily.mxfp4_w4a8: (_key(F4, G.group32, scale=ScaleDtype.e8m0),
                             _key(F8, G.group32, dynamic=True, scale=ScaleDtype.e8m0)),
    QuantFamily.mxfp8: (_key(F8, G.group32, scale=ScaleDtype.e8m0),
                        _key(F8, G.group32, dynamic=True, scale=ScaleDtype.e8m0)),
    QuantFamily.nvfp4: (_key(F4, G.group16, scale=ScaleDtype.fp8_e4m3),
                        _key(F4, G.group16, dynamic=True, scale=ScaleDtype.fp8_e4m3)),
    QuantFamily.wna16: (_key(I4, G.group128), None),
    QuantFamily.w4a8: (_key(I4, G.group128), _key(F8, G.token, dynamic=True)),
}

ALLOWED_GRANULARITY: dict[QuantFamily, tuple[set[Granularity], set[Granularity]]] = {
    QuantFamily.fp8_w8a8: ({G.tensor, G.channel, G.block128}, {G.tensor, G.token, G.group128}),
    QuantFamily.fp8_w8a16: ({G.tensor, G.channel, G.block128}, set()),
    QuantFamily.int8_w8a8: ({G.channel}, {G.token}),
    QuantFamily.int8_w8a16: ({G.channel}, set()),
    QuantFamily.wna16: ({G.group128, G.group32, G.channel}, set()),
}


class Checkpoint(str, Enum):
    """Which quantisation method produced the checkpoint: vLLM's method decides which keys reach
    the kernel oracle and whether vLLM's CUTLASS FP8 kernel may serve it (`allow_vllm_cutlass`)."""

    native = "native"                          # quant_method fp8 / mxfp4 / gptq ... (vLLM's own loader)
    compressed_tensors = "compressed_tensors"
    modelopt = "modelopt"
    quark = "quark"


class QuantConfig(BaseModel):
    """A family plus optional granularity choices; the keys are derived, never typed twice."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: QuantFamily = Field(QuantFamily.unquantized, description="Quantisation scheme of the experts' weights "
                                                                     "and activations.")
    checkpoint: Checkpoint = Field(Checkpoint.native, description="Quantisation method that produced the "
                                                                   "checkpoint (its vLLM loader decides the keys).")
    weight_granularity: Optional[Granularity] = Field(None, description="Weight scale granularity (default: the "
                                                                        "family's).")
    activation_granularity: Optional[Granularity] = Field(None, description="Activation scale granularity "
                                                                            "(default: the family's).")
    activation_dynamic: bool = Field(True, description="Activation scales computed at run time (False: static, "
                                                       "from the checkpoint).")

    @model_validator(mode="after")
    def _granularity_allowed(self) -> "QuantConfig":
        weights_ok, acts_ok = ALLOWED_GRANULARITY.get(self.family, (set(), set()))
        for field, value, ok in (("weight_granularity", self.weight_granularity, weights_ok),
                                 ("activation_granularity", self.activation_granularity, acts_ok)):
            if value is not None and value not in ok:
                allowed = ", ".join(sorted(g.value for g in ok)) or "none (fixed by the family)"
                raise ValueError(f"{field}={value.value!r} is not valid for family "
                                 f"{self.family.value!r}; allowed: {allowed}")
        return self

    @property
    def weight_key(self) -> Optional[QuantKey]:
        default = FAMILY_DEFAULTS[self.family][0]
        if default is None or self.weight_granularity is None:
            return default
        return default.model_copy(update={"granularity": self.weight_granularity})

    @property
    def activation_key(self) -> Optional[QuantKey]:
        default = FAMILY_DEFAULTS[self.family][1]
        if default is None:
            return None
        granularity = self.activation_granularity or _paired_activation_granularity(
            self.weight_granularity, default.granularity)
        # Only a per-tensor scale can be calibrated ahead of time; every finer one is dynamic.
        dynamic = self.activation_dynamic or granularity != G.tensor
        return default.model_copy(update={"granularity": granularity, "dynamic": dynamic})


def _paired_activation_granularity(weight: Optional[Granularity], default: Granularity) -> Granularity:
    """The activation granularity that conventionally pairs with a chosen weight granularity."""
    if weight == G.block128:
        return G.group128
    if weight == G.channel and default == G.tensor:
        return G.token
    return default
