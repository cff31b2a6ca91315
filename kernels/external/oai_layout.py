"""Our MXFP4 expert weights in the layout OpenAI triton_kernels' `matmul_ogs` reads (before its Hopper
swizzle), and back. Pure torch: no triton_kernels needed, so CPU tests check it.

triton_kernels multiplies x [T, K] by w [E, K, N]: the quantised axis K is dim 1 and is the stride-1
axis, two e2m1 values per byte with the even k in the low nibble (its torch reference packs
`evens | odds << 4`, numerics_details/mxfp.py), as ours does (mx.py). Our weights are [E, N, K/2], so
the conversion is a transposed view of the checkpoint order (`MoEWeights.in_checkpoint_order`; a copy only if our Triton
experts rewrote them): w13 [E, 2I, H/2] -> [E, H/2, 2I], w2 [E, H, I/2] -> [E, I/2, H].
E8M0 scales go [E, N, K/32] -> [E, K/32, N] the same way, after padding the group count to a multiple
of 4 with zero bytes (vLLM 0.33 does so for sm90, quantization/utils/mxfp4_utils.py:135-143, working
around triton issue 47303; the padded groups cover no weight).
Biases are fp32 [E, N] (the kernel's epilogue adds them in fp32; vLLM oracle/mxfp4.py:1445-1448).
GEMM1 columns stay as they are: its fused swiglu reads gate at even and up at odd n, which is our
`swigluoai` interleaving (weights.py), and clamps and scales as ours does (alpha 1.702, limit 7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..weights import MoEWeights

SCALE_GROUP_MULTIPLE = 4


@dataclass(frozen=True)
class OaiMxfp4Weights:
    """One layer's MXFP4 weights as matmul_ogs reads them (module doc); `*_groups` are the unpadded counts."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_bias: Optional[torch.Tensor]
    w2_bias: Optional[torch.Tensor]
    w13_groups: int
    w2_groups: int


def _k_major(packed: torch.Tensor) -> torch.Tensor:
    return packed.transpose(-2, -1)


def _k_major_scale(scale: torch.Tensor) -> torch.Tensor:
    pad = -scale.shape[-1] % SCALE_GROUP_MULTIPLE
    return torch.nn.functional.pad(scale, (0, pad)).transpose(-2, -1)


def to_oai_layout(weights: MoEWeights) -> OaiMxfp4Weights:
    """`weights` (MXFP4 W4A16, packed e2m1 + e8m0) -> the matmul_ogs layout; raises ValueError otherwise."""
    if weights.scheme.k_pack != 2 or weights.w13_scale is None or weights.w13_scale.dtype != torch.uint8:
        raise ValueError(f"triton_kernels' MXFP4 MoE takes packed e2m1 weights with e8m0 scales, not "
                         f"{weights.scheme.cell}")

    def bias(b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if b is None else b.float().contiguous()

    w13, w2, s13, s2 = (weights.in_checkpoint_order(n) for n in ("w13", "w2", "w13_scale", "w2_scale"))
    return OaiMxfp4Weights(w13=_k_major(w13), w13_scale=_k_major_scale(s13),
                           w2=_k_major(w2), w2_scale=_k_major_scale(s2),
                           w13_bias=bias(weights.w13_bias), w2_bias=bias(weights.w2_bias),
                           w13_groups=weights.w13_scale.shape[-1], w2_groups=weights.w2_scale.shape[-1])


def from_oai_layout(oai: OaiMxfp4Weights, bias_dtype: torch.dtype) -> dict[str, Optional[torch.Tensor]]:
    """The inverse of `to_oai_layout`: our w13, w13_scale, w2, w2_scale, w13_bias, w2_bias (biases in bias_dtype)."""
    def bias(b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if b is None else b.to(bias_dtype)

    return {"w13": _k_major(oai.w13), "w13_scale": _k_major(oai.w13_scale)[..., :oai.w13_groups],
            "w2": _k_major(oai.w2), "w2_scale": _k_major(oai.w2_scale)[..., :oai.w2_groups],
            "w13_bias": bias(oai.w13_bias), "w2_bias": bias(oai.w2_bias)}
