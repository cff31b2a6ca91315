"""Probe: the weight tiles loaded by address (as tuned) against copied by TMA (GemmConfig.TMA, fused_moe._tma_tile),
the same tiles otherwise, timed in turn in one process.

    python bench/tma_probe.py --out DIR --models mixtral-8x7b deepseek-v3 --schemes bf16 fp8_tensor --ms 16 4096
    python bench/tma_probe.py --out DIR --points qwen3-30b-a3b:fp8_tensor:1024   # single points
    python bench/tma_probe.py --out DIR --gemms --install ...   # each GEMM alone; its faster load goes in the files
    TRITON_INTERPRET=1 python bench/tma_probe.py --smoke --out DIR   # the tiny models on the CPU (no timing meaning)

Whole forward (default): TMA in GEMM1, GEMM2 or both. --gemms: each GEMM alone, as bench/vllm_triton.py times ours
(the metric of the side-by-side with vLLM), address against TMA. --install (with --gemms) writes each GEMM's faster
load into the tuned file's entry at that M (made from the config in use where the file has none): TMA only where it
is at least INSTALL_MARGIN faster, so timing noise never flips a tuned entry.

Prints one JSON row per point: each variant's µs, its ratio to address (> 1: TMA faster) and the relative difference
of its output from address's (the same products: expected 0). Points whose config runs GEMV rows (BLOCK_M 1, no
MMA tile) are skipped. A variant that fails to run is recorded with its error.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import EXTRA_MODELS, MODELS, TIMED_SCHEMES, Bench, fastest_interleaved, report_row  # noqa: E402
from vllm_triton import Alignments, our_gemms  # noqa: E402

from moerules.kernels.scheme import Scheme  # noqa: E402
from moerules.kernels.triton import launch  # noqa: E402
from moerules.kernels.triton.config import MoEConfig  # noqa: E402

FORWARD_VARIANTS = {"address": (False, False), "tma_gemm1": (True, False), "tma_gemm2": (False, True),
                    "tma": (True, True)}
GEMM_VARIANTS = {"address": (False, False), "tma": (True, True)}
INSTALL_MARGIN = 0.01


@contextlib.contextmanager
def variant(tma1: bool, tma2: bool):
    """Within: every config the launcher looks up has TMA in GEMM1 / GEMM2 as given."""
    real = launch.get_config

    def patched(**kwargs):
        return with_tma(real(**kwargs), tma1, tma2)
    launch.get_config = patched
    try:
        yield
    finally:
        launch.get_config = real


def with_tma(cfg: MoEConfig, tma1: bool, tma2: bool) -> MoEConfig:
    return replace(cfg, gemm1=replace(cfg.gemm1, TMA=tma1), gemm2=replace(cfg.gemm2, TMA=tma2))


def points(args) -> list[tuple[str, str, int]]:
    if args.points:
        return [(p.split(":")[0], p.split(":")[1], int(p.split(":")[2])) for p in args.points]
    return [(m, s, M) for m in args.models for s in args.schemes for M in args.ms
            if not (s == "fp8_block" and m != "deepseek-v3")]


def forward_sides(layer, x, ids, tw) -> tuple[dict, dict, dict]:
    """({variant: {"": whole forward}}, {variant: output}, {variant: error}) of FORWARD_VARIANTS."""
    sides, outputs, errors = {}, {}, {}
    for v, tma in FORWARD_VARIANTS.items():
        def run(tma=tma):
            with variant(*tma):
                return layer(x, topk_ids=ids, topk_weights=tw)
        try:
            outputs[v] = run().float()
            sides[v] = {"": run}
        except Exception as exc:  # a tile TMA cannot copy: recorded, the other variants still timed
            errors[v] = f"{type(exc).__name__}: {exc}"[:300]
    return sides, outputs, errors


def gemm_sides(layer, x, ids, tw) -> tuple[dict, dict, dict]:
    """({variant: {"_gemm1": .., "_gemm2": ..}}, {variant: output}, {variant: error}) of GEMM_VARIANTS: our GEMM
    launches as the side-by-side with vLLM times them, each variant's config fixed when its launches are made."""
    w = layer.weights
    prep = layer.prepare_finalize.prepare(x, topk_ids=ids, topk_weights=tw, defer_input_quant=False,
                                          a13_scale=w.a13_scale)
    x_q, a_scale = layer.experts.gemm1_input(prep.hidden_q, a_scale=prep.a_scale, weights=w)
    alignments = Alignments(ids, w.num_experts)
    sides, outputs, errors = {}, {}, {}
    for v, tma in GEMM_VARIANTS.items():
        try:
            with variant(*tma):
                side = our_gemms(layer, x_q, a_scale, ids, tw, alignments=alignments)
            outputs[v] = side.out.float()
            sides[v] = {"_gemm1": side.gemm1, "_gemm2": side.gemm2}
        except Exception as exc:
            errors[v] = f"{type(exc).__name__}: {exc}"[:300]
    return sides, outputs, errors


