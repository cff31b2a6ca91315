"""Routing: router logits -> (topk_ids, topk_weights), and validation of given top-k tensors.

Both functions return topk_ids int32 [M, k] and topk_weights fp32 [M, k], the layout every
experts backend takes.
"""

from __future__ import annotations

from typing import Optional

import torch

from moerules.errors import KernelInputError


def fused_topk(router_logits: torch.Tensor, *, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, then top-k; `renormalize` rescales the k weights to sum to 1."""
    _check_logits(router_logits, top_k)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


SCORING = {"softmax": lambda logits: torch.softmax(logits, dim=-1), "sigmoid": torch.sigmoid}


def grouped_topk(router_logits: torch.Tensor, *, top_k: int, num_expert_group: int, topk_group: int,
                 e_score_correction_bias: Optional[torch.Tensor] = None, renormalize: bool = True,
                 routed_scaling_factor: float = 1.0, scoring: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k: DeepSeek-V3 (sigmoid, correction bias), DeepSeek-V2 (softmax), GLM-4-MoE.

    The correction bias only steers selection. Groups are ranked by the sum of their two best
    biased scores when there is a bias, else by their best score (as vLLM's grouped_topk and the
    Hugging Face modules rank them); the best `topk_group` groups stay eligible, the top-k (biased)
    scores among them are selected, and the weights are the *unbiased* scores of those experts
    (renormalised if asked), times `routed_scaling_factor`. One group is plain top-k.
    """
    _check_logits(router_logits, top_k)
    M, E = router_logits.shape
    if E % num_expert_group:
        raise KernelInputError(f"{E} experts do not split into {num_expert_group} groups")
    if not 1 <= topk_group <= num_expert_group:
        raise KernelInputError(f"topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]")
    if scoring not in SCORING:
        raise KernelInputError(f"scoring {scoring!r} is not one of {', '.join(SCORING)}")
    scores = SCORING[scoring](router_logits.float())
    biased = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()[None, :]
    per_group = biased.view(M, num_expert_group, E // num_expert_group)
    best = 1 if e_score_correction_bias is None else min(2, per_group.shape[-1])
    group_scores = per_group.topk(best, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    masked = biased.masked_fill(~keep.repeat_interleave(E // num_expert_group, dim=1), float("-inf"))
    ids = masked.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights * routed_scaling_factor


def check_topk_dtypes(*, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """Integer ids and floating weights: the cheap check that catches the two being swapped."""
    if topk_ids.is_floating_point() or topk_ids.is_complex():
        raise KernelInputError(f"topk_ids must be an integer tensor, got {topk_ids.dtype} "
                         "(were topk_ids and topk_weights swapped?)")
    if not topk_weights.is_floating_point():
        raise KernelInputError(f"topk_weights must be a floating tensor, got {topk_weights.dtype} "
                         "(were topk_ids and topk_weights swapped?)")


def validate_topk(*, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int,
                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Check given top-k tensors before any kernel indexes memory with them.

    Returns them as contiguous int32 ids and fp32 weights. Raises KernelInputError (a ValueError) for wrong
    shapes, dtypes (ids must be integers, weights floating: catches swapped arguments) or an
    id outside [0, num_experts). The range check reads the ids back to the host (one sync);
    it is the price of never letting a bad id reach a kernel's pointer arithmetic. While a
    CUDA graph is being captured no sync is allowed, so the range check is skipped there;
    the Triton align kernel then drops out-of-range ids instead of indexing with them.
    """
    check_topk_dtypes(topk_ids=topk_ids, topk_weights=topk_weights)
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise KernelInputError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                               f"must both be [num_tokens={num_tokens}, top_k]")
    if topk_ids.numel() and not (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise KernelInputError(f"topk_ids out of range: found ids in [{lo}, {hi}], valid is [0, {num_experts - 1}]")
    return topk_ids.to(torch.int32).contiguous(), topk_weights.float().contiguous()


def _check_logits(router_logits: torch.Tensor, top_k: int) -> None:
    if router_logits.dim() != 2:
        raise KernelInputError(f"router_logits must be [tokens, experts], got {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise KernelInputError(f"top_k={top_k} must be in [1, num_experts={router_logits.shape[1]}]")
