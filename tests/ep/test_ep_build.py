"""Placement, weight sharding, experts with remote (-1) slots, and the build refusals of EP layers."""

from __future__ import annotations

import re

import pytest
import torch

from moerules import build, decide
from moerules.activation import Activation, Dtype
from moerules.config import MoEConfig
from moerules.errors import KernelUnavailableError
from moerules.kernels import KernelBuildError, build_layer, make_random_weights
from moerules.kernels.ep import Placement, PlacementError, shard_weights
from moerules.kernels.interfaces import STANDARD
from moerules.kernels.prepare_finalize import LocalPrepareFinalize
from moerules.kernels.reference import moe_reference
from moerules.kernels.routing import fused_topk
from moerules.kernels.scheme import TORCH_DTYPE, quant_for_cell

from ep_cases import Case, build_error, case_from_decision

CPU = {"vendor": "cpu", "arch": "x86_64", "packages": []}


def weights(cell="unquantized", *, E=8, H=128, I=256, bias=True, dtype=Dtype.fp32, seed=0):
    return make_random_weights(num_experts=E, hidden=H, intermediate=I, quant=quant_for_cell(cell), in_dtype=dtype,
                               has_bias=bias, seed=seed, device="cpu")


# -- placement -------------------------------------------------------------------------------
def test_expert_maps_send_remote_experts_to_minus_one():
    contiguous, round_robin = Placement.contiguous(8, 2), Placement.round_robin(8, 2)
    assert contiguous.expert_map(0).tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    assert contiguous.expert_map(1).tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert round_robin.expert_map(1).tolist() == [-1, 0, -1, 1, -1, 2, -1, 3]
    assert round_robin.local_experts(1) == [1, 3, 5, 7] and contiguous.local_experts(1) == [4, 5, 6, 7]
    for p in (contiguous, round_robin, Placement.round_robin(12, 4)):
        owner, local = p.owner(), p.local_index()
        for rank in range(p.num_ranks):
            assert [int(e) for e in (owner == rank).nonzero()] == sorted(p.local_experts(rank))
            assert [int(local[e]) for e in p.local_experts(rank)] == list(range(p.num_local_experts))
    assert Placement.tensor(8, 2).expert_map(1).tolist() == list(range(8))


def test_uneven_expert_placement_is_refused_with_the_fix():
    with pytest.raises(PlacementError, match=re.escape(
            "6 experts do not split evenly over 4 ranks (no rule allows uneven expert placement); use a rank count "
            "that divides 6 (1, 2, 3, 6) or turn expert parallelism off to tensor-shard the experts instead")):
        Placement.contiguous(6, 4).check()


# -- sharding --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["contiguous", "round_robin"])
@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a8/block128/group128", "fp8_w8a8/channel/token"])
def test_expert_shards_are_the_global_experts_in_local_order(kind, cell):
    w = weights(cell)
    placement = Placement(kind, 8, 4)
    for rank in range(4):
        shard = shard_weights(w, placement, rank)
        idx = placement.local_experts(rank)
        names = ["w13", "w2", "w13_bias", "w2_bias"] + (["w13_scale", "w2_scale"] if cell != "unquantized" else [])
        for name in names:
            assert torch.equal(_bits(getattr(shard, name)), _bits(getattr(w, name)[idx])), name


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Comparable bits: torch.equal has no FP8 kernels."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize("cell,activation", [("unquantized", Activation.silu), ("fp8_w8a16/channel", Activation.silu),
                                             ("fp8_w8a16/block128", Activation.swigluoai),
                                             ("fp8_w8a16/tensor", Activation.gelu)])
def test_tensor_shards_sum_to_the_global_layer_with_the_w2_bias_once(cell, activation):
    """Weight-only schemes keep activations unquantised, so the slices' partial outputs add up exactly
    (in float64) to the global layer's: every gate/up row, w2 column, scale and bias went to one rank."""
    w = weights(cell, I=512)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 128, generator=g)
    ids, tw = fused_topk(torch.randn(7, 8, generator=g), top_k=3, renormalize=True)
    expected = moe_reference(x, weights=w, topk_ids=ids, topk_weights=tw, a_scale=None, activation=activation,
                             compute_dtype=torch.float64)
    placement = Placement.tensor(8, 4)
    shards = [shard_weights(w, placement, r, activation=activation) for r in range(4)]
    assert [s.intermediate for s in shards] == [128] * 4
    assert torch.equal(shards[0].w2_bias, w.w2_bias) and all(not s.w2_bias.any() for s in shards[1:])
    total = sum(moe_reference(x, weights=s, topk_ids=ids, topk_weights=tw, a_scale=None, activation=activation,
                              compute_dtype=torch.float64) for s in shards)
    assert ((total - expected).norm() / expected.norm()).item() < 1e-12


