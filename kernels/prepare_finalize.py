"""Prepare/finalize implementations. `local`: one rank, standard format, no communication.

Subclasses for expert parallelism (all-to-all, all-gather/reduce-scatter) override
`dispatch`/`combine` and keep the quantise-once logic of `prepare`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .interfaces import STANDARD, PreparedInput, PrepareFinalize
from .quantize import quantize_activation


class LocalPrepareFinalize(PrepareFinalize):
    activation_format = STANDARD

    def prepare(self, x: torch.Tensor, *, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                defer_input_quant: bool, a13_scale: Optional[torch.Tensor]) -> PreparedInput:
        x, a_scale = self.pad_and_quantize(x, defer_input_quant=defer_input_quant, a13_scale=a13_scale)
        return self.dispatch(PreparedInput(hidden_q=x, a_scale=a_scale, topk_ids=topk_ids,
                                           topk_weights=topk_weights))

    def pad_and_quantize(self, x: torch.Tensor, *, defer_input_quant: bool,
                         a13_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[T, H] -> [T, H + hidden_pad], quantised here (once, before any dispatch) unless deferred to the experts."""
        if self.hidden_pad:
            x = torch.nn.functional.pad(x, (0, self.hidden_pad))
        a_scale = None
        if self.scheme.quantizes_activations and not defer_input_quant:
            x, a_scale = quantize_activation(x, dtype=self.scheme.act_torch_dtype,
                                             granularity=self.scheme.act_granularity, static_scale=a13_scale)
        return x, a_scale

    def dispatch(self, prepared: PreparedInput) -> PreparedInput:
        """Send tokens to the ranks owning their experts; local: nothing to send."""
        return prepared

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Bring expert outputs back to the tokens' ranks; local: already there."""
        return expert_out

    def finalize(self, expert_out: torch.Tensor, *, prepared: PreparedInput, hidden_size: int) -> torch.Tensor:
        out = self.combine(expert_out)
        return out[:, :hidden_size] if out.shape[1] != hidden_size else out
