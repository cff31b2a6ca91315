"""`triton.fused_moe`: the standard-format Triton experts."""

from __future__ import annotations

from typing import Optional

import torch

from ..activations import is_interleaved
from ..interfaces import Experts
from ..scheme import TORCH_DTYPE
from ..weights import MoEWeights
from .launch import fused_moe


class TritonExperts(Experts):

    def load_weights(self, weights: MoEWeights) -> None:
        """MXFP4 weights into the GEMMs' fragment order (`MoEWeights.use_fragment_order`), once."""
        weights.use_fragment_order(interleaved=is_interleaved(self.activation))

    def apply(self, hidden_q: torch.Tensor, *, weights: MoEWeights, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, a_scale: Optional[torch.Tensor]) -> torch.Tensor:
        x, a_scale = self.gemm1_input(hidden_q, a_scale=a_scale, weights=weights)
        return fused_moe(x, a_scale=a_scale, weights=weights, topk_ids=topk_ids, topk_weights=topk_weights,
                         activation=self.activation, out_dtype=TORCH_DTYPE[weights.in_dtype],
                         quantize_intermediate=lambda t: self.quantize_gemm_input(t, static_scale=weights.a2_scale),
                         remote_slots=self.prepare_finalize.remote_expert_ids, swiglu=self.swiglu)
