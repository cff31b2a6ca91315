"""Where the experts of one MoE layer live across the ranks of a process group.

Three kinds:
  contiguous   expert e on rank e // (E/R): each rank holds a block of whole experts (EP default).
  round_robin  expert e on rank e % R: what batched dispatchers need (vLLM's
               `needs_round_robin_routing_tables`), and it spreads hot neighbouring experts.
  tensor       every rank holds every expert, sliced along the intermediate size (MoE tensor
               parallelism without EP: `moe_tp` = tp*dp ranks); partial outputs are summed.

A rank's experts are numbered 0..E_local-1 in global order; `expert_map(rank)` maps a global
id to that local index, or -1 where the expert lives elsewhere (vLLM's expert_map).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Optional

import torch

from ..interfaces import BATCHED


class PlacementKind(str, Enum):
    contiguous = "contiguous"
    round_robin = "round_robin"
    tensor = "tensor"


class PlacementError(ValueError):
    """A placement that cannot shard these experts over these ranks; the message says the fix."""


def required_expert_placement(*, activation_format: str) -> Optional[PlacementKind]:
    """The expert placement the batched kernels need under EP, or None when any will do.

    Batched dispatchers index per-rank expert tables as e % R (round robin). Decisions carry
    the rules' choice (`Decision.expert_placement`, rule placement.round_robin_for_batched);
    this is the kernels' side of the same contract, checked at build so neither can drift alone.
    """
    return PlacementKind.round_robin if activation_format == BATCHED else None


def expert_divisibility_problem(num_experts: int, num_ranks: int) -> Optional[str]:
    if num_experts % num_ranks == 0:
        return None
    fits = [r for r in range(1, num_experts + 1) if num_experts % r == 0]
    return (f"{num_experts} experts do not split evenly over {num_ranks} ranks (no rule allows uneven expert "
            f"placement); use a rank count that divides {num_experts} ({', '.join(map(str, fits))}) "
            f"or turn expert parallelism off to tensor-shard the experts instead")


@dataclass(frozen=True)
class Placement:
    kind: PlacementKind
    num_experts: int
    num_ranks: int

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> "Placement":
        return cls(PlacementKind.contiguous, num_experts, num_ranks)

    @classmethod
    def round_robin(cls, num_experts: int, num_ranks: int) -> "Placement":
        return cls(PlacementKind.round_robin, num_experts, num_ranks)

    @classmethod
    def tensor(cls, num_experts: int, num_ranks: int) -> "Placement":
        return cls(PlacementKind.tensor, num_experts, num_ranks)

    def __post_init__(self):
        object.__setattr__(self, "kind", PlacementKind(self.kind))
        if self.num_experts < 1 or self.num_ranks < 1:
            raise PlacementError(f"a placement needs >= 1 expert and >= 1 rank, got {self.num_experts} experts "
                                 f"over {self.num_ranks} ranks")

    def check(self) -> None:
        """Raise PlacementError unless every rank gets the same number of whole experts."""
        problem = None if self.kind == PlacementKind.tensor else expert_divisibility_problem(
            self.num_experts, self.num_ranks)
        if problem:
            raise PlacementError(problem)

    @property
    def shards_experts(self) -> bool:
        """Whole experts per rank (EP); False when every rank holds a slice of every expert."""
        return self.kind != PlacementKind.tensor

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks if self.shards_experts else self.num_experts

    def local_experts(self, rank: int) -> list[int]:
        """Global ids of the experts on `rank`, in local-index order."""
        self._check_rank(rank)
        n = self.num_local_experts
        if self.kind == PlacementKind.contiguous:
            return list(range(rank * n, (rank + 1) * n))
        if self.kind == PlacementKind.round_robin:
            return list(range(rank, self.num_experts, self.num_ranks))
        return list(range(self.num_experts))

    def owner(self, device=None) -> torch.Tensor:
        """int64 [E]: the rank holding each global expert (EP placements only)."""
        e = torch.arange(self.num_experts, device=device)
        if self.kind == PlacementKind.contiguous:
            return e // self.num_local_experts
        if self.kind == PlacementKind.round_robin:
            return e % self.num_ranks
        raise PlacementError("a tensor placement has no owner rank per expert: every rank holds every expert")

    def local_index(self, device=None) -> torch.Tensor:
        """int64 [E]: each global expert's index on its owner rank."""
        e = torch.arange(self.num_experts, device=device)
        if self.kind == PlacementKind.contiguous:
            return e % self.num_local_experts
        if self.kind == PlacementKind.round_robin:
            return e // self.num_ranks
        return e

    def expert_map(self, rank: int, device=None) -> torch.Tensor:
        """int32 [E]: global id -> local index on `rank`, -1 for experts held by another rank."""
        self._check_rank(rank)
        if not self.shards_experts:
            return torch.arange(self.num_experts, dtype=torch.int32, device=device)
        mine = self.owner(device) == rank
        return torch.where(mine, self.local_index(device), -1).to(torch.int32)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise PlacementError(f"rank {rank} is outside this placement's {self.num_ranks} ranks")


class RoutingTables(NamedTuple):
    owner: Optional[torch.Tensor]        # int64 [E]: owner rank per expert (None for the tensor placement)
    local_index: torch.Tensor            # int64 [E]: index on the owner
    expert_map: torch.Tensor             # int32 [E]: local index on this rank, -1 elsewhere


@functools.lru_cache(maxsize=None)
def routing_tables(placement: Placement, rank: int, device: torch.device) -> RoutingTables:
    """The placement's lookup tables on `device`, built once (they are read on every forward)."""
    return RoutingTables(owner=placement.owner(device) if placement.shards_experts else None,
                         local_index=placement.local_index(device),
                         expert_map=placement.expert_map(rank, device))


def map_to_local(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Global topk ids -> local ids via `expert_map`; -1 (padding or remote) stays -1. int32 like the input."""
    local = expert_map[topk_ids.clamp(min=0).long()]
    return torch.where(topk_ids >= 0, local, -1).to(torch.int32)
