"""Common ground of the dispatchers that move tokens between ranks, and what a token carries.

A dispatched token row carries its hidden state (quantised when the dispatcher quantises,
else in the input dtype), its top-k ids and router weights (packed into one int32 row so
they cross in one collective), and its activation scale when that scale is per token
([T] per token, [T, H/128] per 1x128 group). A per-tensor scale never travels: with a
static scale every rank already has it, and a dynamic one is agreed on before quantising
(one all-reduce of the amax), so every rank quantises exactly as one device would over the
whole batch and the experts see one consistent scale.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from moerules.quant import Granularity

from ..prepare_finalize import LocalPrepareFinalize
from ..quantize import finite_amax, tensor_scale_from_amax
from .capacity import Capacity, CapacityError


class ExchangePrepareFinalize(LocalPrepareFinalize):
    needs_group = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.capacity = Capacity()

    def set_capacity(self, *, tokens_per_rank: int, rows_per_peer: Optional[int] = None) -> None:
        """Reserve exchange buffers for batches of up to `tokens_per_rank` tokens on every rank (the same values on
        every rank, before the first forward). all2all only: rows_per_peer < tokens_per_rank sends less padding
        but may overflow, which is detected on the device and raised as CapacityError."""
        if rows_per_peer is not None and not self.needs_expert_placement:
            raise CapacityError(f"{type(self).__name__} gathers every token to every rank: it has no rows_per_peer")
        self.capacity.request(tokens_per_rank, rows_per_peer)

    def check_capacity(self) -> None:
        """Blocking: CapacityError if any forward so far (graph replays included) overflowed the buffers."""
        self.capacity.check(self.comm)

    @property
    def remote_expert_ids(self) -> bool:
        # Padding rows and other ranks' experts reach the experts as id -1.
        return True

    def activation_scale(self, x: torch.Tensor, *, a13_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if a13_scale is not None or self.scheme.act_granularity != Granularity.tensor:
            return a13_scale
        amax = finite_amax(x).reshape(1)
        amax = self.comm.all_reduce(amax, what="activation amax", op=dist.ReduceOp.MAX)
        return tensor_scale_from_amax(amax, self.scheme.act_torch_dtype)

    def token_scale(self, a_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The part of a_scale that travels with the tokens (per token / per group rows), else None."""
        if a_scale is None or self.scheme.act_granularity == Granularity.tensor:
            return None
        return a_scale


def pack_topk(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """int32 ids [N, k] and fp32 weights [N, k] -> one int32 [N, 2k] (weights bit-cast, not converted)."""
    return torch.cat([topk_ids.to(torch.int32), topk_weights.float().view(torch.int32)], dim=1)


def unpack_topk(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = packed.shape[1] // 2
    return packed[:, :k].contiguous(), packed[:, k:].contiguous().view(torch.float32)
