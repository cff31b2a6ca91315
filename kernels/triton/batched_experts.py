"""`triton.batched_moe`: the batched-format Triton experts."""

from __future__ import annotations

from typing import Optional

import torch

from ..interfaces import BatchedExperts
from ..scheme import TORCH_DTYPE
from ..weights import MoEWeights
from .batched import batched_moe


class BatchedTritonExperts(BatchedExperts):

    def apply(self, hidden_q: torch.Tensor, *, weights: MoEWeights, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, a_scale: Optional[torch.Tensor],
              expert_num_tokens: torch.Tensor) -> torch.Tensor:
        x, a_scale = self.gemm1_input(hidden_q, a_scale=a_scale, weights=weights, expert_num_tokens=expert_num_tokens)
        return batched_moe(x, a_scale=a_scale, expert_num_tokens=expert_num_tokens, weights=weights,
                           activation=self.activation, out_dtype=TORCH_DTYPE[weights.in_dtype],
                           num_tokens=topk_ids.shape[0], top_k=topk_ids.shape[1], swiglu=self.swiglu)
