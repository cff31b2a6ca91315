"""Prepare/finalize implementations. `local`: standard format, no token exchange.

On one device `local` only quantises (or defers) once. Built with a process group it serves
ranks that all hold the same tokens (TP+EP with dp=1, or experts tensor-sharded over TP
ranks): each rank computes its own experts (ids of experts on other ranks become -1) or its
slice of every expert, and finalize all-reduces the partial outputs. Without that all-reduce
each rank would silently keep only its local experts' share (a seed regression).

Dispatchers that exchange tokens (kernels/ep) subclass this class, override
`dispatch`/`combine`, and keep the quantise-once logic of `prepare`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .ep.comm import batch_shape
from .ep.placement import RoutingTables, map_to_local, routing_tables
from .interfaces import PreparedInput, PrepareFinalize
from .quantize import quantize_activation


class LocalPrepareFinalize(PrepareFinalize):

    @property
    def remote_expert_ids(self) -> bool:
        return self.placement is not None and self.placement.shards_experts

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
                                             granularity=self.scheme.act_granularity,
                                             static_scale=self.activation_scale(x, a13_scale=a13_scale))
        return x, a_scale

    def activation_scale(self, x: torch.Tensor, *, a13_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The static scale to quantise x with (None: dynamic, from x itself)."""
        return a13_scale

    def dispatch(self, prepared: PreparedInput) -> PreparedInput:
        """Send tokens to the ranks owning their experts; local: nothing to send, at most renumber."""
        if self.remote_expert_ids:
            tables = self.routing_tables(prepared.topk_ids.device)
            prepared.topk_ids = map_to_local(prepared.topk_ids, tables.expert_map)
        return prepared

    def combine(self, expert_out: torch.Tensor, *, prepared: PreparedInput) -> torch.Tensor:
        """Bring expert outputs back to the tokens' ranks; local: already there, summed over ranks if sharded."""
        if self.comm is None:
            return expert_out
        # The ranks hold the same tokens; a rank with other tokens or another width would make the all-reduce's
        # sizes disagree (gloo aborts the process): one small all-gather checks it first. It reads the
        # answer on the host, which CUDA-graph capture forbids: captured graphs rely on the eager warm-up's check.
        if not (expert_out.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.comm.agree({"tokens": expert_out.shape[0], **batch_shape(expert_out, prepared.topk_ids)},
                            expert_out.device, what="batch shape")
        return self.comm.all_reduce(expert_out.contiguous(), what="partial outputs")

    def finalize(self, expert_out: torch.Tensor, *, prepared: PreparedInput, hidden_size: int) -> torch.Tensor:
        out = self.combine(expert_out, prepared=prepared)
        return out[:, :hidden_size] if out.shape[1] != hidden_size else out

    def routing_tables(self, device: torch.device) -> RoutingTables:
        return routing_tables(self.placement, self.comm.rank, device)
