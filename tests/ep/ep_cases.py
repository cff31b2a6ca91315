"""What the ranks of the EP tests run, and the single-device twin the test process compares with.

A `Case` fixes a layer (scheme, sizes, seed), a dispatcher and placement, and each rank's
tokens. `ep_forward` runs on every rank of a RankPool: it shards the seeded global weights,
builds this rank's layer over the gloo group and returns its output, what crossed the wire
and how often the activations were quantised. `single_device` computes the same tokens on one
device with the global weights (`local`, torch.reference), per rank.

The batched cases run `torch.batched_reference` experts behind `all2all_batched`.

Test-only kernel, registered in the ranks only:
  test.keep_local  the seed-001 bug: a dispatcher that keeps every token on its rank, so each
                   rank computes only its own experts and nothing is exchanged or reduced
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import moerules
from moerules.activation import Activation, Dtype
from moerules.decision import Decision
from moerules.kernels import build_layer, make_random_weights
from moerules.kernels.ep import CollectiveError, Placement, PlacementKind, init_distributed, shard_weights
from moerules.kernels.interfaces import STANDARD
from moerules.kernels.prepare_finalize import LocalPrepareFinalize
from moerules.kernels.reference import moe_reference
from moerules.kernels.registry import PREPARE_FINALIZE, PrepareFinalizeSpec
from moerules.kernels.routing import fused_topk
from moerules.kernels.scheme import TORCH_DTYPE, Scheme, quant_for_cell


@dataclass(frozen=True)
class Case:
    pf: str = "all2all"
    placement: str = "contiguous"
    kernel: str = "torch.reference"
    cell: str = "unquantized"
    dtype: str = "fp32"
    defer: bool = False
    E: int = 8
    H: int = 128
    I: int = 256
    k: int = 2
    activation: str = "silu"
    bias: bool = False
    tokens: tuple = (5, 3)          # per rank; a replicated case gives every rank tokens[0] identical tokens
    replicated: bool = False
    route: str = "random"           # "rank0_experts": every token picks experts of rank 0 only
    seed: int = 0
    decision: Optional[str] = None  # a Decision's JSON: build through moerules.build instead of build_layer
    placement_ranks: Optional[int] = None   # build-refusal cases: a placement for another group size
    shard: bool = True                      # build-refusal cases: False hands every rank the global weights
    timeout_s: float = 30.0                 # the collective timeout of the rank's layer

    @property
    def world(self) -> int:
        return len(self.tokens)

    def placement_obj(self) -> Placement:
        return Placement(PlacementKind(self.placement), self.E, self.placement_ranks or self.world)


def case_from_decision(decision: Decision, *, tokens: tuple, seed: int) -> Case:
    """The case a decision describes; the ranks build it with moerules.build(decision, ...)."""
    from moerules.kernels.builder import placement_for
    c = decision.config
    return Case(pf=decision.prepare_finalize_kernel, placement=placement_for(decision).kind.value,
                kernel=decision.kernel, cell=Scheme.from_quant(c.quant).cell, dtype=c.model.in_dtype.value,
                defer=decision.quant.defer_input_quant, E=c.model.num_experts, H=c.model.hidden_size,
                I=c.model.moe_intermediate_size, k=c.model.top_k, activation=c.model.activation.value,
                bias=c.model.has_bias, tokens=tokens, replicated=c.parallel.dp == 1, seed=seed,
                decision=decision.to_json())


def global_weights(case: Case):
    return make_random_weights(num_experts=case.E, hidden=case.H, intermediate=case.I,
                               quant=quant_for_cell(case.cell), in_dtype=Dtype(case.dtype), has_bias=case.bias,
                               seed=case.seed, device="cpu")


def rank_inputs(case: Case, rank: int):
    """This rank's tokens, topk ids and weights (identical on every rank for replicated cases)."""
    source = 0 if case.replicated else rank
    g = torch.Generator().manual_seed(1000 * case.seed + source + 1)
    T = case.tokens[source]
    x = torch.randn(T, case.H, generator=g).to(TORCH_DTYPE[Dtype(case.dtype)])
    logits = torch.randn(T, case.E, generator=g)
    if case.route == "rank0_experts":
        keep = torch.zeros(case.E, dtype=torch.bool)
        keep[case.placement_obj().local_experts(0)] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    ids, weights = fused_topk(logits, top_k=case.k, renormalize=True)
    return x, ids, weights


