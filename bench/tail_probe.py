"""Probe: each expert's rows in full BLOCK_M blocks plus tail blocks of a smaller BLOCK_M, two launches per GEMM,
against today's one padded launch. The alignments are built on the host (not timed); only the GEMMs are timed.

    python bench/tail_probe.py --out DIR [--models ..] [--schemes ..] [--ms ..]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import TIMED_SCHEMES, Bench, fastest_interleaved, rel_err, report_row, tolerance  # noqa: E402

from moerules.kernels.scheme import TORCH_DTYPE, Scheme  # noqa: E402
from moerules.kernels.triton import launch  # noqa: E402
from moerules.kernels.triton.align import Alignment, moe_align  # noqa: E402
from moerules.kernels.triton.config import _load_file, config_file_name, dtype_key  # noqa: E402
from moerules.kernels.triton.device import device_name  # noqa: E402


def host_alignment(ids: torch.Tensor, E: int, block_m: int, tail_m: int) -> list[Alignment]:
    """[full blocks of block_m, tail blocks of tail_m] (tail_m 0: one alignment, every run padded to block_m)."""
    flat = ids.reshape(-1).cpu()
    T = flat.numel()
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.bincount(flat, minlength=E).tolist()
    segs = {block_m: ([], []), tail_m: ([], [])}
    start = 0
    for e, c in enumerate(counts):
        rows = order[start:start + c]
        start += c
        full = c if not tail_m else c // block_m * block_m
        for bm, part in ((block_m, rows[:full]), (tail_m, rows[full:])):
            if not len(part):
                continue
            n = -(-len(part) // bm) * bm
            padded = torch.full((n,), T, dtype=torch.int32)
            padded[:len(part)] = part
            segs[bm][0].append(padded)
            segs[bm][1].extend([e] * (n // bm))
    out = []
    for bm, (sid, eid) in segs.items():
        if not eid:
            continue
        sid = torch.cat(sid)
        i32 = dict(dtype=torch.int32, device=ids.device)
        out.append(Alignment(sorted_ids=sid.to(ids.device), expert_ids=torch.tensor(eid, **i32),
                             num_post_padded=torch.tensor([sid.numel()], **i32), block_m=bm))
    return out


def table_configs(w, block_m: int):
    key = dtype_key(w.scheme, w.in_dtype.value)
    table = _load_file(config_file_name(num_experts=w.num_experts, intermediate=w.intermediate,
                                        device_name=device_name(w.w13.device), dtype=key)) or {}
    seen, out = set(), []
    for m, cfg in sorted(table.items()):
        if cfg.BLOCK_M == block_m and cfg not in seen:
            seen.add(cfg)
            out.append((f"M{m}", cfg))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b"])
    p.add_argument("--schemes", nargs="+", default=["bf16", "fp8_tensor", "fp8_block"])
    p.add_argument("--ms", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 (checks, no timing)")
    args = p.parse_args(argv)
    b = Bench(argparse.Namespace(smoke=args.smoke, models=args.models, out=args.out, ms=args.ms, schemes=args.schemes))
    if args.smoke:
        args.models, args.ms = list(b.models), [40]
    rows = []
    for name in args.models:
        for sname in [s for s in b.timed_schemes(name) if s in args.schemes]:
            cell = Scheme.from_quant(TIMED_SCHEMES[sname]).cell
            layer = b.layer(name, cell, "triton.fused_moe")
            w = layer.weights
            for M in args.ms:
                report_row(rows, point(b, layer, w, name, sname, M, args.rounds), Path(args.out, "tail_probe.json"))
    return 0


def point(b, layer, w, name, sname, M, rounds):
    x, ids, tw = b.inputs(name, M)
    prep = layer.prepare_finalize.prepare(x, topk_ids=ids, topk_weights=tw, defer_input_quant=False,
                                          a13_scale=w.a13_scale)
    x_q, a_scale = layer.experts.gemm1_input(prep.hidden_q, a_scale=prep.a_scale, weights=w)
    k = ids.shape[1]
    act, swiglu = layer.experts.activation, layer.experts.swiglu
    quantize = layer.experts.quantize_intermediate(w)
    out_dtype = TORCH_DTYPE[w.in_dtype]
    base_cfg = launch.config_for(w, num_tokens=M, top_k=k, device=x.device)

    def side(plan):
        """plan: [(Alignment, MoEConfig)]: the GEMM launches over each alignment with its config."""
        inter = torch.empty(M * k, w.intermediate, dtype=out_dtype, device=x.device)
        out2 = torch.empty(M * k, w.hidden, dtype=out_dtype, device=x.device)
        for al, cfg in plan:
            launch.gemm1(x_q, a_scale, weights=w, align=al, cfg=cfg, activation=act, out=inter, top_k=k,
                         swiglu=swiglu)
        inter_q, inter_scale = quantize(inter, None)
        inter_q = inter_q.clone() if inter_q is inter else inter_q

        def run():
            for al, cfg in plan:
                launch.gemm1(x_q, a_scale, weights=w, align=al, cfg=cfg, activation=act, out=inter, top_k=k,
                             swiglu=swiglu)
            for al, cfg in plan:
                launch.gemm2(inter_q, inter_scale, weights=w, topk_weights=tw, align=al, cfg=cfg, out=out2)
        run()
        return run, out2.view(M, k, -1).sum(1).clone()

    base_run, base_out = side([(moe_align(ids, num_experts=w.num_experts, block_m=base_cfg.BLOCK_M), base_cfg)])
    sides = {"base": {"": base_run}}
    desc = {}
    big_cfgs = [("in_use", base_cfg)] + ([c for c in table_configs(w, 128)][-1:] if base_cfg.BLOCK_M != 128 else [])
    if b.smoke:
        big_cfgs = [("bm64", replace(base_cfg, BLOCK_M=64))]
    for big_name, big in big_cfgs:
        if big.BLOCK_M < 64:
            continue
        for tail_m in (16, 32, 64):
            if tail_m >= big.BLOCK_M:
                continue
            tails = table_configs(w, tail_m)[-1:] + [("same_tiles", replace(big, BLOCK_M=tail_m))]
            for tail_name, tail in tails:
                aligns = host_alignment(ids, w.num_experts, big.BLOCK_M, tail_m)
                plan = [(a, big if a.block_m == big.BLOCK_M else tail) for a in aligns]
                run, out = side(plan)
                err = rel_err(out, base_out)
                label = f"{big_name}+{tail_m}:{tail_name}"
                if err > tolerance(w.scheme.cell):
                    print(f"FAIL {name} {sname} {M} {label} err {err}", flush=True)
                    continue
                sides[label] = {"": run}
                desc[label] = {"big": big.to_dict(), "tail": tail.to_dict()}
    times = fastest_interleaved(b.interleaved_us, rounds, sides)
    base_us = times["base_us"]
    best = min((l for l in sides if l != "base"), key=lambda l: times[f"{l}_us"], default=None)
    best_us = times[f"{best}_us"] if best else None
    return {"model": name, "scheme": sname, "M": M, "base_BLOCK_M": base_cfg.BLOCK_M, "base_us": base_us,
            "best": best, "best_us": best_us, "speedup": base_us / best_us if best_us else None, "times": times,
            "configs": desc}


if __name__ == "__main__":
    sys.exit(main())
