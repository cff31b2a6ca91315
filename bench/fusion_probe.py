"""Probe: the decode fields of a config (GemmConfig.SUM_TOPK: GEMM2 sums the top-k slots; PREFETCH_W2: GEMM1 prefetches
GEMM2's weights into L2) on and off, whole forward, timed in turn in one process against the config in use.

    python bench/fusion_probe.py --out DIR --points qwen3-30b-a3b:bf16:1 deepseek-v3:fp8_tensor:1 [--install]
    TRITON_INTERPRET=1 python bench/fusion_probe.py --smoke --out DIR   # the tiny models on the CPU (no timing meaning)

Per point, one JSON row: each variant's µs, its ratio to the config in use (> 1: faster), its % of the floor
(bench/moe.py floor_us), the relative difference of its output from the config in use's (within the scheme's
tolerance, or the variant is not installed), and the kernels of one graph replay of the in-use and the fastest
variant (bench/decode_probe.kernel_trace). --install writes the fastest variant into the tuned file's entry at M
where it is at least INSTALL_MARGIN faster than the config in use (made from the config in use where the file has
no entry at M). Points outside the naive assignment (4 * M * k > E), where neither field applies, are skipped.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_probe import kernel_trace  # noqa: E402
from moe import TIMED_SCHEMES, Bench, captured_graph, fastest_interleaved, report_row, rel_err, tolerance  # noqa: E402

from moerules.kernels.scheme import Scheme  # noqa: E402
from moerules.kernels.triton import launch  # noqa: E402
from moerules.kernels.triton.align import use_naive_assignment  # noqa: E402
from moerules.kernels.triton.config import MoEConfig, check_config  # noqa: E402

INSTALL_MARGIN = 0.01


def variants(cfg: MoEConfig) -> dict[str, MoEConfig]:
    """The config in use, each decode field alone, both, and the summed GEMM2 on half-width tiles (twice the programs:
    it runs one program per token and column block instead of one per slot and column block)."""
    def fields(c: MoEConfig, *, prefetch: int = 0, summed: bool = False, narrow: bool = False) -> MoEConfig:
        g2 = replace(c.gemm2, SUM_TOPK=summed, BLOCK_N=c.gemm2.BLOCK_N // 2 if narrow else c.gemm2.BLOCK_N)
        return replace(c, gemm1=replace(c.gemm1, PREFETCH_W2=prefetch), gemm2=g2)
    out = {"in_use": cfg, "sum": fields(cfg, summed=True), "pf1": fields(cfg, prefetch=1),
           "pf2": fields(cfg, prefetch=2), "pf1_sum": fields(cfg, prefetch=1, summed=True),
           "pf2_sum": fields(cfg, prefetch=2, summed=True)}
    if cfg.gemm2.BLOCK_N >= (16 if cfg.BLOCK_M == 1 or cfg.gemm2.SWAP_AB else 32):
        out["sum_narrow"] = fields(cfg, summed=True, narrow=True)
        out["pf2_sum_narrow"] = fields(cfg, prefetch=2, summed=True, narrow=True)
    return out


def install(b: Bench, name: str, layer, M: int, best: MoEConfig) -> None:
    model, w = b.models[name], layer.weights
    table = b.existing_table(model, w.scheme)
    table[str(M)] = best.to_dict()
    b.write_config(model, w.scheme, table)


def probe_point(b: Bench, name: str, sname: str, M: int, args) -> dict:
    model = b.models[name]
    cell = Scheme.from_quant(TIMED_SCHEMES[sname]).cell
    layer = b.layer(name, cell, "triton.fused_moe")
    run = b.forward_with_config(layer, model, *b.inputs(name, M))
    in_use = launch.config_for(layer.weights, num_tokens=M, top_k=model.k, device=b.device)
    row: dict = {"point": f"{name}:{sname}:{M}", "in_use": in_use.to_dict()}
    configs = {}
    for v, cfg in variants(in_use).items():
        try:
            check_config(cfg, layer.weights.scheme)
            configs[v] = cfg
        except ValueError as exc:
            row[f"{v}_error"] = str(exc)
    ref = run(in_use)
    diffs = {v: rel_err(run(cfg), ref) for v, cfg in configs.items() if v != "in_use"}
    row |= {f"{v}_diff": float(f"{d:.2e}") for v, d in diffs.items()}
    sides = {v: {"": (lambda cfg=cfg: run(cfg))} for v, cfg in configs.items()}
    times = fastest_interleaved(b.interleaved_us, args.rounds, sides)
    floor = b.floor_us(model, M, sname)[0]
    row["floor_us"] = round(floor, 2)
    for key, t in times.items():
        v = key[:-3]
        row |= {key: round(t, 1), f"{v}_vs_in_use": round(times["in_use_us"] / t, 3),
                f"{v}_floor_pct": round(100 * floor / t, 1)}
    correct = [v for v in configs if v == "in_use" or diffs[v] <= tolerance(cell)]
    best = min(correct, key=lambda v: times.get(f"{v}_us", math.inf))
    row["fastest"] = best
    for v in ([] if b.smoke else sorted({"in_use", best})):
        graph = captured_graph(lambda cfg=configs[v]: run(cfg))
        row[f"{v}_kernels"] = [(n, round(d, 2)) for n, _, d in kernel_trace(graph.replay)]
    if args.install and times[f"{best}_us"] < (1 - INSTALL_MARGIN) * times["in_use_us"]:
        install(b, name, layer, M, configs[best])
        row["installed"] = best
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--points", nargs="+", help="model:scheme:M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--install", action="store_true", help="the fastest variant into the tuned files (see above)")
    p.add_argument("--smoke", action="store_true", help="tiny models, CPU (interpreter)")
    args = p.parse_args(argv)
    points = args.points or (["tiny:bf16:1", "tiny-oss:fp8_tensor:1"] if args.smoke else None)
    if not points:
        p.error("--points is required (model:scheme:M)")
    todo = [(pt.split(":")[0], pt.split(":")[1], int(pt.split(":")[2])) for pt in points]
    b = Bench(argparse.Namespace(smoke=args.smoke, models=sorted({m for m, _, _ in todo}), out=args.out, ms=None,
                                 schemes=None, install_configs=args.install))
    b.ceilings()
    rows: list = []
    for name, sname, M in todo:
        model = b.models[name]
        if not use_naive_assignment(M * model.k, model.E):
            print(f"skip {name}:{sname}:{M}: 4 * M * k > E, not the naive assignment", flush=True)
            continue
        report_row(rows, probe_point(b, name, sname, M, args), Path(args.out, "fusion_probe.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