def test_sharding_refusals():
    with pytest.raises(PlacementError, match=r"block128 weights: each rank's intermediate slice \(256/4 = 64\) must "
                                             r"be a multiple of 128"):
        shard_weights(weights("fp8_w8a16/block128"), Placement.tensor(8, 4), 0, activation=Activation.silu)
    with pytest.raises(PlacementError, match="tensor sharding needs activation="):
        shard_weights(weights(), Placement.tensor(8, 2), 0)
    with pytest.raises(PlacementError, match="the weights hold 8 experts but the placement is for 16"):
        shard_weights(weights(), Placement.contiguous(16, 2), 0)


# -- experts given -1 ids (remote experts): those slots add nothing, nothing unwritten is read --
class _RemoteIds(LocalPrepareFinalize):
    @property
    def remote_expert_ids(self) -> bool:
        return True


def _with_remote_slots(layer):
    layer.experts.bind(_RemoteIds(scheme=layer.prepare_finalize.scheme))
    return layer


GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# Triton on CPU runs in the interpreter, whose tl.dot is wrong for bf16: fp16 there, bf16 on a GPU.
TRITON_DTYPE = Dtype.bf16 if GPU else Dtype.fp16
# torch._grouped_mm: bf16 on CUDA (sm90+), torch's fallback on CPU.
GROUPED_DTYPE = Dtype.bf16 if GPU else Dtype.fp32


@pytest.mark.parametrize("kernel,cell,dtype", [
    ("torch.reference", "fp8_w8a8/channel/token", Dtype.bf16),
    ("torch.grouped_mm", "unquantized", GROUPED_DTYPE),
    # A NaN-poisoned torch.empty in the launcher catches rows the kernels never wrote.
    ("triton.fused_moe", "unquantized", TRITON_DTYPE),
    ("triton.fused_moe", "fp8_w8a8/channel/token", TRITON_DTYPE),
])
@pytest.mark.parametrize("T,E", [(9, 4), (2, 64)])  # sorted blocks; the naive assignment (4*T*k <= E, align.py)
def test_experts_give_remote_slots_zero(kernel, cell, dtype, T, E, monkeypatch):
    if kernel == "triton.fused_moe":
        _poison_triton_empty(monkeypatch)
    H, I = 64, 32
    device = "cpu" if kernel == "torch.reference" else DEVICE
    w = make_random_weights(num_experts=E, hidden=H, intermediate=I, quant=quant_for_cell(cell), in_dtype=dtype,
                            has_bias=True, seed=0, device=device)
    layer = _with_remote_slots(build_layer(kernel_id=kernel, prepare_finalize_id="local", quant=quant_for_cell(cell),
                                           activation=Activation.silu, in_dtype=dtype, activation_format=STANDARD,
                                           weights=w, device=device))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).to(TORCH_DTYPE[dtype]).to(device)
    ids, tw = fused_topk(torch.randn(T, E, generator=g), top_k=2, renormalize=True)
    remote = torch.rand(T, 2, generator=g) < 0.4
    ids, tw, remote = ids.to(device), tw.to(device), remote.to(device)
    remote[0] = True                                       # a token with no local expert at all
    ids_with_remote = torch.where(remote, -1, ids)
    p = layer.prepare_finalize.prepare(x, topk_ids=ids, topk_weights=tw, defer_input_quant=False,
                                       a13_scale=None)
    out = layer.experts.apply(p.hidden_q, weights=layer.weights, topk_ids=ids_with_remote, topk_weights=tw,
                              a_scale=p.a_scale)
    # Expected: the same slots on a valid expert with weight 0 contribute exactly nothing (per-row scales).
    expected = moe_reference(p.hidden_q, weights=layer.weights, topk_ids=torch.where(remote, 0, ids),
                             topk_weights=torch.where(remote, 0.0, tw), a_scale=p.a_scale,
                             activation=Activation.silu, compute_dtype=torch.float64)
    assert torch.isfinite(out).all(), "a remote slot's unwritten row reached the output"
    assert not out[0].any(), "a token whose experts are all remote must get exactly zero"
    err = ((out.double() - expected).norm() / expected.norm()).item()
    assert err < (1e-5 if dtype == Dtype.fp32 else 2e-2), err   # fp16/bf16 output rounding


def _poison_triton_empty(monkeypatch):
    from moerules.kernels.triton import launch
    real_empty = torch.empty

    class _Torch:
        def __getattr__(self, name):
            if name == "empty":
                return lambda *a, **k: (lambda t: t.fill_(float("nan")) if t.is_floating_point() else t)(
                    real_empty(*a, **k))
            return getattr(torch, name)
    monkeypatch.setattr(launch, "torch", _Torch())


# -- build refusals on one process -----------------------------------------------------------
def _build(**overrides):
    args = dict(kernel_id="torch.reference", prepare_finalize_id="all2all", quant=quant_for_cell("unquantized"),
                activation=Activation.silu, in_dtype=Dtype.fp32, activation_format=STANDARD,
                weights=weights(E=4, bias=False), device="cpu")
    args.update(overrides)
    return build_layer(**args)


