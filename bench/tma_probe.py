"""Probe: variants of the config in use timed in turn in one process. By default the weight tiles loaded by address
(as tuned) against copied by TMA (GemmConfig.TMA, fused_moe._tma_tile), the same tiles otherwise; with --tile, named
configs given as changes to the config in use.

    python bench/tma_probe.py --out DIR --models mixtral-8x7b deepseek-v3 --schemes bf16 fp8_tensor --ms 16 4096
    python bench/tma_probe.py --out DIR --points qwen3-30b-a3b:fp8_tensor:1024   # single points
    python bench/tma_probe.py --out DIR --gemms --install ...   # each GEMM alone; its faster load goes in the files
    python bench/tma_probe.py --out DIR --gemms --points mixtral-8x7b:fp8_tensor:1024 \
        --tile 'n64w4={"gemm1": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}}'   # against the config in use
    python bench/tma_probe.py --out DIR --gemms --install --from-device h200=NVIDIA_H200   # another GPU's entries
    TRITON_INTERPRET=1 python bench/tma_probe.py --smoke --out DIR   # the tiny models on the CPU (no timing meaning)

Whole forward (default): TMA in GEMM1, GEMM2 or both. --gemms: each GEMM alone, as bench/vllm_triton.py times ours
(the metric of the side-by-side with vLLM), address against TMA. --install (with --gemms) writes each GEMM's faster
load into the tuned file's entry at that M (made from the config in use where the file has none): TMA only where it is
at least INSTALL_MARGIN faster, so timing noise never flips a tuned entry. --tile NAME=JSON (repeated): the config in
use ("in_use") against each, JSON holding top-level fields (BLOCK_M, CHAIN, TAIL_M) and/or the fields of "gemm1" /
"gemm2" to change; with --install the fastest variant (by the GEMMs with --gemms, else by the forward, the tuner's
metric: the MX schemes have no vLLM side-by-side) replaces the entry where it is TILE_INSTALL_MARGIN faster
(`install_tile`). --from-device NAME=DEVICE (repeated, with or instead of --tile): the config DEVICE's tuned files
give at the point (its nearest M, or the heuristic where it has none), e.g. a new GPU's files seeded from the H200's
where they run faster here.

Prints one JSON row per point: each variant's µs, its ratio to the first variant (address, or in_use; > 1: the
variant is faster) and the relative difference of its output from the first's (the same products: expected 0 for
TMA, rounding-level for other tiles). Without --tile, points whose config runs GEMV rows (BLOCK_M 1, no MMA tile) are
skipped. A variant that fails to run is recorded with its error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import (EXTRA_MODELS, MODELS, TIMED_SCHEMES, Bench, fastest_interleaved, report_row,  # noqa: E402
                 tolerance)
from vllm_triton import Alignments, our_gemms  # noqa: E402

from moerules.kernels.scheme import Scheme  # noqa: E402
from moerules.kernels.triton import config, launch  # noqa: E402
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config  # noqa: E402

# (the config in use, get_config's keyword arguments at the launch) -> the config timed
Variant = Callable[[MoEConfig, dict], MoEConfig]
INSTALL_MARGIN = 0.01
# A --tile variant replaces the entry only this much faster (both GEMMs summed): the probe times a few rounds, and
# session 41's repeated points moved by up to 1.5% between runs.
TILE_INSTALL_MARGIN = 0.015


def with_tma(cfg: MoEConfig, tma1: bool, tma2: bool) -> MoEConfig:
    return replace(cfg, gemm1=replace(cfg.gemm1, TMA=tma1), gemm2=replace(cfg.gemm2, TMA=tma2))


def tma_variants(pairs: dict[str, tuple[bool, bool]]) -> dict[str, Variant]:
    return {name: (lambda cfg, lookup, tma=tma: with_tma(cfg, *tma)) for name, tma in pairs.items()}


FORWARD_VARIANTS = tma_variants({"address": (False, False), "tma_gemm1": (True, False), "tma_gemm2": (False, True),
                                 "tma": (True, True)})
GEMM_VARIANTS = tma_variants({"address": (False, False), "tma": (True, True)})


def tile_variant(arg: str) -> tuple[str, Variant]:
    """--tile NAME=JSON -> (NAME, the config in use with JSON's top-level fields (BLOCK_M, CHAIN) and gemm1 / gemm2
    fields changed)."""
    name, sep, text = arg.partition("=")
    try:
        change = json.loads(text) if sep and name else None
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--tile {arg!r}: {exc}") from None
    if not isinstance(change, dict) or set(change) - set(MoEConfig.__dataclass_fields__):
        raise argparse.ArgumentTypeError(f"--tile {arg!r}: expected NAME=JSON, the JSON an object of "
                                         f"{', '.join(MoEConfig.__dataclass_fields__)} (e.g. "
                                         'n64=\'{"gemm1": {"BLOCK_N": 64}}\')')
    for gemm in ("gemm1", "gemm2"):
        unknown = set(change.get(gemm, {})) - set(GemmConfig.__dataclass_fields__)
        if unknown:
            raise argparse.ArgumentTypeError(f"--tile {arg!r}: {gemm} has no field {', '.join(sorted(unknown))} "
                                             f"(GemmConfig's: {', '.join(GemmConfig.__dataclass_fields__)})")

    def changed(cfg: MoEConfig, lookup: dict) -> MoEConfig:
        d = cfg.to_dict()
        return MoEConfig.from_dict(d | change | {gemm: d[gemm] | change.get(gemm, {}) for gemm in ("gemm1", "gemm2")})
    return name, changed


def device_variant(arg: str) -> tuple[str, Variant]:
    """--from-device NAME=DEVICE -> (NAME, the config DEVICE's tuned files give at the launch)."""
    name, sep, device = arg.partition("=")
    if not (sep and name and device):
        raise argparse.ArgumentTypeError(f"--from-device {arg!r}: expected NAME=DEVICE, DEVICE as the tuned files "
                                         "name it (e.g. h200=NVIDIA_H200)")
    return name, lambda cfg, lookup: config.get_config(**lookup | {"device_name": device})


def config_in_use(lookup: dict, *, new_file: bool) -> MoEConfig:
    """The config this GPU ran at the launch before the probe: its tuned file's, or the heuristic where the probe
    creates the file (`new_file`), so the points after its first install are still timed against what ran before,
    not against the nearest entry just written."""
    if new_file:
        return config.default_config(num_tokens=lookup["num_tokens"], num_experts=lookup["num_experts"],
                                     top_k=lookup["top_k"], scheme=lookup["scheme"])
    return config.get_config(**lookup)


@contextlib.contextmanager
def variant(transform: Variant, *, new_file: bool):
    """Within: every config the launcher looks up is `transform` of the config in use (`config_in_use`), checked as
    a data file's entry is (a variant the kernels cannot run, e.g. TAIL_M at or past BLOCK_M, is then recorded as
    that point's error)."""
    real = launch.get_config

    def patched(**kwargs):
        cfg = transform(config_in_use(kwargs, new_file=new_file), kwargs)
        check_config(cfg, kwargs["scheme"])
        return cfg
    launch.get_config = patched
    try:
        yield
    finally:
        launch.get_config = real


def points(args) -> list[tuple[str, str, int]]:
    if args.points:
        return [(p.split(":")[0], p.split(":")[1], int(p.split(":")[2])) for p in args.points]
    return [(m, s, M) for m in args.models for s in args.schemes for M in args.ms
            if not (s == "fp8_block" and m != "deepseek-v3")]


def forward_sides(layer, x, ids, tw, variants: dict[str, Variant], *, new_file: bool) -> tuple[dict, dict, dict]:
    """({variant: {"": whole forward}}, {variant: output}, {variant: error}) of the variants."""
    sides, outputs, errors = {}, {}, {}
    for v, transform in variants.items():
        def run(transform=transform):
            with variant(transform, new_file=new_file):
                return layer(x, topk_ids=ids, topk_weights=tw)
        try:
            outputs[v] = run().float()
            sides[v] = {"": run}
        except Exception as exc:  # a tile that cannot run (e.g. TMA cannot copy it): recorded, the others still timed
            errors[v] = f"{type(exc).__name__}: {exc}"[:300]
    return sides, outputs, errors


def gemm_sides(layer, x, ids, tw, variants: dict[str, Variant], *, new_file: bool) -> tuple[dict, dict, dict]:
    """({variant: {"_gemm1": .., "_gemm2": ..}}, {variant: output}, {variant: error}) of the variants: our GEMM
    launches as the side-by-side with vLLM times them, each variant's config fixed when its launches are made."""
    w = layer.weights
    prep = layer.prepare_finalize.prepare(x, topk_ids=ids, topk_weights=tw, defer_input_quant=False,
                                          a13_scale=w.a13_scale)
    x_q, a_scale = layer.experts.gemm1_input(prep.hidden_q, a_scale=prep.a_scale, weights=w)
    alignments = Alignments(ids, w.num_experts)
    sides, outputs, errors = {}, {}, {}
    for v, transform in variants.items():
        try:
            with variant(transform, new_file=new_file):
                side = our_gemms(layer, x_q, a_scale, ids, tw, alignments=alignments)
            outputs[v] = side.out.float()
            sides[v] = {"_gemm1": side.gemm1, "_gemm2": side.gemm2}
        except Exception as exc:
            errors[v] = f"{type(exc).__name__}: {exc}"[:300]
    return sides, outputs, errors


def ratios(times: dict, variants: list[str], *, gemms: bool) -> dict:
    """The first variant's µs / each other's (> 1: that variant faster): per GEMM with --gemms, else per forward."""
    base, others = variants[0], variants[1:]
    pairs = ([(f"gemm{i} {v}/{base}", f"{base}_gemm{i}_us", f"{v}_gemm{i}_us") for v in others for i in (1, 2)]
             if gemms else [(f"{v}/{base}", f"{base}_us", f"{v}_us") for v in others])
    return {name: round(times[b] / times[t], 3) for name, b, t in pairs if b in times and t in times}


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


def install_tile(b: Bench, name: str, layer, M: int, row: dict, variants: dict[str, Variant], cell: str, *,
                 gemms: bool, new_file: bool) -> None:
    """The fastest --tile / --from-device variant (both GEMMs summed with --gemms, else the forward) into the tuned
    file's entry at M, where it is at least TILE_INSTALL_MARGIN faster than the config in use and its output within
    the scheme's tolerance of it. In a file the probe creates (`new_file`: this GPU ran the heuristic), the heuristic
    is written where it won, so every probed M keeps what won there rather than the nearest installed M's."""
    def timed_us(v: str) -> float:
        if gemms:
            return row.get(f"{v}_gemm1_us", math.inf) + row.get(f"{v}_gemm2_us", math.inf)
        return row.get(f"{v}_us", math.inf)
    fastest = min((v for v in variants if v != "in_use" and row.get(f"{v}_diff", math.inf) <= tolerance(cell)),
                  key=timed_us, default=None)
    wins = fastest is not None and timed_us(fastest) < (1 - TILE_INSTALL_MARGIN) * timed_us("in_use")
    model = b.models[name]
    table = b.existing_table(model, layer.weights.scheme)
    if not (wins or new_file):
        return
    lookup = launch.config_lookup(layer.weights, num_tokens=M, top_k=model.k, device=b.device)
    chosen = fastest if wins else "in_use"
    table[str(M)] = variants[chosen](config_in_use(lookup, new_file=new_file), lookup).to_dict()
    b.write_config(model, layer.weights.scheme, table)
    row["installed"] = chosen


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--points", nargs="+", help="model:scheme:M (instead of the grid below)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS | EXTRA_MODELS))
    p.add_argument("--schemes", nargs="+", default=["bf16", "fp8_tensor", "fp8_block"], choices=list(TIMED_SCHEMES))
    p.add_argument("--ms", nargs="+", type=int, default=[16, 256, 1024, 4096, 16384])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gemms", action="store_true", help="each GEMM alone (the side-by-side's metric), not the forward")
    p.add_argument("--install", action="store_true",
                   help="with --gemms: each GEMM's faster load into the files; with --tile: the fastest variant")
    p.add_argument("--tile", action="append", type=tile_variant, metavar="NAME=JSON",
                   help='a variant of the config in use, e.g. n64=\'{"gemm1": {"BLOCK_N": 64}}\' (repeatable)')
    p.add_argument("--from-device", action="append", type=device_variant, metavar="NAME=DEVICE",
                   help="the config DEVICE's tuned files give at each point, e.g. h200=NVIDIA_H200 (repeatable)")
    p.add_argument("--smoke", action="store_true", help="tiny models, CPU (interpreter)")
    args = p.parse_args(argv)
    args.tile = (args.tile or []) + (args.from_device or [])
    if args.install and not (args.gemms or args.tile):
        p.error("--install needs --gemms, --tile or --from-device: TMA is chosen by the side-by-side's metric")
    if args.tile:
        variants = {"in_use": lambda cfg, lookup: cfg} | dict(args.tile)
    else:
        variants = GEMM_VARIANTS if args.gemms else FORWARD_VARIANTS
    if args.smoke:
        args.points = args.points or ["tiny:fp8_tensor:40", "tiny-oss:fp8_tensor:40"]
    todo = points(args)
    b = Bench(argparse.Namespace(smoke=args.smoke, models=sorted({m for m, _, _ in todo}), out=args.out, ms=None,
                                 schemes=None, install_configs=args.install))
    rows, new_files = [], {}
    for name, sname, M in todo:
        layer = b.layer(name, Scheme.from_quant(TIMED_SCHEMES[sname]).cell, "triton.fused_moe")
        new_file = new_files.setdefault((name, sname), not b.existing_table(b.models[name], layer.weights.scheme))
        x, ids, tw = b.inputs(name, M)
        in_use = launch.config_for(layer.weights, num_tokens=M, top_k=ids.shape[1], device=x.device)
        if in_use.BLOCK_M == 1 and not args.tile:  # TMA copies serve MMA tiles only
            continue
        sides, outputs, errors = (gemm_sides if args.gemms else forward_sides)(layer, x, ids, tw, variants,
                                                                               new_file=new_file)
        row: dict = {"point": f"{name}:{sname}:{M}"} | {f"{v}_error": e for v, e in errors.items()}
        base = next(iter(variants))
        if base in outputs:
            ref = outputs[base]
            row |= {f"{v}_diff": float((o - ref).norm() / ref.norm()) for v, o in outputs.items() if v != base}
        times = fastest_interleaved(b.interleaved_us, args.rounds, sides)
        row |= {key: round(t, 1) for key, t in times.items()}
        row |= ratios(times, list(variants), gemms=args.gemms)
        if args.install and args.tile:
            install_tile(b, name, layer, M, row, variants, Scheme.from_quant(TIMED_SCHEMES[sname]).cell,
                         gemms=args.gemms, new_file=new_file)
        elif args.install and not errors:
            install(b, name, layer, M, row)
        report_row(rows, row, Path(args.out, "tile_probe.json" if args.tile else "tma_probe.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
