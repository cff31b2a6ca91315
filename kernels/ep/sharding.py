"""`shard_weights`: one rank's part of a layer's global weights, for a `Placement`.

Expert placements take whole experts (weights, biases and per-expert scales, in the rank's
local order). The tensor placement takes a 1/R slice of every expert's intermediate size:
w13's gate and up rows (or interleaved pairs), w2's columns and the matching scale rows or
blocks; each rank's partial outputs are summed by the dispatcher, so w2's bias is kept on
rank 0 only (zeros elsewhere) and is added exactly once.

Quantised values are sliced, never re-quantised, so a shard computes bit-for-bit the same
products as the global layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from moerules.activation import Activation
from moerules.quant import Granularity

from ..activations import is_interleaved
from ..scheme import QUANT_BLOCK
from ..weights import MoEWeights
from .placement import Placement, PlacementError


def shard_weights(weights: MoEWeights, placement: Placement, rank: int, *,
                  activation: Optional[Activation] = None) -> MoEWeights:
    """This rank's MoEWeights. `activation` (the gate/up row layout) is needed for the tensor placement."""
    placement.check()
    if weights.padding not in (None, (0, 0)) or weights.fp4_fragment_order:
        raise PlacementError("these weights were already padded (or, MXFP4, rewritten in fragment order) by a layer "
                             "build; shard the unpadded global weights and let each rank's build pad its shard")
    if weights.num_experts != placement.num_experts:
        raise PlacementError(f"the weights hold {weights.num_experts} experts but the placement is for "
                             f"{placement.num_experts}; shard the global weights")
    if placement.shards_experts:
        shard = _take_experts(weights, torch.tensor(placement.local_experts(rank), device=weights.device))
    elif activation is None:
        raise PlacementError("tensor sharding needs activation= to know how w13's gate and up rows are laid out")
    else:
        shard = _slice_intermediate(weights, rank, placement.num_ranks, is_interleaved(activation))
    return replace(shard, origin=weights.origin or weights.checksum())


def _take_experts(w: MoEWeights, idx: torch.Tensor) -> MoEWeights:
    def take(t):
        return None if t is None else t.index_select(0, idx).contiguous()
    return replace(w, w13=take(w.w13), w2=take(w.w2), w13_bias=take(w.w13_bias), w2_bias=take(w.w2_bias),
                   w13_scale=take(w.w13_scale), w2_scale=take(w.w2_scale))


def _slice_intermediate(w: MoEWeights, rank: int, ranks: int, interleaved: bool) -> MoEWeights:
    inter = w.intermediate
    if inter % ranks:
        raise PlacementError(f"intermediate size {inter} does not split evenly over {ranks} ranks")
    part = inter // ranks
    gran = w.scheme.weight_granularity
    if gran == Granularity.block128 and part % QUANT_BLOCK:
        raise PlacementError(f"block128 weights: each rank's intermediate slice ({inter}/{ranks} = {part}) must be "
                             f"a multiple of {QUANT_BLOCK} so no scale block is split between ranks")
    w2_bias = w.w2_bias if w.w2_bias is None or rank == 0 else torch.zeros_like(w.w2_bias)
    w13_scale, w2_scale = w.w13_scale, w.w2_scale
    if gran == Granularity.channel:
        w13_scale = _gate_up_rows(w13_scale, rank, part, inter, interleaved)
    elif gran == Granularity.block128:
        blocks = part // QUANT_BLOCK
        w13_scale = _gate_up_rows(w13_scale, rank, blocks, inter // QUANT_BLOCK, interleaved)
        w2_scale = w2_scale[:, :, rank * blocks:(rank + 1) * blocks].contiguous()
    return replace(w, w13=_gate_up_rows(w.w13, rank, part, inter, interleaved),
                   w2=w.w2[:, :, rank * part:(rank + 1) * part].contiguous(),
                   w13_bias=None if w.w13_bias is None else _gate_up_rows(w.w13_bias, rank, part, inter, interleaved),
                   w2_bias=w2_bias, w13_scale=w13_scale, w2_scale=w2_scale)


def _gate_up_rows(t: torch.Tensor, rank: int, part: int, inter: int, interleaved: bool) -> torch.Tensor:
    """Rows [gate slice | up slice] of a [E, 2*inter, ...] tensor (one contiguous run when interleaved)."""
    if interleaved:
        return t[:, 2 * rank * part:2 * (rank + 1) * part].contiguous()
    lo, hi = rank * part, (rank + 1) * part
    return torch.cat([t[:, lo:hi], t[:, inter + lo:inter + hi]], dim=1).contiguous()