def test_a_token_exchanging_dispatcher_never_runs_without_a_group():
    for pf in ("all2all", "allgather_reducescatter"):
        with pytest.raises(KernelBuildError, match=f"^{pf}: this dispatcher exchanges tokens between ranks and needs "
                                                   "a torch.distributed process group: pass group="):
            _build(prepare_finalize_id=pf)


def test_sharded_weights_never_run_without_the_group_that_completes_them():
    with pytest.raises(KernelBuildError, match=r"^local: placement= shards the experts over 2 ranks but no group= was "
                                               r"given; without the group the other ranks' share"):
        _build(prepare_finalize_id="local", placement=Placement.contiguous(8, 2))
    with pytest.raises(KernelBuildError, match="^all2all: a process group was given without placement="):
        _build(group=object())
    with pytest.raises(KernelBuildError, match="^all2all: 8 experts do not split evenly over 3 ranks"):
        _build(group=object(), placement=Placement.contiguous(8, 3))
    with pytest.raises(KernelBuildError, match="^all2all: torch.distributed is not initialised"):
        _build(group=object(), placement=Placement.contiguous(8, 2))


def _ep_decision(**parallel):
    return decide(MoEConfig(model=dict(num_experts=8, top_k=2, hidden_size=64, moe_intermediate_size=128,
                                       in_dtype="fp32"), parallel=parallel, platform=CPU))


def test_moerules_build_of_a_multi_rank_decision_needs_the_group():
    decision = _ep_decision(dp=2, expert_parallel=True, all2all_backend="torch_all2all")
    with pytest.raises(KernelUnavailableError, match=re.escape(
            "this decision spans 2 ranks (tp=1, dp=2, expert_parallel=True, dispatcher torch_all2all): pass group= "
            "(the torch.distributed process group of those 2 ranks) and this rank's weight shard")):
        build(decision, weights(E=4, H=64, I=128, bias=False))
    local = _ep_decision(tp=2, expert_parallel=True)   # TP+EP, dp=1: 'local', which must all-reduce
    assert local.prepare_finalize_kernel == "local"
    with pytest.raises(KernelUnavailableError, match="this decision spans 2 ranks"):
        build(local, weights(E=4, H=64, I=128, bias=False))
    with pytest.raises(KernelUnavailableError, match=re.escape(
            "placement contiguous of 8 experts over 2 ranks does not fit this decision (tp=2, dp=1, "
            "expert_parallel=False, dispatcher local, 8 experts over 2 ranks): use placement_for(decision) (tensor)")):
        build(_ep_decision(tp=2), weights(E=4, H=64, I=64, bias=False), group=object(),
              placement=Placement.contiguous(8, 2))
    with pytest.raises(KernelUnavailableError, match=re.escape(
            "the weights' intermediate size is 128 but each rank of this decision holds 64; pass this rank's shard")):
        build(_ep_decision(tp=2), weights(E=8, H=64, I=128, bias=False), group=object())
    single = _ep_decision()
    with pytest.raises(KernelUnavailableError, match=r"this decision is for one device"):
        build(single, weights(E=8, H=64, I=128, bias=False), group=object())


# -- build refusals over a real 2-rank group -------------------------------------------------
REFUSALS = {
    "batched needs round robin": (
        Case(pf="all2all_batched", placement="contiguous", kernel="torch.batched_reference"),
        "KernelBuildError: all2all_batched: the batched activation format needs round_robin expert placement "
        "(expert e on rank e % ranks, vLLM's round-robin routing tables), got contiguous; shard with "
        "Placement.round_robin(num_experts, ranks)"),
    "all2all needs whole experts": (
        Case(pf="all2all", placement="tensor"),
        "KernelBuildError: all2all: this dispatcher sends each token to the ranks owning its experts, so it needs "
        "whole experts per rank (contiguous or round_robin placement), not the tensor placement; tensor-sharded "
        "experts use 'local' (same tokens on every rank) or 'allgather_reducescatter'"),
    "group size": (
        Case(pf="all2all", placement_ranks=4),
        "KernelBuildError: all2all: the process group has 2 ranks but the placement spreads the experts over 4; "
        "build the placement for the group's size"),
    "global weights instead of a shard": (
        Case(pf="allgather_reducescatter", shard=False),
        "KernelBuildError: allgather_reducescatter: the weights hold 8 experts but the placement gives rank {rank} 4; "
        "pass this rank's shard: shard_weights(global_weights, placement, rank={rank})"),
}


@pytest.mark.parametrize("case,message", REFUSALS.values(), ids=REFUSALS.keys())
def test_build_refusals_over_a_group(pool2, case, message):
    assert pool2.run(build_error, case) == [message.format(rank=r) for r in range(2)]


def test_a_decision_for_four_ranks_is_refused_on_a_two_rank_group(pool2):
    case = case_from_decision(_ep_decision(dp=4, expert_parallel=True, all2all_backend="torch_all2all"),
                              tokens=(2, 2), seed=0)
    assert pool2.run(build_error, case) == [
        "KernelUnavailableError: cannot build torch_reference behind torch_all2all: all2all: the process group has 2 "
        "ranks but the placement spreads the experts over 4; build the placement for the group's size"] * 2