# -- on the ranks ---------------------------------------------------------------------------
def register_test_kernels() -> None:
    PREPARE_FINALIZE["test.keep_local"] = PrepareFinalizeSpec("test.keep_local", "ep_cases:KeepLocalDispatcher",
                                                              STANDARD)


def build_rank_layer(case: Case, rank: int):
    register_test_kernels()
    weights = global_weights(case)
    if case.decision:
        decision = Decision.model_validate_json(case.decision)
        from moerules.kernels.builder import placement_for
        shard = shard_weights(weights, placement_for(decision), rank, activation=Activation(case.activation))
        return moerules.build(decision, shard, group=dist.group.WORLD, timeout_s=case.timeout_s)
    placement = case.placement_obj()
    shard = shard_weights(weights, placement, rank, activation=Activation(case.activation)) if case.shard else weights
    return build_layer(kernel_id=case.kernel, prepare_finalize_id=case.pf, quant=quant_for_cell(case.cell),
                       activation=Activation(case.activation), in_dtype=Dtype(case.dtype),
                       activation_format=PREPARE_FINALIZE[case.pf].activation_format, weights=shard, device="cpu",
                       defer_input_quant=case.defer, group=dist.group.WORLD, placement=placement,
                       timeout_s=case.timeout_s)


def ep_forward(case: Case) -> dict:
    """This rank's output of the case, the wire trace and where activations were quantised."""
    return forward_built(case, build_rank_layer(case, dist.get_rank()))


def forward_built(case: Case, layer) -> dict:
    rank = dist.get_rank()
    x, ids, weights = rank_inputs(case, rank)
    layer.prepare_finalize.comm.trace = []
    with count_quantizations() as calls:
        out = layer(x, topk_ids=ids, topk_weights=weights)
    wire = [(r.op, r.what, str(r.dtype).replace("torch.", ""), r.shape) for r in layer.prepare_finalize.comm.trace]
    return {"out": out, "wire": wire, "quantized_in": list(calls)}


class count_quantizations:
    """Records every activation quantisation by the dispatcher ('prepare') or the experts ('experts')."""

    def __enter__(self) -> list:
        import moerules.kernels.interfaces as experts_side
        import moerules.kernels.prepare_finalize as dispatcher_side
        self.calls: list[str] = []
        self.patched = [(dispatcher_side, "quantize_activation", "prepare"),
                        (experts_side, "quantize_activation", "experts"),
                        (experts_side, "quantize_activation_batched", "experts")]
        self.originals = [getattr(module, name) for module, name, _ in self.patched]
        for module, name, where in self.patched:
            setattr(module, name, self._counting(getattr(module, name), where))
        return self.calls

    def _counting(self, function, where: str):
        def counted(*args, **kwargs):
            self.calls.append(where)
            return function(*args, **kwargs)
        return counted

    def __exit__(self, *exc) -> None:
        for (module, name, _), original in zip(self.patched, self.originals):
            setattr(module, name, original)


