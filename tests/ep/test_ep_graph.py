"""The whole MoE layer under EP, captured in a CUDA graph and replayed (GPU only; NCCL ranks).

Runs on min(2, GPUs) NCCL ranks: each rank builds its shard of a bf16 layer (triton.fused_moe
behind all2all), runs one eager forward (which agrees on the exchange capacity), captures a
forward in a CUDA graph, copies new tokens into the captured inputs and replays. The replay must
equal an eager forward of the new tokens, and one GPU's output of the global layer on them. A
capacity too small for the routing must still be reported after replays: NaN rows and a
CapacityError from check_capacity().
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from rank_pool import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs of the EP layer need a GPU")
E, H, I, K, M = 8, 256, 256, 2, 32


def _inputs(rank: int, step: int, device):
    from moerules.kernels.routing import fused_topk
    g = torch.Generator(device=device).manual_seed(1000 * step + rank)
    x = torch.randn(M, H, generator=g, device=device).to(torch.bfloat16)
    ids, weights = fused_topk(torch.randn(M, E, generator=g, device=device), top_k=K, renormalize=True)
    return x, ids, weights


def _layer(pf_id: str, weights, **ep):
    from moerules.activation import Activation, Dtype
    from moerules.kernels import build_layer
    from moerules.kernels.scheme import quant_for_cell
    return build_layer(kernel_id="triton.fused_moe", prepare_finalize_id=pf_id, quant=quant_for_cell("unquantized"),
                       activation=Activation.silu, in_dtype=Dtype.bf16, activation_format="standard",
                       weights=weights, device=weights.device, **ep)


def _captured(layer, x, ids, weights):
    """(graph, static inputs, static output) of one forward, after a warm-up on the capture stream."""
    static = [t.clone() for t in (x, ids, weights)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static[0], topk_ids=static[1], topk_weights=static[2])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static[0], topk_ids=static[1], topk_weights=static[2])
    return graph, static, out


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    from moerules.kernels.ep import init_distributed
    try:
        torch.cuda.set_device(rank)
        init_distributed(backend="nccl", timeout_s=60, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                         world_size=world)
        results.put((rank, {"error": None, **_replays(rank, world)}))
        dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 - every failure goes back to the test
        results.put((rank, {"error": f"{type(error).__name__}: {error}"}))


def _replays(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moerules.activation import Dtype
    from moerules.kernels import make_random_weights
    from moerules.kernels.ep import CapacityError, Placement, shard_weights
    from moerules.kernels.scheme import quant_for_cell
    device = torch.device("cuda", rank)
    global_w = make_random_weights(num_experts=E, hidden=H, intermediate=I, quant=quant_for_cell("unquantized"),
                                   in_dtype=Dtype.bf16, has_bias=False, seed=0, device=device)
    placement = Placement.contiguous(E, world)

    def ep_layer():
        return _layer("all2all", shard_weights(global_w, placement, rank), group=dist.group.WORLD,
                      placement=placement, timeout_s=60)

    layer, first = ep_layer(), _inputs(rank, 0, device)
    layer(first[0], topk_ids=first[1], topk_weights=first[2])        # the eager forward that agrees on capacity
    graph, static, out = _captured(layer, *first)
    steps = {}
    for step in (1, 2):
        new = _inputs(rank, step, device)
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        eager = layer(new[0], topk_ids=new[1], topk_weights=new[2])
        single = _layer("local", global_w)(new[0], topk_ids=new[1], topk_weights=new[2])
        steps[step] = (_rel(out, eager), _rel(out, single))
    small = ep_layer()
    small.prepare_finalize.set_capacity(tokens_per_rank=M, rows_per_peer=2)
    small.prepare_finalize.capacity.report = lambda comm: None     # only check_capacity() reports here
    small(first[0], topk_ids=first[1], topk_weights=first[2])
    graph, _, small_out = _captured(small, *first)
    with pytest.raises(CapacityError):
        small.prepare_finalize.check_capacity()    # the eager forward and the warm-up overflowed; count cleared
    graph.replay()
    try:
        small.prepare_finalize.check_capacity()
        overflow = None
    except CapacityError as error:
        overflow = str(error)
    return {"steps": steps, "overflow": overflow, "nan_rows": int(torch.isnan(small_out).any(dim=1).sum())}


def test_the_ep_layer_is_captured_in_a_cuda_graph_and_replays_exactly():
    world = min(2, torch.cuda.device_count())
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    reports = dict(results.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    for rank, report in sorted(reports.items()):
        assert report["error"] is None, (rank, report["error"])
        for step, (vs_eager, vs_single) in report["steps"].items():
            assert vs_eager < 1e-6, (rank, step, vs_eager)        # the replay is the eager computation
            assert vs_single < 1.5e-2, (rank, step, vs_single)    # bf16 partial sums, as in the CPU tests
        assert report["overflow"] is not None and "rows per peer" in report["overflow"], report
        assert report["nan_rows"] > 0
