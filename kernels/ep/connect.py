"""Build-time checks of an expert-parallel layer: dispatcher, process group, placement and shard agree.

Every mismatch is a KernelBuildError naming the dispatcher and the fix. Above all, a
dispatcher that exchanges tokens never runs without a group, and sharded weights never run
without the collective that completes them: either would silently compute only this rank's
share of the experts (the seed-001 regression).
"""

from __future__ import annotations

from typing import Optional

from ..errors import KernelBuildError
from ..interfaces import PrepareFinalize
from ..weights import MoEWeights
from .comm import Comm, CollectiveError
from .placement import Placement, PlacementError, required_expert_placement


def connect(*, pf_id: str, pf_class: type[PrepareFinalize], activation_format: str, group,
            placement: Optional[Placement], weights: MoEWeights, timeout_s: Optional[float],
            fingerprint: dict[str, str]) -> Optional[Comm]:
    """The Comm the dispatcher runs over (None on one device), once group, placement and weights agree here
    and every rank of the group built the same `fingerprint` (one all-gather, bounded by the timeout)."""
    if group is None and placement is None:
        if pf_class.needs_group:
            raise KernelBuildError(pf_id, "this dispatcher exchanges tokens between ranks and needs a "
                                          "torch.distributed process group: pass group= (the expert-parallel ranks) "
                                          "and placement= to build, with each rank's shard_weights; a single device "
                                          "decides 'local'")
        return None
    if group is None:
        raise KernelBuildError(pf_id, f"placement= shards the experts over {placement.num_ranks} ranks but no group= "
                                      "was given; without the group the other ranks' share of the experts would be "
                                      "silently missing: pass the torch.distributed process group of those ranks")
    if placement is None:
        raise KernelBuildError(pf_id, "a process group was given without placement=; pass the Placement the weights "
                                      "were sharded with (Placement.contiguous / round_robin / tensor)")
    try:
        placement.check()
        comm = Comm(group, timeout_s=timeout_s)
    except (PlacementError, CollectiveError, ValueError) as error:
        raise KernelBuildError(pf_id, str(error)) from None
    problem = _mismatch(pf_class, activation_format, comm, placement, weights)
    if problem:
        raise KernelBuildError(pf_id, problem)
    placed = {"placement": f"{placement.kind.value} {placement.num_experts}/{placement.num_ranks}",
              "weights": weights.origin or ""}
    try:
        comm.check_fingerprint({**fingerprint, **placed}, weights.device)
    except CollectiveError as error:   # InconsistentRanksError too: the same message on every rank
        raise KernelBuildError(pf_id, str(error)) from None
    return comm


def _mismatch(pf_class, activation_format: str, comm: Comm, placement: Placement,
              weights: MoEWeights) -> Optional[str]:
    if comm.size != placement.num_ranks:
        return (f"the process group has {comm.size} ranks but the placement spreads the experts over "
                f"{placement.num_ranks}; build the placement for the group's size")
    required = required_expert_placement(activation_format=activation_format)
    if required is not None and placement.kind != required:
        return (f"the {activation_format} activation format needs {required.value} expert placement (expert e on rank "
                f"e % ranks, vLLM's round-robin routing tables), got {placement.kind.value}; shard with "
                f"Placement.{required.value}(num_experts, ranks)")
    if pf_class.needs_expert_placement and not placement.shards_experts:
        return ("this dispatcher sends each token to the ranks owning its experts, so it needs whole experts per "
                "rank (contiguous or round_robin placement), not the tensor placement; tensor-sharded experts use "
                "'local' (same tokens on every rank) or 'allgather_reducescatter'")
    if weights.num_experts != placement.num_local_experts:
        return (f"the weights hold {weights.num_experts} experts but the placement gives rank {comm.rank} "
                f"{placement.num_local_experts}; pass this rank's shard: shard_weights(global_weights, placement, "
                f"rank={comm.rank})")
    return None
