"""OCP MX (micro-scaled) formats: e8m0 group scales, fp4 e2m1 elements and their nibble packing.

An MX tensor [..., K] stores one shared power-of-two scale per group of 32 consecutive
elements along K (`MX_GROUP`); dequantised value = element * 2^(scale - 127).

e8m0 scale: one uint8, the biased exponent of the scale (bias 127), no sign or mantissa.
    The shared exponent follows the OCP MX v1.0 rule: X = floor(log2(amax)) - emax_elem, where
    emax_elem is the exponent of the element type's largest normal (2 for e2m1: 6 = 1.5*2^2; 8 for
    e4m3: 448 = 1.75*2^8). floor(log2) is taken exactly from the fp32 exponent bits (frexp), never
    from a rounded log. With that rule amax / 2^X lies in [2^emax, 2^(emax+1)), so the top of a
    group can exceed the element maximum (up to 8 > 6 for e2m1, up to 512 > 448 for e4m3): those
    elements saturate to the maximum (OCP leaves this implementation-defined; saturation is what
    every MX kernel does). An all-zero group gets the exponent 127 (scale 1). Exponents are clamped
    to [1, 254]: 0 would be a subnormal scale and 255 is NaN in e8m0; finite fp32 data never reaches
    the top, and the bottom only affects groups whose amax is below 2^-118.
e2m1 element: 4 bits s|ee|m, values {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign. The code of a
    magnitude is its index in that list (e*2 + m). Rounding is round-to-nearest, ties to the even
    code (ties go to m = 0: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), then saturation at 6. A value
    that rounds to zero is stored as +0.
Packing: two e2m1 codes per uint8 along K: the low nibble holds the even k, the high nibble the
    odd k (byte j = code[2j] | code[2j+1] << 4). K must be even; the packed tensor is [..., K/2].
MX e4m3 elements are stored as torch.float8_e4m3fn (cast with round-to-nearest-even after
    saturating at +-448).

A K that is not a multiple of 32 ends in a partial group (its missing elements count as zeros
for the amax). The scale tensor is then [..., ceil(K/32)]. Zero-padding K later is exact: the
appended zeros fall into that same group, or into new groups of any scale.
"""

from __future__ import annotations

import torch

MX_GROUP = 32
E8M0_BIAS = 127
E8M0_MIN, E8M0_MAX = 1, 254
# The largest scale byte whose 2^(s - 127) times 2^126 is a finite bf16 (exponent at most 127): a scale of 2^1,
# reached by groups with amax below 16. Up to it the Triton MXFP4 decode folds its 2^126 into the scale.
E8M0_FOLD_MAX = 128
E2M1_EMAX = 2
E4M3_EMAX = 8
E2M1_MAX = 6.0
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
# Magnitude of each e2m1 code 0..7 (code = 2*exponent + mantissa); codes 8..15 are the negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Weights in packed e2m1 are stored as uint8 (torch has no usable fp4 dtype on every device).
FP4_STORAGE = torch.uint8


def e8m0_encode(amax: torch.Tensor, *, emax: int) -> torch.Tensor:
    """Group amax (>= 0) -> uint8 biased exponent of 2^(floor(log2 amax) - emax) (module doc rule)."""
    amax = amax.float()
    _, exp = torch.frexp(amax)                       # amax = m * 2^exp, m in [0.5, 1): floor(log2) = exp - 1
    biased = (exp.to(torch.int32) - 1 - emax + E8M0_BIAS).clamp(E8M0_MIN, E8M0_MAX)
    return torch.where(amax > 0, biased, torch.full_like(biased, E8M0_BIAS)).to(torch.uint8)


def e8m0_decode(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 biased exponents -> 2^(s - 127), exact (fp32 holds every power of two from 2^-149)."""
    exp = scale.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(torch.ones_like(exp, dtype=torch.float64), exp).to(dtype)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Values already divided by their scale -> uint8 e2m1 codes (RNE onto the grid, saturating)."""
    mag = y.float().abs()
    # The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 from 4: round in units of the local spacing
    # (torch.round is half-to-even, and the even multiples are exactly the codes with m = 0).
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    q = (torch.round(mag / step) * step).clamp(max=E2M1_MAX)
    # q*2 is one of 0,1,2,3,4,6,8,12: map it to the code (index in E2M1_VALUES).
    lut = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8, device=y.device)
    code = lut[(q * 2).long()]
    negative = (y < 0) & (code != 0)
    return code | (negative.to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 e2m1 codes (0..15) -> values."""
    values = torch.tensor(E2M1_VALUES, dtype=dtype, device=code.device)
    mag = values[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def pack_fp4(code: torch.Tensor) -> torch.Tensor:
    """[..., K] e2m1 codes -> [..., K/2] bytes, low nibble = even k, high nibble = odd k."""
    if code.shape[-1] % 2:
        raise ValueError(f"packing e2m1 needs an even K (two values per byte), got K={code.shape[-1]}")
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] e2m1 codes (inverse of pack_fp4)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _groups(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., ceil(K/32), 32], zero padded (zeros never raise a group's amax)."""
    pad = (-x.shape[-1]) % MX_GROUP
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], x.shape[-1] // MX_GROUP, MX_GROUP)


def _ungroup(g: torch.Tensor, k: int) -> torch.Tensor:
    return g.reshape(*g.shape[:-2], g.shape[-2] * g.shape[-1])[..., :k]


def quantize_mx(x: torch.Tensor, *, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (elements, e8m0 scales [..., ceil(K/32)] uint8).

    fp4: elements are packed e2m1 pairs [..., K/2] uint8; else float8_e4m3fn [..., K].
    """
    k = x.shape[-1]
    if fp4 and k % 2:
        raise ValueError(f"MXFP4 needs an even K (two values per byte), got K={k}")
    g = _groups(x.float())
    scale = e8m0_encode(g.abs().amax(dim=-1), emax=E2M1_EMAX if fp4 else E4M3_EMAX)
    y = g * e8m0_decode(scale, torch.float32).reciprocal()[..., None]   # exact: a power of two
    if fp4:
        return pack_fp4(_ungroup(e2m1_encode(y), k)), scale
    return _ungroup(y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), k).contiguous(), scale


def dequantize_mx(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Inverse of quantize_mx (uint8 elements are packed e2m1; float8 elements are e4m3)."""
    values = e2m1_decode(unpack_fp4(q), dtype) if q.dtype == FP4_STORAGE else q.to(dtype)
    k = values.shape[-1]
    return _ungroup(_groups(values) * e8m0_decode(scale, dtype)[..., None], k)
