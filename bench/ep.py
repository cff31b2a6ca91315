"""Expert-parallel evidence: EP output == one GPU's, and the cost of dispatch + combine beside NCCL's own.

    python bench/ep.py --out DIR              # --ranks NCCL ranks (default 2) on GPUs 0..N-1, spawned here
    python bench/ep.py --smoke --out DIR      # 2 gloo ranks on the CPU, tiny shapes, same code paths

correctness: for Mixtral-shaped (H=4096, E=8, k=2) and DeepSeek-V3-shaped (H=7168, E=256, k=8)
    layers (intermediate size cut to 512 per expert to keep the weights small; it does not change
    the exchange), each dispatcher (all2all, allgather_reducescatter) and each dispatch mode
    (bf16; FP8 quantised by the dispatcher per token or per 1x128 group; FP8 per token deferred to
    the experts, i.e. bf16 on the wire), every rank runs its shard of the layer on its own tokens
    with the decided GPU experts (triton.fused_moe); rank 0 runs all tokens on one GPU with the
    global weights and reports the relative (Frobenius) error per rank.
exchange: all2all dispatch + combine alone (prepare, including FP8 quantisation, and finalize around
    a preallocated stand-in expert output: the experts are not timed) at M tokens per rank, capacity
    reserved for M, eager and replayed from a CUDA graph; beside it, in the same process, NCCL's raw
    all_to_all_single moving the same buffers (tokens, routing rows, partial outputs: equal splits,
    preallocated), eager and graphed: the ceiling of this design. Each point: warm-up, then the median
    of --iters calls timed with CUDA events back to back (no host sync between calls, so an eager
    time is whatever the slower of host and GPU allows), the slowest rank's median reported.
    buffer_MB = bytes this rank hands to the three collectives (its own rows included: with one
    rank they are all it moves); out_MB = the part bound for other ranks; fill = rows that carry a
    token / rows sent; nccl_over_ours = NCCL's time / ours (1.0: the link's speed).
layer: the whole EP layer (all2all + triton.fused_moe on this rank's experts) against the same layer
    on one GPU (all experts, `local`) on the same M tokens per rank, eager and graphed.
Writes ep_correctness.csv, ep_exchange.csv, ep_layer.csv and ep.md to --out.
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moerules.activation import Activation, Dtype
from moerules.kernels import build_layer, make_random_weights
from moerules.kernels.ep import Comm, Placement, init_distributed, shard_weights
from moerules.kernels.registry import prepare_finalize_class
from moerules.kernels.routing import fused_topk
from moerules.kernels.scheme import TORCH_DTYPE, Scheme, quant_for_cell


@dataclass(frozen=True)
class Shape:
    H: int
    E: int
    k: int
    I: int


MODELS = {"mixtral": Shape(4096, 8, 2, 512), "deepseek-v3": Shape(7168, 256, 8, 512)}
SMOKE_MODELS = {"mixtral-tiny": Shape(256, 8, 2, 128), "deepseek-tiny": Shape(256, 16, 4, 128)}
# name -> (scheme cell, dispatcher quantises?)
MODES = {"unquantized": ("unquantized", True), "fp8_token": ("fp8_w8a8/channel/token", True),
         "fp8_1x128": ("fp8_w8a8/block128/group128", True), "fp8_token_deferred": ("fp8_w8a8/channel/token", False)}
TIMED_MODES = ["unquantized", "fp8_token", "fp8_1x128"]
LAYER_MODES = ["unquantized", "fp8_token"]
DISPATCHERS = ["all2all", "allgather_reducescatter"]
M_LIST = [1, 4, 16, 64, 256, 1024, 4096, 8192]
LAYER_M_LIST = [1, 64, 1024, 8192]
# EP vs one GPU: bf16 partial outputs are rounded before they are summed (~2^-8 per element);
# FP8 adds nothing (per-row scales are identical on both sides).
TOLERANCE = 2e-2


def rank_tokens(shape: Shape, M: int, rank: int, dtype: torch.dtype, device):
    g = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(M, shape.H, generator=g, device=device).to(dtype)
    ids, weights = fused_topk(torch.randn(M, shape.E, generator=g, device=device), top_k=shape.k, renormalize=True)
    return x, ids, weights


def global_layer_weights(shape: Shape, cell: str, in_dtype: Dtype, device):
    return make_random_weights(num_experts=shape.E, hidden=shape.H, intermediate=shape.I, quant=quant_for_cell(cell),
                               in_dtype=in_dtype, has_bias=False, seed=0, device=device)


def correctness(args, rank: int, world: int, device, kernel: str, in_dtype: Dtype) -> list[dict]:
    rows = []
    placement = Placement.contiguous
    for model, shape in args.models.items():
        for mode, (cell, by_dispatcher) in MODES.items():
            common = dict(kernel_id=kernel, quant=quant_for_cell(cell), activation=Activation.silu, in_dtype=in_dtype,
                          activation_format="standard", device=device, defer_input_quant=not by_dispatcher)
            global_weights = global_layer_weights(shape, cell, in_dtype, device)
            single = None
            for pf in DISPATCHERS:
                shard = shard_weights(global_weights, placement(shape.E, world), rank)
                layer = build_layer(prepare_finalize_id=pf, weights=shard, group=dist.group.WORLD,
                                    placement=placement(shape.E, world), **common)
                x, ids, weights = rank_tokens(shape, args.check_tokens, rank, TORCH_DTYPE[in_dtype], device)
                out = layer(x, topk_ids=ids, topk_weights=weights)
                got = [None] * world
                dist.all_gather_object(got, (x.cpu(), ids.cpu(), weights.cpu(), out.cpu()))
                if rank == 0:
                    single = single or build_layer(prepare_finalize_id="local", weights=global_weights, **common)
                    errs = [_rel_err(o, single(xx.to(device), topk_ids=ii.to(device), topk_weights=ww.to(device)))
                            for xx, ii, ww, o in got]
                    row = {"model": model, "dispatcher": pf, "mode": mode, "in_dtype": in_dtype.value,
                           "kernel": kernel, "tokens_per_rank": args.check_tokens, "max_rel_err": max(errs),
                           "ok": max(errs) < TOLERANCE}
                    rows.append(row)
                    print(f"correctness {row}", flush=True)
                dist.barrier()
            del global_weights, single
    return rows


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double().cpu()
    return ((out.double() - want).norm() / want.norm()).item()


def exchange_timing(args, rank: int, world: int, device, in_dtype: Dtype) -> list[dict]:
    comm = Comm(dist.group.WORLD, timeout_s=120)
    rows = []
    for model, shape in args.models.items():
        for mode in TIMED_MODES:
            scheme = Scheme.from_quant(quant_for_cell(MODES[mode][0]))
            for M in args.ms:
                pf = prepare_finalize_class("all2all")(scheme=scheme, comm=comm,
                                                      placement=Placement.contiguous(shape.E, world))
                pf.set_capacity(tokens_per_rank=M)
                x, ids, weights = rank_tokens(shape, M, rank, TORCH_DTYPE[in_dtype], device)
                point = _time_exchange(args, pf, comm, x, ids, weights)
                row = _slowest({"model": model, "H": shape.H, "E": shape.E, "k": shape.k, "ranks": world,
                                "M_per_rank": M, "mode": mode}, point)
                if rank == 0:
                    rows.append(row)
                    print(f"exchange {row}", flush=True)
    return rows


def _time_exchange(args, pf, comm: Comm, x, ids, weights) -> dict:
    """Our dispatch + combine and NCCL's raw all_to_all_single of the same buffers, eager and graphed (µs)."""
    stand_in = []

    def ours():
        prepared = pf.prepare(x, topk_ids=ids, topk_weights=weights, defer_input_quant=False, a13_scale=None)
        if not stand_in:
            stand_in.append(torch.zeros(prepared.hidden_q.shape[0], x.shape[1], dtype=x.dtype, device=x.device))
        return pf.finalize(stand_in[0], prepared=prepared, hidden_size=x.shape[1])

    prepared = pf.prepare(x, topk_ids=ids, topk_weights=weights, defer_input_quant=False, a13_scale=None)
    rows = prepared.hidden_q.shape[0]
    fill = int((prepared.topk_ids >= 0).any(dim=1).sum()) / rows
    buffers = [prepared.hidden_q, pf_routing_like(prepared, rows), torch.zeros(rows, x.shape[1], dtype=x.dtype,
                                                                                  device=x.device)]
    outs = [torch.empty_like(b) for b in buffers]

    def raw():
        for send, recv in zip(buffers, outs):
            dist.all_to_all_single(_as_bytes(recv), _as_bytes(send))

    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)
    times = {(name, graph): _timed(fn, args.iters, graph) for name, fn in (("ours", ours), ("nccl", raw))
             for graph in (False, True)}
    return {"buffer_MB": buffer_bytes / 1e6, "out_MB": buffer_bytes * (comm.size - 1) / comm.size / 1e6,
            "fill": fill, "ours_eager_us": times[("ours", False)], "ours_graph_us": times[("ours", True)],
            "nccl_eager_us": times[("nccl", False)], "nccl_graph_us": times[("nccl", True)]}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 crosses as bytes, as Comm sends it."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def pf_routing_like(prepared, rows: int) -> torch.Tensor:
    """An int32 buffer the size of the routing rows all2all sends: ids and weights (2k), plus the scales."""
    k = prepared.topk_ids.shape[1]
    scale = prepared.a_scale
    scale_cols = 0 if scale is None or scale.numel() == 1 else scale[0].numel()
    return torch.zeros(rows, 2 * k + scale_cols, dtype=torch.int32, device=prepared.topk_ids.device)


