"""Expert parallelism over torch.distributed: expert placement, weight sharding, bounded collectives.

The dispatchers themselves (`allgather_reducescatter`, `all2all`, `all2all_batched`) are
registry entries built by `build_layer(..., group=, placement=)`; they are not imported here
so that `prepare_finalize` (which they extend) can import the placement helpers.
"""

from .capacity import CapacityError
from .comm import TIMEOUT_ENV, CollectiveError, Comm, WireRecord, init_distributed, resolve_timeout
from .placement import Placement, PlacementError, PlacementKind, required_expert_placement
from .sharding import shard_weights

__all__ = ["CapacityError", "CollectiveError", "Comm", "Placement", "PlacementError", "PlacementKind", "TIMEOUT_ENV",
           "WireRecord", "init_distributed", "required_expert_placement", "resolve_timeout", "shard_weights"]