def ratios(times: dict, *, gemms: bool) -> dict:
    """address µs / TMA µs (> 1: TMA faster): per GEMM with --gemms, else per whole-forward variant."""
    pairs = ([(f"gemm{i} tma/address", f"address_gemm{i}_us", f"tma_gemm{i}_us") for i in (1, 2)] if gemms else
             [(f"{v}/address", "address_us", f"{v}_us") for v in FORWARD_VARIANTS if v != "address"])
    return {name: round(times[base] / times[t], 3) for name, base, t in pairs if base in times and t in times}


def install(b: Bench, name: str, layer, M: int, row: dict) -> None:
    """Each GEMM's faster load (TMA only if INSTALL_MARGIN faster) into the tuned file's entry at M. An entry the
    decision does not change is left as it is written; a missing one is made from the config in use."""
    model, w = b.models[name], layer.weights
    tma = [row.get(f"tma_gemm{i}_us", math.inf) < (1 - INSTALL_MARGIN) * row.get(f"address_gemm{i}_us", 0)
           for i in (1, 2)]
    row["installed_tma"] = tma
    in_use = launch.config_for(w, num_tokens=M, top_k=model.k, device=b.device)
    table = b.existing_table(model, w.scheme)
    if str(M) in table and [in_use.gemm1.TMA, in_use.gemm2.TMA] == tma:
        return
    table[str(M)] = with_tma(in_use, *tma).to_dict()
    b.write_config(model, w.scheme, table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--points", nargs="+", help="model:scheme:M (instead of the grid below)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS | EXTRA_MODELS))
    p.add_argument("--schemes", nargs="+", default=["bf16", "fp8_tensor", "fp8_block"], choices=list(TIMED_SCHEMES))
    p.add_argument("--ms", nargs="+", type=int, default=[16, 256, 1024, 4096, 16384])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gemms", action="store_true", help="each GEMM alone (the side-by-side's metric), not the forward")
    p.add_argument("--install", action="store_true", help="with --gemms: each GEMM's faster load into the files")
    p.add_argument("--smoke", action="store_true", help="tiny models, CPU (interpreter)")
    args = p.parse_args(argv)
    if args.install and not args.gemms:
        p.error("--install needs --gemms: the files are chosen by the side-by-side's metric")
    if args.smoke:
        args.points = args.points or ["tiny:fp8_tensor:40", "tiny-oss:fp8_tensor:40"]
    todo = points(args)
    b = Bench(argparse.Namespace(smoke=args.smoke, models=sorted({m for m, _, _ in todo}), out=args.out, ms=None,
                                 schemes=None, install_configs=args.install))
    rows = []
    for name, sname, M in todo:
        layer = b.layer(name, Scheme.from_quant(TIMED_SCHEMES[sname]).cell, "triton.fused_moe")
        x, ids, tw = b.inputs(name, M)
        if launch.config_for(layer.weights, num_tokens=M, top_k=ids.shape[1], device=x.device).BLOCK_M == 1:
            continue
        sides, outputs, errors = (gemm_sides(layer, x, ids, tw) if args.gemms else
                                  forward_sides(layer, x, ids, tw))
        row: dict = {"point": f"{name}:{sname}:{M}"} | {f"{v}_error": e for v, e in errors.items()}
        if "address" in outputs:
            ref = outputs["address"]
            row |= {f"{v}_diff": float((o - ref).norm() / ref.norm()) for v, o in outputs.items() if v != "address"}
        times = fastest_interleaved(b.interleaved_us, args.rounds, sides)
        row |= {key: round(t, 1) for key, t in times.items()}
        row |= ratios(times, gemms=args.gemms)
        if args.install and not errors:
            install(b, name, layer, M, row)
        report_row(rows, row, Path(args.out, "tma_probe.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
