"""Expert weights of one MoE layer, their random construction, quantisation and padding.

Layout (logical sizes E experts, H hidden, I intermediate; N1 = 2I gated, I non-gated):
  w13 [E, N1, H]: gated: gate rows then up rows, or for `swigluoai` interleaved (gate0, up0, gate1, ...);
      non-gated (`*_no_mul` activations): I rows, the activation is applied elementwise.
  w2  [E, H, I]
  (packed fp4 weights, MXFP4: w13 [E, 2I, H/2] and w2 [E, H, I/2] uint8, two e2m1 values per byte along K)
  w13_bias [E, N1], w2_bias [E, H] in the layer's in_dtype (optional)
  w13_scale / w2_scale: weight scales in the layouts of `quantize.py`
  Our Triton experts rewrite MXFP4 w13/w2 at build into the MMA fragment order of fp4_fragments.py
  and their scales (`use_fragment_order`, same shapes); `in_checkpoint_order` reads them back as above.
  a13_scale / a2_scale: static per-tensor activation scales ([1]) for the static fp8 scheme.
  lora: optional per-expert LoRA adapters (`lora.py`), padded together with the weights.
  correction_bias: the router's e_score_correction_bias [E_global] fp32 (DeepSeek-V3, GLM-4-MoE), which
      steers expert selection only; it belongs to routing, so sharding and padding leave it whole.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from moerules.activation import Dtype
from moerules.errors import KernelInputError
from moerules.quant import Granularity, QuantConfig, QuantFamily

from . import fp4_fragments
from .lora import LoRAWeights
from .mx import E8M0_BIAS, E8M0_FOLD_MAX, MX_GROUP
from .qrange import FP8_MAX
from .quantize import quantize_weight
from .scheme import QUANT_BLOCK, TORCH_DTYPE, Scheme

# Static activation scales for the random layers below. Their inputs are unit-variance, so
# their amax over a few thousand tokens is ~4.5 and the gated intermediate stays under ~8;
# the reference quantises with the same scales, so a saturated value is still compared exactly.
RANDOM_STATIC_A13_SCALE = 5.0 / FP8_MAX
RANDOM_STATIC_A2_SCALE = 8.0 / FP8_MAX
# Experts quantised per call, to bound the fp32 temporaries on large layers (DeepSeek-V3: 22 GB in bf16).
_QUANT_CHUNK = 8


@dataclass
class MoEWeights:
    w13: torch.Tensor
    w2: torch.Tensor
    scheme: Scheme
    in_dtype: Dtype
    w13_bias: Optional[torch.Tensor] = None
    w2_bias: Optional[torch.Tensor] = None
    w13_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    a13_scale: Optional[torch.Tensor] = None
    a2_scale: Optional[torch.Tensor] = None
    # (hidden_pad, intermediate_pad) once `pad_weights` has run; guards against a second padding.
    padding: Optional[tuple[int, int]] = None
    # False for the non-gated `*_no_mul` activations: w13 then holds I rows, not 2I.
    gated: bool = True
    lora: Optional[LoRAWeights] = None
    # Checksum of the global weights a shard was cut from (`shard_weights` sets it): the ranks of an
    # expert-parallel group compare it at build, so shards of different weights never run together.
    origin: Optional[str] = None
    correction_bias: Optional[torch.Tensor] = None
    # MXFP4 weights whose scales are all at most mx.E8M0_FOLD_MAX (every real checkpoint's): the Triton decode
    # then takes one multiply per weight pair instead of two. Set once here, where the scales arrive (one
    # reduction per scale tensor); padding only adds scale 1 (E8M0_BIAS), which keeps it true.
    fp4_scales_fold: bool = field(init=False, default=False)
    # MXFP4 w13/w2 bytes in fp4_fragments' order (`use_fragment_order`, our Triton experts at build): None, or how
    # w13 is held (fp4_fragments.ROWS or PAIRS; w2 is ROWS). What decodes values reads `in_checkpoint_order`. An init
    # field, so that dataclasses.replace (sharding, tests) carries it with the tensors.
    fp4_fragment_order: Optional[str] = None

    def __post_init__(self):
        E, rows, _ = self.w13.shape
        I = rows // 2 if self.gated else rows
        if (self.gated and rows % 2) or self.w2.shape[:2] != (E, self.hidden) or self.intermediate != I:
            layout = "[E, 2I, H] / [E, H, I] pair (gated)" if self.gated else "[E, I, H] / [E, H, I] pair (non-gated)"
            packed = ", K packed two per byte" if self.scheme.k_pack > 1 else ""
            raise ValueError(f"w13 {tuple(self.w13.shape)} and w2 {tuple(self.w2.shape)} do not form a {layout}"
                             f"{packed}; gated={self.gated} must match the activation (the *_no_mul ones are "
                             "non-gated)")
        if (self.scheme.weight_dtype is None) != (self.w13_scale is None):
            raise ValueError(f"scheme {self.scheme.cell} and the presence of weight scales disagree")
        self._check_layout()
        self.check_lora()
        self.fp4_scales_fold = self.scheme.k_pack == 2 and all(
            s.numel() == 0 or int(s.max()) <= E8M0_FOLD_MAX for s in (self.w13_scale, self.w2_scale))

    def _check_layout(self) -> None:
        """Every tensor on w13's device with a unit-stride last dimension: the kernels step over the other
        dimensions by their strides but read along the last one contiguously (K for weights)."""
        for name in ("w13", "w2", "w13_bias", "w2_bias", "w13_scale", "w2_scale", "a13_scale", "a2_scale"):
            t = getattr(self, name)
            if t is None:
                continue
            if t.device != self.w13.device:
                raise KernelInputError(f"MoEWeights.{name} is on {t.device}, w13 on {self.w13.device}; put every "
                                       "tensor of a layer on one device")
            if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
                raise KernelInputError(f"MoEWeights.{name} {tuple(t.shape)} has strides {t.stride()}: its last "
                                       "dimension must be contiguous (stride 1) in the layout of this module's doc; "
                                       f"pass {name}.contiguous() (a transposed checkpoint tensor: transpose it "
                                       "into that layout, then .contiguous())")

    def check_lora(self, lora: Optional[LoRAWeights] = None) -> None:
        """Raise ValueError unless `lora` (default: the attached adapters, if any) fits these weights as they are."""
        lora = lora if lora is not None else self.lora
        if lora is not None:
            lora.check_matches(num_experts=self.num_experts, rows13=self.w13.shape[1], hidden=self.hidden,
                               intermediate=self.intermediate, dtype=TORCH_DTYPE[self.in_dtype], device=self.device)

    def use_fragment_order(self, *, interleaved: bool) -> None:
        """Rewrite MXFP4 w13, w2 and their scales, in place and once, in fp4_fragments' order (what the Triton GEMMs
        read).

        Each slab is permuted within itself, so shapes, strides and memory stay as they are. A gated w13 whose
        gate and up rows are halves needs I % 16 == 0 (each half whole slabs); `interleaved` (gate0, up0, ...)
        is held in PAIRS of 32 rows. MX sizes padded to whole groups of 32 (what build_layer does) always fit.
        """
        if self.scheme.k_pack != 2 or self.fp4_fragment_order:
            return
        pairs = interleaved and self.gated
        if self.gated and not pairs and self.intermediate % fp4_fragments.SLAB:
            raise KernelInputError(f"MXFP4 fragment order: gate and up halves of I={self.intermediate} rows are not "
                                   f"whole {fp4_fragments.SLAB}-row slabs; pad I to a multiple of 32 (MX groups)")
        try:
            w13 = fp4_fragments.to_fragment_order(self.w13, pairs=pairs)
            w2 = fp4_fragments.to_fragment_order(self.w2)
        except ValueError as exc:
            raise KernelInputError(f"MXFP4 w13 {tuple(self.w13.shape)} / w2 {tuple(self.w2.shape)}: {exc}; pad "
                                   "hidden and intermediate to multiples of 32 (MX groups)") from None
        self.w13.copy_(w13)
        self.w2.copy_(w2)
        self.w13_scale.copy_(fp4_fragments.scales_to_fragment_order(self.w13_scale, pairs=pairs))
        self.w2_scale.copy_(fp4_fragments.scales_to_fragment_order(self.w2_scale))
        self.fp4_fragment_order = fp4_fragments.PAIRS if pairs else fp4_fragments.ROWS

    def in_checkpoint_order(self, name: str) -> torch.Tensor:
        """w13, w2 or their scales in the layouts of this module's doc, whatever `use_fragment_order` did (a copy if
        it did)."""
        t = getattr(self, name)
        if not self.fp4_fragment_order:
            return t
        pairs = name.startswith("w13") and self.fp4_fragment_order == fp4_fragments.PAIRS
        if name.endswith("_scale"):
            return fp4_fragments.scales_to_checkpoint_order(t, pairs=pairs)
        return fp4_fragments.to_checkpoint_order(t, pairs=pairs)

    def checksum(self) -> str:
        """A digest of every weight, bias and scale byte (one pass over the weights, on their device)."""
        total = []
        for name in ("w13", "w2", "w13_bias", "w2_bias", "w13_scale", "w2_scale", "a13_scale", "a2_scale"):
            t = getattr(self, name)
            if t is not None:
                words = t.contiguous().view(torch.uint8).flatten()
                total.append(f"{name}:{tuple(t.shape)}:{_byte_digest(words)}")
        return hashlib.sha256(";".join(total).encode()).hexdigest()[:16]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        """Hidden size the kernels see (padded if `pad_weights` ran); logical, not the packed width."""
        return self.w13.shape[2] * self.scheme.k_pack

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2] * self.scheme.k_pack

    @property
    def has_bias(self) -> bool:
        return self.w13_bias is not None

    @property
    def device(self) -> torch.device:
        return self.w13.device


def _byte_digest(data: torch.Tensor) -> str:
    """Order-sensitive sums of a uint8 tensor, chunked so the int64 temporaries stay small."""
    plain, weighted = 0, 0
    for start in range(0, data.numel(), 1 << 24):
        chunk = data[start:start + (1 << 24)].to(torch.int64)
        position = torch.arange(start, start + chunk.numel(), device=chunk.device) % 65521 + 1
        plain += int(chunk.sum())
        weighted += int((chunk * position).sum())
    return f"{plain:x}.{weighted:x}"


def make_random_weights(*, num_experts: int, hidden: int, intermediate: int, quant: QuantConfig,
                        in_dtype: Dtype, has_bias: bool, seed: int, device, gated: bool = True,
                        correction_bias: bool = False) -> MoEWeights:
    """Seeded random weights (never zeros), quantised to `quant`; w13 has 2I rows, or I when not `gated`.

    Values are N(0, 1/K) so each GEMM output is O(1); biases and the router's correction bias (when
    asked) are N(0, 0.1^2). The same seed gives the same weights on the same device type.
    """
    dtype = TORCH_DTYPE[in_dtype]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, std):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    E, H, I = num_experts, hidden, intermediate
    rows13 = 2 * I if gated else I
    # Generate expert by chunk so fp32 temporaries stay small on 20 GB layers.
    w13 = torch.cat([randn(min(_QUANT_CHUNK, E - e), rows13, H, std=H ** -0.5) for e in range(0, E, _QUANT_CHUNK)])
    w2 = torch.cat([randn(min(_QUANT_CHUNK, E - e), H, I, std=I ** -0.5) for e in range(0, E, _QUANT_CHUNK)])
    weights = MoEWeights(w13=w13, w2=w2, scheme=Scheme(family=QuantFamily.unquantized), in_dtype=in_dtype,
                         w13_bias=randn(E, rows13, std=0.1) if has_bias else None,
                         w2_bias=randn(E, H, std=0.1) if has_bias else None, gated=gated,
                         correction_bias=randn(E, std=0.1).float() if correction_bias else None)
    return quantize_weights(weights, quant=quant)


def quantize_weights(weights: MoEWeights, *, quant: QuantConfig) -> MoEWeights:
    """Unquantised weights -> the scheme of `quant` (static scales per tensor/channel/block)."""
    scheme = Scheme.from_quant(quant)
    if weights.scheme.weight_dtype is not None:
        raise ValueError(f"weights are already quantised ({weights.scheme.cell}); quantize_weights takes "
                         "unquantised weights")
    if scheme.weight_dtype is None:
        return weights
    w13, s13 = _quantize_chunked(weights.w13, scheme)
    w2, s2 = _quantize_chunked(weights.w2, scheme)
    static = scheme.act_dtype is not None and not scheme.act_dynamic
    dev = weights.device
    return MoEWeights(w13=w13, w2=w2, scheme=scheme, in_dtype=weights.in_dtype,
                      w13_bias=weights.w13_bias, w2_bias=weights.w2_bias, w13_scale=s13, w2_scale=s2,
                      a13_scale=torch.tensor([RANDOM_STATIC_A13_SCALE], device=dev) if static else None,
                      a2_scale=torch.tensor([RANDOM_STATIC_A2_SCALE], device=dev) if static else None,
                      gated=weights.gated, lora=weights.lora, correction_bias=weights.correction_bias)


def _quantize_chunked(w: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [quantize_weight(w[e:e + _QUANT_CHUNK], dtype=scheme.weight_torch_dtype,
                             granularity=scheme.weight_granularity) for e in range(0, w.shape[0], _QUANT_CHUNK)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def pad_weights(weights: MoEWeights, *, hidden_pad: int, intermediate_pad: int, interleaved: bool) -> MoEWeights:
    """Zero-pad H by `hidden_pad` and I by `intermediate_pad`, in place, LoRA adapters included. Idempotent.

    Padding is exact: padded inputs/rows are zero, every supported activation maps a zero
    (gate, up) pair, or a zero pre-activation when non-gated, to zero, padded scales are 1 and
    padded biases and adapter rows/columns 0. The `padding` flag makes a second call with the
    same pads a no-op and one with other pads an error, so a layer built twice on one weights
    object cannot pad twice.
    """
    pads = (hidden_pad, intermediate_pad)
    if weights.padding is not None:
        if weights.padding != pads:
            raise ValueError(f"weights were already padded by {weights.padding} (hidden, intermediate); "
                             f"cannot pad again by {pads}")
        return weights
    if min(pads) < 0:
        raise ValueError(f"pads must be >= 0, got {pads}")
    scheme = weights.scheme
    gran = scheme.weight_granularity
    I = weights.intermediate
    layout = _row_layout(gated=weights.gated, interleaved=interleaved)
    # [gate | up] halves: the up half moves from row I to row I + intermediate_pad. Its rows keep their
    # 128-row scale blocks only if both are multiples of 128 (else gate and up rows share a scale).
    if gran == Granularity.block128 and intermediate_pad and layout == _HALVES and (
            I % QUANT_BLOCK or intermediate_pad % QUANT_BLOCK):
        raise ValueError(f"block128 weights with intermediate {I} cannot be padded by {intermediate_pad}: the up "
                         f"half would move from row {I} to row {I + intermediate_pad} and straddle a "
                         f"{QUANT_BLOCK}-row scale block (both must be multiples of {QUANT_BLOCK})")
    pack = scheme.k_pack
    if hidden_pad % pack or intermediate_pad % pack:
        raise ValueError(f"packed fp4 weights hold {pack} values per byte along K; hidden_pad and intermediate_pad "
                         f"must be multiples of {pack}, got {pads}")
    H = weights.hidden
    hp, ip = pads
    weights.w13 = _pad_rows(weights.w13, ip, layout, 0.0, dim=1)
    weights.w13 = _pad_dim(weights.w13, 2, hp // pack, 0.0)
    weights.w2 = _pad_dim(_pad_dim(weights.w2, 1, hp, 0.0), 2, ip // pack, 0.0)
    if weights.has_bias:
        weights.w13_bias = _pad_rows(weights.w13_bias, ip, layout, 0.0, dim=1)
        weights.w2_bias = _pad_dim(weights.w2_bias, 1, hp, 0.0)
    if gran == Granularity.channel:
        weights.w13_scale = _pad_rows(weights.w13_scale, ip, layout, 1.0, dim=1)
        weights.w2_scale = _pad_dim(weights.w2_scale, 1, hp, 1.0)
    elif gran == Granularity.block128:
        weights.w13_scale = _pad_blocks(weights.w13_scale, weights.w13.shape[1:], layout)
        weights.w2_scale = _pad_blocks(weights.w2_scale, weights.w2.shape[1:], _AT_END)
    elif scheme.is_mx:
        weights.w13_scale = _pad_rows(_pad_mx_groups(weights.w13_scale, H, hp), ip, layout, E8M0_BIAS, dim=1)
        weights.w2_scale = _pad_dim(_pad_mx_groups(weights.w2_scale, I, ip), 1, hp, E8M0_BIAS)
    if weights.lora is not None:
        weights.lora = pad_lora(weights.lora, hidden_pad=hp, intermediate_pad=ip, gated=weights.gated,
                                interleaved=interleaved)
    weights.padding = pads
    return weights


def pad_lora(lora: LoRAWeights, *, hidden_pad: int, intermediate_pad: int, gated: bool,
             interleaved: bool) -> LoRAWeights:
    """Adapters padded as `pad_weights` pads their base weights: A columns and B rows, with zeros."""
    hp, ip = hidden_pad, intermediate_pad
    return LoRAWeights(w13_lora_a=_pad_dim(lora.w13_lora_a, 2, hp, 0.0),
                       w13_lora_b=_pad_rows(lora.w13_lora_b, ip, _row_layout(gated=gated, interleaved=interleaved),
                                            0.0, dim=1),
                       w2_lora_a=_pad_dim(lora.w2_lora_a, 2, ip, 0.0), w2_lora_b=_pad_dim(lora.w2_lora_b, 1, hp, 0.0),
                       scaling=lora.scaling)


# Row layouts of w13-like tensors (w13, its bias, channel/block scales, LoRA B): where I-padding goes.
_HALVES = "halves"            # gated [gate | up]: each half grows by the pad
_INTERLEAVED = "interleaved"  # gated (g0, u0, g1, u1, ...): 2 * pad rows at the end
_AT_END = "at_end"            # non-gated (and w2's rows): pad rows at the end


def _row_layout(*, gated: bool, interleaved: bool) -> str:
    if not gated:
        return _AT_END
    return _INTERLEAVED if interleaved else _HALVES


def _pad_dim(t: torch.Tensor, dim: int, pad: int, value: float) -> torch.Tensor:
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=dim).contiguous()


def _pad_rows(t: torch.Tensor, pad: int, layout: str, value: float, *, dim: int) -> torch.Tensor:
    """Pad the N1 rows of a w13-like tensor by `pad` intermediate units, as `layout` places them."""
    if layout == _AT_END or not pad:
        return _pad_dim(t, dim, pad, value)
    if layout == _INTERLEAVED:
        return _pad_dim(t, dim, 2 * pad, value)
    gate, up = t.chunk(2, dim=dim)
    return torch.cat([_pad_dim(gate, dim, pad, value), _pad_dim(up, dim, pad, value)], dim=dim).contiguous()


def _pad_blocks(scale: torch.Tensor, padded_nk: torch.Size, layout: str) -> torch.Tensor:
    """Grow a [E, N/128, K/128] block-scale tensor to cover the padded [N, K] with ones."""
    nb, kb = (-(-d // QUANT_BLOCK) for d in padded_nk)
    scale = _pad_dim(scale, 2, kb - scale.shape[2], 1.0)
    if layout == _HALVES:
        return _pad_rows(scale, (nb - scale.shape[1]) // 2, _HALVES, 1.0, dim=1)
    return _pad_dim(scale, 1, nb - scale.shape[1], 1.0)


def _pad_mx_groups(scale: torch.Tensor, k: int, k_pad: int) -> torch.Tensor:
    """Grow a [E, N, ceil(K/32)] e8m0 tensor to cover K + k_pad with scales 2^0 (biased 127).

    The padded elements are zero, so any scale is exact; 1.0 keeps them plain. Zeros appended
    to a partial last group keep that group's scale, which is just as exact.
    """
    return _pad_dim(scale, 2, -(-(k + k_pad) // MX_GROUP) - scale.shape[2], E8M0_BIAS)