def fail_or_forward(case: Case, failing_rank: int, how: str) -> dict:
    """The failing rank raises ("raise") or exits ("exit") before its forward; the others report the
    error they got and how long it took."""
    layer = build_rank_layer(case, dist.get_rank())   # building is collective too (the fingerprint)
    if dist.get_rank() == failing_rank:
        if how == "exit":
            os._exit(3)
        raise RuntimeError("injected failure on this rank before the MoE forward")
    start = time.monotonic()
    try:
        forward_built(case, layer)
    except CollectiveError as error:
        return {"error": str(error), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def build_error(case: Case) -> str:
    """The message of the KernelBuildError this rank's build raises ('' if it builds)."""
    from moerules.errors import KernelUnavailableError
    from moerules.kernels import KernelBuildError
    try:
        build_rank_layer(case, dist.get_rank())
    except (KernelBuildError, KernelUnavailableError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def join_alone(port: int, timeout_s: float) -> dict:
    """Rank 0 of a 2-rank group whose rank 1 never starts: init must fail within the timeout."""
    start = time.monotonic()
    try:
        init_distributed(backend="gloo", timeout_s=timeout_s, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                         world_size=2)
    except CollectiveError as error:
        return {"error": str(error), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


# -- in the test process --------------------------------------------------------------------
def single_device(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per rank: the single-device output of the same layer on the same tokens, and its float64 reference."""
    layer = build_layer(kernel_id="torch.reference", prepare_finalize_id="local", quant=quant_for_cell(case.cell),
                        activation=Activation(case.activation), in_dtype=Dtype(case.dtype),
                        activation_format=STANDARD, weights=global_weights(case), device="cpu",
                        defer_input_quant=case.defer)
    inputs = [rank_inputs(case, r) for r in range(1 if case.replicated else case.world)]
    x, ids, weights = (torch.cat(parts) for parts in zip(*inputs))
    out = layer(x, topk_ids=ids, topk_weights=weights)
    p = layer.prepare_finalize.prepare(x, topk_ids=ids, topk_weights=weights, defer_input_quant=False,
                                       a13_scale=layer.weights.a13_scale)
    ref = moe_reference(p.hidden_q, weights=layer.weights, topk_ids=ids, topk_weights=weights, a_scale=p.a_scale,
                        activation=layer.experts.activation, compute_dtype=torch.float64)
    if case.replicated:
        return [out] * case.world, [ref] * case.world
    sizes = list(case.tokens)
    return list(out.split(sizes)), list(ref.split(sizes))


# -- test-only kernels ----------------------------------------------------------------------
class KeepLocalDispatcher(LocalPrepareFinalize):
    """The seed-001 regression: every rank keeps its tokens and runs only its own experts."""

    def combine(self, expert_out, *, prepared):
        return expert_out



def outcome_of_rank_case(cases: tuple) -> dict:
    """Rank r runs cases[r] (ranks that disagree); its output, or the error it ended in."""
    try:
        return {"error": None, "out": ep_forward(cases[dist.get_rank()])["out"]}
    except Exception as error:  # noqa: BLE001 - every outcome goes back to the test, which checks its type
        return {"error": f"{type(error).__name__}: {error}"}


def capacity_outcome(case: Case, tokens_per_rank: int, rows_per_peer: Optional[int]) -> dict:
    """This rank's output with exchange buffers reserved by set_capacity, or the CapacityError it ended in."""
    from moerules.kernels.ep import CapacityError
    layer = build_rank_layer(case, dist.get_rank())
    layer.prepare_finalize.set_capacity(tokens_per_rank=tokens_per_rank, rows_per_peer=rows_per_peer)
    x, ids, weights = rank_inputs(case, dist.get_rank())
    try:
        return {"error": None, "out": layer(x, topk_ids=ids, topk_weights=weights)}
    except CapacityError as error:
        return {"error": str(error), "out": None}


def collectives_of_forwards(case: Case, forwards: int) -> list[list[str]]:
    """Per forward of one layer: the collectives it issued ('op what'), in order."""
    layer = build_rank_layer(case, dist.get_rank())
    comm = layer.prepare_finalize.comm
    issued: list[str] = []
    run = comm._run
    comm._run = lambda op, what, start: (issued.append(f"{op} {what}"), run(op, what, start))[1]
    x, ids, weights = rank_inputs(case, dist.get_rank())
    per_forward = []
    for _ in range(forwards):
        issued.clear()
        layer(x, topk_ids=ids, topk_weights=weights)
        per_forward.append(list(issued))
    return per_forward


def overflow_without_report(case: Case, tokens_per_rank: int, rows_per_peer: int) -> dict:
    """The output of a forward whose end-of-forward report is switched off, then check_capacity()'s error."""
    from moerules.kernels.ep import CapacityError
    layer = build_rank_layer(case, dist.get_rank())
    pf = layer.prepare_finalize
    pf.set_capacity(tokens_per_rank=tokens_per_rank, rows_per_peer=rows_per_peer)
    pf.capacity.report = lambda comm: None
    x, ids, weights = rank_inputs(case, dist.get_rank())
    out = layer(x, topk_ids=ids, topk_weights=weights)
    try:
        pf.check_capacity()
    except CapacityError as error:
        return {"out": out, "error": str(error)}
    return {"out": out, "error": None}
