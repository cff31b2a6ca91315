"""Every routing choice that changes which experts a token reaches, pinned against an independent reference.

The reference below is written per token in plain Python floats from the published semantics (Mixtral's
softmax top-k; DeepSeek-V3's sigmoid scores, correction bias for selection only, groups ranked by the sum
of their two best biased scores (by their best score when there is no bias), experts of dropped groups never eligible, weights the unbiased scores,
renormalised, times the routed scaling factor), so a change to any of those choices in routing.py fails
here. The negative correction biases matter: with dropped groups masked to 0.0 instead of -inf, a token
whose kept experts all score below zero is sent to an expert of a dropped group.
"""

from __future__ import annotations

import math

import pytest
import torch

from moerules.kernels.routing import fused_topk, grouped_topk


def softmax_reference(logits: list[float], top_k: int, renormalize: bool) -> tuple[list[int], list[float]]:
    exps = [math.exp(v - max(logits)) for v in logits]
    probs = [e / sum(exps) for e in exps]
    ids = sorted(range(len(probs)), key=lambda e: -probs[e])[:top_k]
    weights = [probs[e] for e in ids]
    if renormalize:
        weights = [w / sum(weights) for w in weights]
    return ids, weights


def deepseek_reference(logits: list[float], bias: list[float], *, top_k: int, groups: int, topk_group: int,
                       renormalize: bool, scale: float) -> tuple[list[int], list[float]]:
    scores = [1 / (1 + math.exp(-v)) for v in logits]
    biased = [s + b for s, b in zip(scores, bias)]
    size = len(scores) // groups
    members = [list(range(g * size, (g + 1) * size)) for g in range(groups)]
    rank = [sum(sorted((biased[e] for e in m), reverse=True)[:2]) for m in members]
    kept = sorted(range(groups), key=lambda g: -rank[g])[:topk_group]
    eligible = [e for g in kept for e in members[g]]
    ids = sorted(eligible, key=lambda e: -biased[e])[:top_k]
    weights = [scores[e] for e in ids]
    if renormalize:
        weights = [w / sum(weights) for w in weights]
    return ids, [w * scale for w in weights]


def _as_sets(ids: torch.Tensor, weights: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist())) for i, w in zip(ids, weights)]


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_top_k_matches_the_reference(renormalize):
    logits = torch.randn(20, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ids, weights = fused_topk(logits, top_k=3, renormalize=renormalize)
    for row, got in zip(logits.tolist(), _as_sets(ids, weights)):
        want_ids, want_w = softmax_reference(row, 3, renormalize)
        assert sorted(got) == sorted(want_ids)
        assert [got[e] for e in want_ids] == pytest.approx(want_w, rel=1e-6)


CASES = [  # (bias mean, renormalize, scaling factor)
    (0.0, True, 2.5),
    (-1.5, True, 1.0),     # every biased score negative: dropped groups must stay ineligible (-inf, not 0.0)
    (-0.7, False, 1.0),    # some kept experts negative, no renormalisation
    (0.5, False, 2.826),   # positive bias: selection moves, weights stay unbiased
]


@pytest.mark.parametrize("bias_mean,renormalize,scale", CASES)
def test_grouped_top_k_matches_the_reference(bias_mean, renormalize, scale):
    g = torch.Generator().manual_seed(7)
    M, E, groups, topk_group, k = 32, 16, 8, 3, 4
    logits = torch.randn(M, E, generator=g, dtype=torch.float64)
    bias = bias_mean + 0.3 * torch.randn(E, generator=g, dtype=torch.float64)
    ids, weights = grouped_topk(logits, top_k=k, num_expert_group=groups, topk_group=topk_group,
                                e_score_correction_bias=bias, renormalize=renormalize, routed_scaling_factor=scale)
    for row, got in zip(logits.tolist(), _as_sets(ids, weights)):
        want_ids, want_w = deepseek_reference(row, bias.tolist(), top_k=k, groups=groups, topk_group=topk_group,
                                              renormalize=renormalize, scale=scale)
        assert sorted(got) == sorted(want_ids)
        assert [got[e] for e in want_ids] == pytest.approx(want_w, rel=1e-6)


def test_experts_of_dropped_groups_are_never_reached_even_when_every_score_is_negative():
    """Two groups of four; the bias makes every biased score negative. Group 0 ranks first, so with
    topk_group=1 all four experts must come from it, never from group 1 (whose masked scores would be
    0.0, above every kept one, under the wrong mask)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    ids, _ = grouped_topk(logits, top_k=4, num_expert_group=2, topk_group=1,
                          e_score_correction_bias=torch.full((8,), -5.0))
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3]


def test_groups_rank_by_their_two_best_biased_scores_and_by_their_best_without_a_bias():
    """Group 0 has the single best expert, group 1 the better pair. vLLM 0.33 ranks groups by the sum
    of their two best scores when a correction bias is given and by their best score otherwise
    (router/grouped_topk_router.py:121-132): group 1 is kept with a (zero) bias, group 0 without."""
    logits = torch.tensor([[4.0, -4.0, -4.0, 2.0, 2.0, -4.0]])
    with_bias, _ = grouped_topk(logits, top_k=2, num_expert_group=2, topk_group=1,
                                e_score_correction_bias=torch.zeros(6))
    without, _ = grouped_topk(logits, top_k=2, num_expert_group=2, topk_group=1)
    assert sorted(with_bias[0].tolist()) == [3, 4]
    assert without[0, 0].item() == 0 and set(without[0].tolist()) <= {0, 1, 2}
