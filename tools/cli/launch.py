"""Run one MoE layer with expert parallelism over torch.distributed ranks, checked against one device.

    torchrun --nproc-per-node 2 -m moerules.tools.cli.launch examples/mixtral-ep2-cpu.yaml

Every rank decides the config (decisions are deterministic, so all ranks agree), shards the
seeded global weights for the decision's placement, and runs forwards on its own tokens
(ranks of one data-parallel replica, i.e. the TP ranks of one DP index, share their tokens).
Rank 0 gathers every rank's tokens and outputs, recomputes the tokens on one device with the global
weights, and prints the decision, the error of the EP output against that single-device run,
and the median forward time. Exit code 0 when the error is within the tolerance, 1 otherwise,
2 for bad input. The process group is gloo on CPUs and NCCL on GPUs (one GPU per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

EXIT_OK, EXIT_MISMATCH, EXIT_INPUT = 0, 1, 2
# Relative (Frobenius) error allowed between EP and one device: each rank rounds its partial output
# to the input dtype before the partials are summed, and quantised activations may be scaled over a
# different set of rows (dynamic per-tensor intermediate scales, tensor-sharded slices).
TOLERANCE = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 2e-2}
QUANTIZED_TOLERANCE = 8e-2


def make_parser() -> argparse.ArgumentParser:
    from moerules.tools.cli.main import DEBUG_HELP, SEED, config_arguments, bounded_int, positive_number
    from moerules.limits import MAX_RUN_TOKENS
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m moerules.tools.cli.launch",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_arguments(parser)
    parser.add_argument("--tokens", type=bounded_int(1, MAX_RUN_TOKENS), default=64,
                        help="tokens per data-parallel replica (default 64)")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the weights and tokens")
    parser.add_argument("--iters", type=bounded_int(1, 10_000), default=5,
                        help="timed forwards after one warm-up (default 5)")
    parser.add_argument("--timeout", type=positive_number, default=None,
                        help="collective timeout in seconds (default $MOERULES_EP_TIMEOUT_S, else 300)")
    parser.add_argument("--dist-backend", choices=["gloo", "nccl"], default=None,
                        help="process group backend (default: nccl when CUDA is available, else gloo)")
    parser.add_argument("--json", action="store_true", help="rank 0 prints a JSON report")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return parser


def main(argv=None) -> int:
    from moerules.tools.cli.main import run_guarded
    args = make_parser().parse_args(argv)
    return run_guarded(lambda: _launch(args), prog="moerules.tools.cli.launch", debug=args.debug)


def _launch(args) -> int:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("moerules.tools.cli.launch runs under torchrun, which starts the ranks: "
              "torchrun --nproc-per-node N -m moerules.tools.cli.launch CONFIG", file=sys.stderr)
        return EXIT_INPUT
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        decision = _decide(args, world)
    except ValueError as error:
        if rank == 0:
            print(f"moerules.tools.cli.launch: {error}", file=sys.stderr)
        return EXIT_INPUT
    return _run(args, decision, rank, world)


def _decide(args, world: int):
    from moerules.kernels.builder import ranks_of
    from moerules.tools.cli.main import InputError, build_config
    from moerules.engine.decide import decide
    from moerules.errors import BackendRejectedError
    try:
        config = build_config(args)
        decision = decide(config, args.rules, args.engine)
    except (InputError, BackendRejectedError) as error:
        raise ValueError(str(error)) from None
    if decision.outcome.value != "selected":
        raise ValueError(decision.describe())
    ranks = ranks_of(decision)
    if ranks != world:
        raise ValueError(f"the config spans {ranks} ranks (tp={config.parallel.tp} x dp={config.parallel.dp}) but "
                         f"torchrun started {world}; use --nproc-per-node {ranks} or change tp/dp")
    if world == 1:
        raise ValueError("the config is for one device; use `moerules run` (or set tp/dp for several ranks)")
    return decision


def _run(args, decision, rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    from moerules.kernels.builder import build, placement_for
    from moerules.kernels import make_random_weights
    from moerules.kernels.ep import init_distributed, shard_weights

    backend = args.dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    init_distributed(backend=backend, timeout_s=args.timeout)
    try:
        config = decision.config
        global_weights = make_random_weights(
            num_experts=config.model.num_experts, hidden=config.model.hidden_size,
            intermediate=config.model.moe_intermediate_size, quant=config.quant, in_dtype=config.model.in_dtype,
            has_bias=config.model.has_bias, seed=args.seed, device=device)
        placement = placement_for(decision)
        shard = shard_weights(global_weights, placement, rank, activation=config.model.activation)
        layer = build(decision, shard, device=device, group=dist.group.WORLD, placement=placement,
                      timeout_s=args.timeout)
        replica = rank // config.parallel.tp
        x, topk_ids, topk_weights = _tokens(layer, args.tokens, args.seed, replica, device)
        out, times = _timed_forwards(layer, x, topk_ids, topk_weights, args.iters, device)
        outputs = [None] * world
        dist.all_gather_object(outputs, {"x": x.cpu(), "topk_ids": topk_ids.cpu(), "topk_weights": topk_weights.cpu(),
                                         "out": out.cpu(), "ms": times})
        if rank != 0:
            return EXIT_OK
        report = _compare(args, decision, global_weights, outputs, device, placement, backend, world)
        print(json.dumps(report, indent=2) if args.json else _text(report))
        return EXIT_OK if report["within_tolerance"] else EXIT_MISMATCH
    finally:
        dist.destroy_process_group()


def _tokens(layer, num_tokens: int, seed: int, replica: int, device):
    """Seeded tokens and top-k of one data-parallel replica (the same on every rank of that replica)."""
    import torch

    from moerules.kernels.routing import fused_topk
    from moerules.kernels.scheme import TORCH_DTYPE
    gen = torch.Generator(device=device).manual_seed(seed * 7919 + replica + 1)
    x = torch.randn(num_tokens, layer.hidden_size, generator=gen, device=device)
    logits = torch.randn(num_tokens, layer.num_experts, generator=gen, device=device)
    top_k = layer.routing.top_k if layer.routing else min(2, layer.num_experts)
    ids, weights = layer.route(logits) if layer.routing else fused_topk(logits, top_k=top_k, renormalize=True)
    return x.to(TORCH_DTYPE[layer.weights.in_dtype]), ids, weights


def _timed_forwards(layer, x, topk_ids, topk_weights, iters: int, device):
    import torch
    out = layer(x, topk_ids=topk_ids, topk_weights=topk_weights)     # warm-up (compilation, first collectives)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        layer(x, topk_ids=topk_ids, topk_weights=topk_weights)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return out, times


def _compare(args, decision, global_weights, outputs, device, placement, backend: str, world: int) -> dict:
    """Each rank's tokens on one device with the global weights, against what the rank returned."""
    from moerules.kernels import build_layer
    config = decision.config
    standard = decision.activation_format.value == "standard"
    single = build_layer(kernel_id=decision.kernel if standard else "torch.reference", prepare_finalize_id="local",
                         quant=config.quant, activation=config.model.activation, in_dtype=config.model.in_dtype,
                         activation_format="standard", hidden_pad=decision.padding.hidden_pad,
                         weights=global_weights, device=device,
                         defer_input_quant=decision.quant.defer_input_quant)
    max_abs, ref_norm, err_norm, errors = 0.0, 0.0, 0.0, []
    for got in outputs:
        want = single(got["x"].to(device), topk_ids=got["topk_ids"].to(device),
                      topk_weights=got["topk_weights"].to(device)).double().cpu()
        diff = got["out"].double() - want
        max_abs = max(max_abs, diff.abs().max().item() if diff.numel() else 0.0)
        err_norm += diff.norm().item() ** 2
        ref_norm += want.norm().item() ** 2
        errors.append(diff.norm().item() / max(want.norm().item(), 1e-30))
    rel = (err_norm / ref_norm) ** 0.5 if ref_norm else 0.0
    quantized = config.quant.activation_key is not None
    tol = QUANTIZED_TOLERANCE if quantized else TOLERANCE[config.model.in_dtype.value]
    return {"decision": decision.describe(), "dispatcher": decision.prepare_finalize_kernel, "kernel": decision.kernel,
            "placement": placement.kind.value, "ranks": world, "dist_backend": backend, "device": device.type,
            "tokens_per_replica": args.tokens, "rel_err_vs_single_device": rel, "rel_err_per_rank": errors,
            "max_abs_err": max_abs, "tolerance": tol, "within_tolerance": rel <= tol,
            "forward_ms_median_per_rank": [statistics.median(o["ms"]) if o["ms"] else None for o in outputs]}


def _text(report: dict) -> str:
    lines = [report["decision"],
             f"ranks: {report['ranks']} ({report['dist_backend']} on {report['device']}), placement "
             f"{report['placement']}, {report['tokens_per_replica']} tokens per replica",
             f"EP vs single device: rel err {report['rel_err_vs_single_device']:.3e} (per rank "
             f"{', '.join(f'{e:.2e}' for e in report['rel_err_per_rank'])}), max abs err {report['max_abs_err']:.3e}, "
             f"tolerance {report['tolerance']:g}: {'OK' if report['within_tolerance'] else 'MISMATCH'}",
             "forward median ms per rank: " + ", ".join(f"{t:.2f}" if t is not None else "-"
                                                         for t in report["forward_ms_median_per_rank"])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
