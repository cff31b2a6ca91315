"""Expert-parallel evidence on 2 GPUs: EP output == one GPU's, and the cost of dispatch + combine.

    python bench/ep.py --out DIR              # 2 ranks over NCCL on GPUs 0 and 1 (spawned here)
    python bench/ep.py --smoke --out DIR      # 2 gloo ranks on the CPU, tiny shapes, same code paths

correctness: for Mixtral-shaped (H=4096, E=8, k=2) and DeepSeek-V3-shaped (H=7168, E=256, k=8)
    layers (intermediate size cut to 512 per expert to keep the weights small; it does not change
    the exchange), each dispatcher (all2all, allgather_reducescatter) and each dispatch mode
    (bf16; FP8 quantised by the dispatcher per token or per 1x128 group; FP8 per token deferred to
    the experts, i.e. bf16 on the wire), every rank runs its shard of the layer on its own tokens
    with the decided GPU experts (triton.fused_moe); rank 0 runs all tokens on one GPU with the
    global weights and reports the relative (Frobenius) error per rank.
timing: dispatch + combine alone (prepare, including FP8 quantisation, and finalize around a
    stand-in expert output of the right shape: the experts are not timed) at M tokens per rank,
    M in {64, 1024, 8192}. Each point: warm-up, then the median of --iters timed calls, CUDA
    synchronised before and after (the exchanges sync on their split sizes anyway), the slowest
    rank's median reported. bytes = what this rank sends to the other rank (tokens, scales, top-k
    metadata, partial outputs: the Comm trace, own rows excluded); GB/s = bytes / time.
Writes ep_correctness.csv, ep_timing.csv and ep.md to --out.
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
DISPATCHERS = ["all2all", "allgather_reducescatter"]
M_LIST = [64, 1024, 8192]
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


def timing(args, rank: int, world: int, device, in_dtype: Dtype) -> list[dict]:
    comm = Comm(dist.group.WORLD, timeout_s=120)
    rows = []
    for model, shape in args.models.items():
        for mode in TIMED_MODES:
            cell, _ = MODES[mode]
            scheme = Scheme.from_quant(quant_for_cell(cell))
            for pf_id in DISPATCHERS:
                pf = prepare_finalize_class(pf_id)(scheme=scheme, comm=comm,
                                                   placement=Placement.contiguous(shape.E, world))
                for M in args.ms:
                    x, ids, weights = rank_tokens(shape, M, rank, TORCH_DTYPE[in_dtype], device)
                    ms, sent = _time_exchange(pf, comm, x, ids, weights, args.iters, device)
                    medians = [None] * world
                    dist.all_gather_object(medians, (ms, sent))
                    if rank == 0:
                        slowest = max(m for m, _ in medians)
                        row = {"model": model, "H": shape.H, "E": shape.E, "k": shape.k, "M_per_rank": M,
                               "dispatcher": pf_id, "mode": mode, "in_dtype": in_dtype.value, "ms": round(slowest, 4),
                               "MB_out_per_rank": round(max(s for _, s in medians) / 1e6, 3),
                               "GB_per_s": round(max(s for _, s in medians) / (slowest * 1e-3) / 1e9, 2)}
                        rows.append(row)
                        print(f"timing {row}", flush=True)
    return rows


def _time_exchange(pf, comm: Comm, x, ids, weights, iters: int, device) -> tuple[float, int]:
    """Median ms of prepare + finalize (a zero expert output in between) and the bytes sent per call."""
    def once():
        prepared = pf.prepare(x, topk_ids=ids, topk_weights=weights, defer_input_quant=False, a13_scale=None)
        expert_out = torch.zeros(prepared.hidden_q.shape[0], x.shape[1], dtype=x.dtype, device=device)
        return pf.finalize(expert_out, prepared=prepared, hidden_size=x.shape[1])

    for _ in range(3):
        once()
    comm.trace = []
    once()
    sent = sum(r.bytes_out for r in comm.trace)
    comm.trace = None
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        once()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), sent


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_main(rank: int, world: int, args, port: int) -> None:
    device = torch.device("cpu") if args.smoke else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    init_distributed(backend="gloo" if args.smoke else "nccl", timeout_s=args.timeout,
                     init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    kernel = "torch.reference" if args.smoke else "triton.fused_moe"
    in_dtype = Dtype.fp32 if args.smoke else Dtype.bf16
    checked = correctness(args, rank, world, device, kernel, in_dtype) if args.phase in ("all", "correctness") else []
    timed = timing(args, rank, world, device, in_dtype) if args.phase in ("all", "timing") else []
    if rank == 0:
        write(args, checked, timed, device)
    dist.barrier()
    dist.destroy_process_group()


def write(args, checked: list[dict], timed: list[dict], device) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# EP dispatch/combine on {world_desc(args, device)}", ""]
    for name, rows in (("ep_correctness", checked), ("ep_timing", timed)):
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
    p.add_argument("--phase", default="all", choices=["all", "correctness", "timing"])
    p.add_argument("--smoke", action="store_true", help="2 gloo ranks on the CPU with tiny shapes")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ms", nargs="+", type=int, default=None, help=f"tokens per rank (default {M_LIST})")
    p.add_argument("--iters", type=int, default=None, help="timed calls per point (default 20; smoke 3)")
    p.add_argument("--check-tokens", type=int, default=None, help="tokens per rank in the correctness phase")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    args = p.parse_args(argv)
    args.models = SMOKE_MODELS if args.smoke else MODELS
    args.ms = args.ms or ([4, 32] if args.smoke else M_LIST)
    args.iters = args.iters or (3 if args.smoke else 20)
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
