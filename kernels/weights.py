"""Expert weights of one MoE layer, their random construction, quantisation and padding.

Layout (logical sizes E experts, H hidden, I intermediate):
  w13 [E, 2I, H]: gate rows then up rows; for `swigluoai` the rows interleave (gate0, up0, gate1, ...).
  w2  [E, H, I]
  (packed fp4 weights, MXFP4: w13 [E, 2I, H/2] and w2 [E, H, I/2] uint8, two e2m1 values per byte along K)
  w13_bias [E, 2I], w2_bias [E, H] in the layer's in_dtype (optional)
  w13_scale / w2_scale: weight scales in the layouts of `quantize.py`
  a13_scale / a2_scale: static per-tensor activation scales ([1]) for the static fp8 scheme.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moerules.activation import Dtype
from moerules.quant import Granularity, QuantConfig, QuantFamily

from .mx import E8M0_BIAS, MX_GROUP
from .quantize import FP8_MAX, quantize_weight
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

    def __post_init__(self):
        E, two_i, _ = self.w13.shape
        if two_i % 2 or self.w2.shape[:2] != (E, self.hidden) or self.intermediate * 2 != two_i:
            packed = " (K packed two per byte)" if self.scheme.k_pack > 1 else ""
            raise ValueError(f"w13 {tuple(self.w13.shape)} and w2 {tuple(self.w2.shape)} do not form a "
                             f"[E, 2I, H] / [E, H, I] pair{packed}")
        if (self.scheme.weight_dtype is None) != (self.w13_scale is None):
            raise ValueError(f"scheme {self.scheme.cell} and the presence of weight scales disagree")

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


def make_random_weights(*, num_experts: int, hidden: int, intermediate: int, quant: QuantConfig,
                        in_dtype: Dtype, has_bias: bool, seed: int, device) -> MoEWeights:
    """Seeded random weights (never zeros), quantised to `quant`.

    Values are N(0, 1/K) so each GEMM output is O(1); biases are N(0, 0.1^2). The same seed
    gives the same weights on the same device type.
    """
    dtype = TORCH_DTYPE[in_dtype]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, std):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    E, H, I = num_experts, hidden, intermediate
    # Generate expert by chunk so fp32 temporaries stay small on 20 GB layers.
    w13 = torch.cat([randn(min(_QUANT_CHUNK, E - e), 2 * I, H, std=H ** -0.5) for e in range(0, E, _QUANT_CHUNK)])
    w2 = torch.cat([randn(min(_QUANT_CHUNK, E - e), H, I, std=I ** -0.5) for e in range(0, E, _QUANT_CHUNK)])
    weights = MoEWeights(w13=w13, w2=w2, scheme=Scheme(family=QuantFamily.unquantized), in_dtype=in_dtype,
                         w13_bias=randn(E, 2 * I, std=0.1) if has_bias else None,
                         w2_bias=randn(E, H, std=0.1) if has_bias else None)
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
                      a2_scale=torch.tensor([RANDOM_STATIC_A2_SCALE], device=dev) if static else None)


def _quantize_chunked(w: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [quantize_weight(w[e:e + _QUANT_CHUNK], dtype=scheme.weight_torch_dtype,
                             granularity=scheme.weight_granularity) for e in range(0, w.shape[0], _QUANT_CHUNK)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def pad_weights(weights: MoEWeights, *, hidden_pad: int, intermediate_pad: int, interleaved: bool) -> MoEWeights:
    """Zero-pad H by `hidden_pad` and I by `intermediate_pad`, in place. Idempotent.

    Padding is exact: padded inputs/rows are zero, every supported activation maps a zero
    (gate, up) pair to zero, padded scales are 1 and padded biases 0. The `padding` flag
    makes a second call with the same pads a no-op and one with other pads an error, so a
    layer built twice on one weights object cannot pad twice.
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
    if gran == Granularity.block128 and intermediate_pad and not interleaved and I % QUANT_BLOCK:
        raise ValueError(f"block128 weights with intermediate {I} (not a multiple of {QUANT_BLOCK}) cannot be "
                         "padded: the up half would straddle a scale block")
    pack = scheme.k_pack
    if hidden_pad % pack or intermediate_pad % pack:
        raise ValueError(f"packed fp4 weights hold {pack} values per byte along K; hidden_pad and intermediate_pad "
                         f"must be multiples of {pack}, got {pads}")
    H = weights.hidden
    hp, ip = pads
    weights.w13 = _pad_rows(weights.w13, ip, interleaved, 0.0, dim=1)
    weights.w13 = _pad_dim(weights.w13, 2, hp // pack, 0.0)
    weights.w2 = _pad_dim(_pad_dim(weights.w2, 1, hp, 0.0), 2, ip // pack, 0.0)
    if weights.has_bias:
        weights.w13_bias = _pad_rows(weights.w13_bias, ip, interleaved, 0.0, dim=1)
        weights.w2_bias = _pad_dim(weights.w2_bias, 1, hp, 0.0)
    if gran == Granularity.channel:
        weights.w13_scale = _pad_rows(weights.w13_scale, ip, interleaved, 1.0, dim=1)
        weights.w2_scale = _pad_dim(weights.w2_scale, 1, hp, 1.0)
    elif gran == Granularity.block128:
        weights.w13_scale = _pad_blocks(weights.w13_scale, weights.w13.shape[1:], interleaved)
        weights.w2_scale = _pad_blocks(weights.w2_scale, weights.w2.shape[1:], True)
    elif scheme.is_mx:
        weights.w13_scale = _pad_rows(_pad_mx_groups(weights.w13_scale, H, hp), ip, interleaved, E8M0_BIAS, dim=1)
        weights.w2_scale = _pad_dim(_pad_mx_groups(weights.w2_scale, I, ip), 1, hp, E8M0_BIAS)
    weights.padding = pads
    return weights


def _pad_dim(t: torch.Tensor, dim: int, pad: int, value: float) -> torch.Tensor:
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=dim).contiguous()


def _pad_rows(t: torch.Tensor, pad: int, interleaved: bool, value: float, *, dim: int) -> torch.Tensor:
    """Pad the 2I rows of w13-like tensors: at the end when interleaved, else each half."""
    if interleaved or not pad:
        return _pad_dim(t, dim, 2 * pad, value)
    gate, up = t.chunk(2, dim=dim)
    return torch.cat([_pad_dim(gate, dim, pad, value), _pad_dim(up, dim, pad, value)], dim=dim).contiguous()


def _pad_blocks(scale: torch.Tensor, padded_nk: torch.Size, pad_at_end: bool) -> torch.Tensor:
    """Grow a [E, N/128, K/128] block-scale tensor to cover the padded [N, K] with ones."""
    nb, kb = (-(-d // QUANT_BLOCK) for d in padded_nk)
    scale = _pad_dim(scale, 2, kb - scale.shape[2], 1.0)
    if pad_at_end:
        return _pad_dim(scale, 1, nb - scale.shape[1], 1.0)
    return _pad_rows(scale, (nb - scale.shape[1]) // 2, False, 1.0, dim=1)


def _pad_mx_groups(scale: torch.Tensor, k: int, k_pad: int) -> torch.Tensor:
    """Grow a [E, N, ceil(K/32)] e8m0 tensor to cover K + k_pad with scales 2^0 (biased 127).

    The padded elements are zero, so any scale is exact; 1.0 keeps them plain. Zeros appended
    to a partial last group keep that group's scale, which is just as exact.
    """
    return _pad_dim(scale, 2, -(-(k + k_pad) // MX_GROUP) - scale.shape[2], E8M0_BIAS)
