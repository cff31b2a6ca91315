"""The numeric scheme a kernel implements, resolved once from a `QuantConfig`.

`QuantConfig` is what rules talk about (families, keys). Kernels need something
narrower: which dtype the weights hold and how their scales are laid out, and how (or
whether) activations are quantised. `Scheme` is that record; it is hashable so it can
key registries and config files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moerules.activation import Dtype
from moerules.quant import ALLOWED_GRANULARITY, Granularity, QuantConfig, QuantDtype, QuantFamily

from .mx import FP4_STORAGE, MX_GROUP

# Block size of DeepSeek-style scales: 128x128 weight tiles, 1x128 activation groups.
QUANT_BLOCK = 128

TORCH_DTYPE = {Dtype.bf16: torch.bfloat16, Dtype.fp16: torch.float16, Dtype.fp32: torch.float32}
# Storage dtype of quantised tensors; fp4 e2m1 is stored two per byte along K (see mx.py).
QUANT_TORCH_DTYPE = {QuantDtype.fp8_e4m3: torch.float8_e4m3fn, QuantDtype.int8: torch.int8,
                     QuantDtype.fp4_e2m1: FP4_STORAGE}
# Scale elements per K-block of the weights, by weight granularity (0: the scale does not change along K).
K_BLOCK = {Granularity.block128: QUANT_BLOCK, Granularity.group32: MX_GROUP}

# Families the kernels in this package implement; the rest (NVFP4, MXFP4 W4A4/W4A8, int4) are not here yet.
IMPLEMENTED_FAMILIES = frozenset({QuantFamily.unquantized, QuantFamily.fp8_w8a8, QuantFamily.fp8_w8a16,
                                  QuantFamily.int8_w8a8, QuantFamily.int8_w8a16, QuantFamily.mxfp4_w4a16,
                                  QuantFamily.mxfp8})


class UnsupportedScheme(ValueError):
    """The quant config names a family or granularity no kernel here implements."""


@dataclass(frozen=True)
class Scheme:
    """Weight and activation quantisation as the kernels see it.

    weight_dtype None means unquantised weights (they are in the layer's in_dtype).
    act_dtype None means activations stay in in_dtype (unquantised or weight-only).
    """

    family: QuantFamily
    weight_dtype: Optional[QuantDtype] = None
    weight_granularity: Optional[Granularity] = None
    act_dtype: Optional[QuantDtype] = None
    act_granularity: Optional[Granularity] = None
    act_dynamic: bool = True

    @classmethod
    def from_quant(cls, quant: QuantConfig) -> "Scheme":
        if quant.family not in IMPLEMENTED_FAMILIES:
            raise UnsupportedScheme(f"quant family {quant.family.value!r} has no kernel in moerules.kernels "
                                    f"yet (implemented: {', '.join(sorted(f.value for f in IMPLEMENTED_FAMILIES))})")
        wk, ak = quant.weight_key, quant.activation_key
        return cls(family=quant.family,
                   weight_dtype=wk.dtype if wk else None,
                   weight_granularity=wk.granularity if wk else None,
                   act_dtype=ak.dtype if ak else None,
                   act_granularity=ak.granularity if ak else None,
                   act_dynamic=ak.dynamic if ak else True)

    @property
    def cell(self) -> str:
        """Stable name of the scheme cell, e.g. 'fp8_w8a8/block128/group128' or 'unquantized'."""
        if self.weight_dtype is None:
            return self.family.value
        parts = [self.family.value, self.weight_granularity.value]
        if self.act_dtype is not None:
            parts.append(self.act_granularity.value + ("" if self.act_dynamic else "-static"))
        return "/".join(parts)

    @property
    def weight_torch_dtype(self) -> Optional[torch.dtype]:
        return QUANT_TORCH_DTYPE[self.weight_dtype] if self.weight_dtype else None

    @property
    def act_torch_dtype(self) -> Optional[torch.dtype]:
        return QUANT_TORCH_DTYPE[self.act_dtype] if self.act_dtype else None

    @property
    def quantizes_activations(self) -> bool:
        return self.act_dtype is not None

    @property
    def weight_k_block(self) -> int:
        """K extent of one weight scale (128 for block128, 32 for MX), 0 when the scale is constant along K."""
        return K_BLOCK.get(self.weight_granularity, 0)

    @property
    def is_mx(self) -> bool:
        """OCP MX weights: e8m0 scales per 1x32 group along K (activations too when quantised)."""
        return self.weight_granularity == Granularity.group32

    @property
    def k_pack(self) -> int:
        """Weight elements per stored element along K: 2 for packed fp4, else 1."""
        return 2 if self.weight_dtype == QuantDtype.fp4_e2m1 else 1


def scheme_cells() -> dict[str, Scheme]:
    """Every scheme cell implemented here, by cell name (used by the registry and tests)."""
    G, F = Granularity, QuantFamily
    configs = [QuantConfig(family=F.unquantized)]
    # Per-tensor and per-channel weight scales combine with any per-tensor or per-token
    # activation scale: each factors out of the K sum, so the kernels treat them alike.
    for w in (G.tensor, G.channel):
        configs += [QuantConfig(family=F.fp8_w8a8, weight_granularity=w, activation_granularity=G.tensor),
                    QuantConfig(family=F.fp8_w8a8, weight_granularity=w, activation_granularity=G.tensor,
                                activation_dynamic=False),
                    QuantConfig(family=F.fp8_w8a8, weight_granularity=w, activation_granularity=G.token)]
    configs += [QuantConfig(family=F.fp8_w8a8, weight_granularity=G.block128, activation_granularity=G.group128),
                QuantConfig(family=F.int8_w8a8)]
    configs += [QuantConfig(family=F.fp8_w8a16, weight_granularity=w) for w in (G.tensor, G.channel, G.block128)]
    configs += [QuantConfig(family=F.int8_w8a16), QuantConfig(family=F.mxfp4_w4a16), QuantConfig(family=F.mxfp8)]
    return {s.cell: s for s in map(Scheme.from_quant, configs)}


def quant_for_cell(cell: str) -> QuantConfig:
    """The QuantConfig whose scheme is `cell` (a key of `scheme_cells()`), for tests and benchmarks."""
    s = scheme_cells()[cell]
    if s.family not in ALLOWED_GRANULARITY:  # the family fixes its keys (unquantized, MX)
        return QuantConfig(family=s.family)
    return QuantConfig(family=s.family, weight_granularity=s.weight_granularity,
                       activation_granularity=s.act_granularity, activation_dynamic=s.act_dynamic)
