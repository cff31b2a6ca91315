"""`triton.fused_moe`: the standard-format Triton experts."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..activations import is_interleaved
from ..interfaces import Experts
from ..scheme import TORCH_DTYPE
from ..weights import MoEWeights
from .launch import fused_moe
from .quant import scale_of_partials


class TritonExperts(Experts):

    def load_weights(self, weights: MoEWeights) -> None:
        """MXFP4 weights into the GEMMs' fragment order (`MoEWeights.use_fragment_order`), once."""
        weights.use_fragment_order(interleaved=is_interleaved(self.activation))

    def quantize_intermediate(self, weights: MoEWeights) -> Callable:
        """`launch.fused_moe`'s quantize_intermediate for these weights: with GEMM1's partial amaxes of the
        intermediate (dynamic per tensor, `launch.gemm1`) their scale, else the static scale if the scheme has one,
        else the quantiser's own amax."""
        def quantize(t: torch.Tensor, amaxes: Optional[torch.Tensor]):
            scale = weights.a2_scale if amaxes is None else scale_of_partials(amaxes, self.scheme.act_torch_dtype)
            return self.quantize_gemm_input(t, static_scale=scale)
        return quantize

    def apply(self, hidden_q: torch.Tensor, *, weights: MoEWeights, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, a_scale: Optional[torch.Tensor]) -> torch.Tensor:
        x, a_scale = self.gemm1_input(hidden_q, a_scale=a_scale, weights=weights)
        return fused_moe(x, a_scale=a_scale, weights=weights, topk_ids=topk_ids, topk_weights=topk_weights,
                         activation=self.activation, out_dtype=TORCH_DTYPE[weights.in_dtype],
                         quantize_intermediate=self.quantize_intermediate(weights),
                         remote_slots=self.prepare_finalize.remote_expert_ids, swiglu=self.swiglu)
