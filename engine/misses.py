"""Reading a decision's rejections: each component's decisive reason, and the nearest miss.

A component is often rejected by several rules at once (a CUDA-only kernel on ROCm also lacks
its package). The decisive reason is the one hardest to change, so a reader sees "vendor"
rather than "install flashinfer"; the nearest miss is the backend that the fewest, cheapest
changes would make eligible, so a refused layer says what to do about it.
"""

from __future__ import annotations

from itertools import groupby
from operator import attrgetter
from typing import Iterable, Mapping, Optional, Sequence

from moerules.decision import ReasonCode, Rejection

# Hardest to change first: the platform, then the model, then the deployment, then an install.
SEVERITY = {reason: rank for rank, reason in enumerate((
    ReasonCode.vendor_unsupported, ReasonCode.arch_unsupported, ReasonCode.quant_unsupported,
    ReasonCode.dtype_unsupported, ReasonCode.activation_unsupported, ReasonCode.routing_unsupported,
    ReasonCode.bias_unsupported, ReasonCode.shape_unaligned, ReasonCode.lora_unsupported,
    ReasonCode.batch_invariance_unsupported, ReasonCode.expert_map_unsupported, ReasonCode.parallel_unsupported,
    ReasonCode.format_mismatch, ReasonCode.no_dispatcher, ReasonCode.not_in_priority,
    ReasonCode.no_eligible_backend, ReasonCode.package_missing))}


def by_component(rejections: Iterable[Rejection]) -> dict[str, list[Rejection]]:
    """Rejections per component, in the decision's order (it lists them by component, then rule)."""
    return {name: list(group) for name, group in groupby(rejections, attrgetter("backend"))}


def decisive(rejections: Sequence[Rejection]) -> Rejection:
    """The rejection hardest to change (the first in rule order among equals)."""
    return min(rejections, key=lambda rejection: SEVERITY[rejection.reason])


def nearest_miss(rejections: Iterable[Rejection], candidates: Sequence[str],
                 packages: Mapping[str, Sequence[str]]) -> Optional[str]:
    """The candidate backend fewest changes away from eligible, with the fix, as one phrase:
    "marlin: only package_missing - install marlin". Ties go to the higher-ranked candidate."""
    rejected = by_component(rejections)
    scored = [(_distance(rejected[name]), rank, name) for rank, name in enumerate(candidates) if rejected.get(name)]
    if not scored:
        return None
    name = min(scored)[2]
    reasons = list(dict.fromkeys(rejection.reason.value for rejection in rejected[name]))
    only = "only " if len(rejected[name]) == 1 or reasons == [ReasonCode.package_missing.value] else ""
    return f"{name}: {only}{', '.join(reasons)} - {_fix(rejected[name], packages.get(name, ()))}"


def _distance(rejections: list[Rejection]) -> tuple[int, int]:
    """Rejections other than a missing package (a what-if install), then all of them."""
    return sum(r.reason != ReasonCode.package_missing for r in rejections), len(rejections)


def _fix(rejections: list[Rejection], packages: Sequence[str]) -> str:
    if all(r.reason == ReasonCode.package_missing for r in rejections):
        return f"install {', '.join(packages)} (or state it: --packages)" if packages else rejections[0].detail
    worst = decisive(rejections)
    return f"{worst.detail} ({worst.rule} at {worst.source})"