def layer_timing(args, rank: int, world: int, device, in_dtype: Dtype) -> list[dict]:
    rows = []
    for model, shape in args.models.items():
        for mode in LAYER_MODES:
            cell, by_dispatcher = MODES[mode]
            common = dict(kernel_id=args.kernel, quant=quant_for_cell(cell), activation=Activation.silu,
                          in_dtype=in_dtype, activation_format="standard", device=device,
                          defer_input_quant=not by_dispatcher)
            global_weights = global_layer_weights(shape, cell, in_dtype, device)
            placement = Placement.contiguous(shape.E, world)
            single = build_layer(prepare_finalize_id="local", weights=global_weights, **common)
            for M in args.layer_ms:
                x, ids, weights = rank_tokens(shape, M, rank, TORCH_DTYPE[in_dtype], device)
                ep = build_layer(prepare_finalize_id="all2all", weights=shard_weights(global_weights, placement, rank),
                                 group=dist.group.WORLD, placement=placement, **common)
                ep.prepare_finalize.set_capacity(tokens_per_rank=M)     # buffers sized for this batch
                point = {f"{name}_{'graph' if graph else 'eager'}_us":
                         _timed(lambda layer=layer: layer(x, topk_ids=ids, topk_weights=weights), args.iters, graph)
                         for name, layer in (("ep", ep), ("one_gpu", single)) for graph in (False, True)}
                row = _slowest({"model": model, "ranks": world, "M_per_rank": M, "mode": mode}, point)
                if rank == 0:
                    rows.append(row)
                    print(f"layer {row}", flush=True)
                del ep
            del single, global_weights
    return rows


