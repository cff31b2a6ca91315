"""LoRA adapters on the experts: one low-rank delta per expert on each of the two GEMMs.

Layout (E experts, r rank, H hidden, I intermediate, N1 = rows of w13: 2I gated, I non-gated):
  w13_lora_a [E, r, H], w13_lora_b [E, N1, r]   (B rows in w13's row layout, interleaved for swigluoai)
  w2_lora_a  [E, r, I], w2_lora_b  [E, H, r]
all in the layer's in_dtype, plus `scaling` (alpha / r). The experts compute

  GEMM1  h = x W13^T + scaling * (x A13^T) B13^T (+ bias), then the activation
  GEMM2  y = a W2^T  + scaling * (a A2^T) B2^T   (+ bias), then the router weight

with x and a unquantised: a delta trained on full-precision activations is not applied to
fp8/int8 ones, so schemes that quantise activations refuse LoRA (rule
lora.needs_unquantized_activations says the same to the decision).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moerules.activation import Dtype

from .scheme import TORCH_DTYPE, Scheme

_FIELDS = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")


@dataclass
class LoRAWeights:
    w13_lora_a: torch.Tensor
    w13_lora_b: torch.Tensor
    w2_lora_a: torch.Tensor
    w2_lora_b: torch.Tensor
    scaling: float

    def __post_init__(self):
        if any(getattr(self, f).dim() != 3 for f in _FIELDS):
            raise ValueError("LoRA adapters must be 3-D [E, r, K] (A) and [E, N, r] (B) tensors, got "
                             + ", ".join(f"{f} {tuple(getattr(self, f).shape)}" for f in _FIELDS))
        E, r = self.w13_lora_a.shape[:2]
        expected = {"w13_lora_b": (E, r), "w2_lora_a": (E, r), "w2_lora_b": (E, r)}
        got = {"w13_lora_b": (self.w13_lora_b.shape[0], self.w13_lora_b.shape[2]),
               "w2_lora_a": tuple(self.w2_lora_a.shape[:2]),
               "w2_lora_b": (self.w2_lora_b.shape[0], self.w2_lora_b.shape[2])}
        bad = [f"{f} has (experts, rank) {got[f]}" for f in expected if got[f] != expected[f]]
        if bad or r < 1:
            raise ValueError(f"LoRA adapters disagree: w13_lora_a {tuple(self.w13_lora_a.shape)} sets (experts, rank) "
                             f"= {(E, r)}, but " + ", ".join(bad or ["the rank is 0"]))

    @property
    def rank(self) -> int:
        return self.w13_lora_a.shape[1]

    def check_matches(self, *, num_experts: int, rows13: int, hidden: int, intermediate: int,
                      dtype: torch.dtype, device: torch.device) -> None:
        """Raise ValueError unless the adapters fit base weights of these (possibly padded) sizes."""
        expected = {"w13_lora_a": (num_experts, self.rank, hidden), "w13_lora_b": (num_experts, rows13, self.rank),
                    "w2_lora_a": (num_experts, self.rank, intermediate), "w2_lora_b": (num_experts, hidden, self.rank)}
        bad = [f"{f} is {tuple(getattr(self, f).shape)}, expected {shape}" for f, shape in expected.items()
               if tuple(getattr(self, f).shape) != shape]
        if bad:
            raise ValueError("LoRA adapters do not fit the expert weights (w13 rows, hidden, intermediate = "
                             f"{rows13}, {hidden}, {intermediate}): " + "; ".join(bad) +
                             ". Adapters added after a padded build must go through MoELayer.set_lora")
        for f in _FIELDS:
            t = getattr(self, f)
            if t.dtype != dtype or t.device.type != device.type:
                raise ValueError(f"LoRA {f} is {t.dtype} on {t.device}; the layer computes in {dtype} on {device}")


def lora_refusal(*, supports_lora: bool, scheme: Scheme) -> Optional[str]:
    """Why experts with these properties cannot apply LoRA adapters (None when they can)."""
    if not supports_lora:
        return ("the weights carry LoRA adapters, which these experts cannot apply; use triton.fused_moe or "
                "torch.reference (decide with features.lora)")
    if scheme.quantizes_activations:
        return (f"LoRA deltas must see unquantised activations, but scheme {scheme.cell} quantises them to "
                f"{scheme.act_dtype.value}; use unquantized or a weight-only scheme (fp8_w8a16, int8_w8a16)")
    return None


def make_random_lora(*, num_experts: int, hidden: int, intermediate: int, rank: int, in_dtype: Dtype,
                     seed: int, device, gated: bool = True, scaling: float = 1.0) -> LoRAWeights:
    """Seeded random adapters for base weights of these logical sizes (N1 = 2I gated, I non-gated).

    A is N(0, 1/K) and B is N(0, 1/r), so each delta is O(1) like the base GEMM output: a lost
    delta changes the layer output by about as much as the layer itself (tests rely on that).
    """
    dtype = TORCH_DTYPE[in_dtype]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, std):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    E, H, I, r = num_experts, hidden, intermediate, rank
    rows13 = 2 * I if gated else I
    return LoRAWeights(w13_lora_a=randn(E, r, H, std=H ** -0.5), w13_lora_b=randn(E, rows13, r, std=r ** -0.5),
                       w2_lora_a=randn(E, r, I, std=I ** -0.5), w2_lora_b=randn(E, H, r, std=r ** -0.5),
                       scaling=scaling)