def _timed(fn, iters: int, graph: bool) -> Optional[float]:
    """Median µs of `fn` (or of replaying its CUDA graph), CUDA events around each call, no host sync between.
    On the CPU (--smoke): wall-clock per call, and no graphs (None)."""
    dist.barrier()
    if not torch.cuda.is_available():
        return None if graph else _wall_clock_us(fn, iters)
    torch.cuda.synchronize()
    if graph:
        fn = _graph_of(fn)
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3


def _wall_clock_us(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _graph_of(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _slowest(key: dict, point: dict) -> dict:
    """key + every rank's point, times as the slowest rank's (all ranks call this together)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, point)
    row = dict(key)
    for name in point:
        value = max(p[name] for p in every) if name.endswith("_us") and point[name] is not None else point[name]
        row[name] = None if value is None else round(value, 3)
    for how in ("eager", "graph"):
        if row.get(f"ours_{how}_us"):
            row[f"nccl_over_ours_{how}"] = round(row[f"nccl_{how}_us"] / row[f"ours_{how}_us"], 3)
    return row


def rank_main(rank: int, world: int, args, port: int) -> None:
    device = torch.device("cpu") if args.smoke else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    init_distributed(backend="gloo" if args.smoke else "nccl", timeout_s=args.timeout,
                     init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    in_dtype = Dtype.fp32 if args.smoke else Dtype.bf16
    phases = {"correctness": lambda: correctness(args, rank, world, device, args.kernel, in_dtype),
              "exchange": lambda: exchange_timing(args, rank, world, device, in_dtype),
              "layer": lambda: layer_timing(args, rank, world, device, in_dtype)}
    results = {name: run() if args.phase in ("all", name) else [] for name, run in phases.items()}
    if rank == 0:
        write(args, results, device)
    dist.barrier()
    dist.destroy_process_group()


def write(args, results: dict[str, list[dict]], device) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# EP dispatch/combine on {world_desc(args, device)}", ""]
    for name, rows in ((f"ep_{phase}", rows) for phase, rows in results.items()):
        if not rows:
            continue
        with open(out / f"{name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        lines += [f"## {name}", "", "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows] + [""]
    (out / "ep.md").write_text("\n".join(lines))
    print(f"wrote {out / 'ep.md'}", flush=True)


def world_desc(args, device) -> str:
    if device.type == "cuda":
        return f"{args.ranks}x {torch.cuda.get_device_name(device)} (NCCL), torch {torch.__version__}"
    return f"{args.ranks} CPU ranks (gloo), torch {torch.__version__}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results/ep"))
    p.add_argument("--phase", default="all", choices=["all", "correctness", "exchange", "layer"])
    p.add_argument("--smoke", action="store_true", help="2 gloo ranks on the CPU with tiny shapes")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ms", nargs="+", type=int, default=None, help=f"exchange phase (default {M_LIST})")
    p.add_argument("--layer-ms", nargs="+", type=int, default=None, help=f"layer phase (default {LAYER_M_LIST})")
    p.add_argument("--iters", type=int, default=None, help="timed calls per point (default 50; smoke 3)")
    p.add_argument("--check-tokens", type=int, default=None, help="tokens per rank in the correctness phase")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    args = p.parse_args(argv)
    args.models = SMOKE_MODELS if args.smoke else MODELS
    args.ms = args.ms or ([4, 32] if args.smoke else M_LIST)
    args.layer_ms = args.layer_ms or ([4] if args.smoke else LAYER_M_LIST)
    args.iters = args.iters or (3 if args.smoke else 50)
    args.kernel = "torch.reference" if args.smoke else "triton.fused_moe"
    args.check_tokens = args.check_tokens or (16 if args.smoke else 256)
    if not args.smoke and torch.cuda.device_count() < args.ranks:
        print(f"needs {args.ranks} GPUs, found {torch.cuda.device_count()}; use --smoke on a CPU", file=sys.stderr)
        return 2
    mp.spawn(rank_main, args=(args.ranks, args, _free_port()), nprocs=args.ranks, join=True)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
