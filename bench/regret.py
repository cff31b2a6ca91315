"""Decision regret on a GPU: does the backend the rules choose run fastest among those they leave eligible?

    python bench/regret.py --out DIR          # on the GPU machine (bench/regret_gpu.sh carries what it needs)
    python bench/regret.py --dry-run          # any machine: the points and their candidates, nothing timed

Points: every model preset x every scheme of the decision matrix (`engine.matrix.QUANTS`), bf16, one device,
on the platform `detect()` reports here (its packages included), x the token counts M in M_LIST. Candidates
of a point: the backend chosen in auto mode and its eligible alternatives that can run here (ours, or an
external backend whose adapter's package is installed); a point with fewer than two is listed, not timed.
Each candidate is built the way the rules build it: `decide` pinned to it (`features.backend`), then
`build` on fresh seeded weights (the same values for every candidate, padded as its decision says).
Each candidate's error against the fp32 `torch.reference` at M=CHECK_M is recorded, so a fast but wrong
kernel shows.
Boundary: `MoELayer.forward` with x [M, H] and top-k ids/weights in, [M, H] out (routing outside);
candidates of a point run in one process, back to back, on the same inputs; CUDA-graph replay timed by
`triton.testing.do_bench` median (L2 flushed before each call).
regret = time(chosen) / time(fastest candidate), where "chosen" is the auto decision with
`features.num_tokens_hint` = M (the rules may rank by it); the candidates are those of the decision without a
hint. Summary: geometric mean and maximum over the (model, scheme, M) points.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe import time_us  # noqa: E402

from moerules import build, decide, detect  # noqa: E402
from moerules.config import MoEConfig, Platform  # noqa: E402
from moerules.decision import Outcome  # noqa: E402
from moerules.tools.matrix import QUANTS  # noqa: E402
from moerules.errors import KernelUnavailableError  # noqa: E402
from moerules.kernels import make_random_weights  # noqa: E402
from moerules.kernels.example import run_forward  # noqa: E402
from moerules.kernels.registry import adapter_refusal  # noqa: E402
from moerules.kernels.routing import fused_topk  # noqa: E402
from moerules.kernels.scheme import Scheme, UnsupportedScheme  # noqa: E402
from moerules.presets import PRESETS  # noqa: E402

M_LIST = [1, 2, 3, 4, 16, 64, 256, 1024, 4096]
DRY_RUN_PLATFORM = Platform(vendor="cuda", arch="sm_90", packages=["triton", "triton_kernels"], torch_grouped_mm=True)
CHECK_M = 64


def configs(platform):
    for name, preset in PRESETS.items():
        for quant in QUANTS:
            yield name, MoEConfig(model={**preset["model"], "in_dtype": "bf16"}, quant=quant, platform=platform)


def with_features(config: MoEConfig, **features) -> MoEConfig:
    return config.model_copy(update={"features": config.features.model_copy(update=features)})


def pinned(config: MoEConfig, backend: str) -> MoEConfig:
    return with_features(config, backend=backend)


def scheme_name(config: MoEConfig) -> str:
    try:
        return Scheme.from_quant(config.quant).cell
    except UnsupportedScheme:          # schemes only external kernels implement
        return config.quant.family.value


def weights_for(decision, device, num_experts=None):
    c = decision.config
    return make_random_weights(num_experts=num_experts or c.model.num_experts, hidden=c.model.hidden_size,
                               intermediate=c.intermediate_per_partition, quant=c.quant, in_dtype=c.model.in_dtype,
                               has_bias=c.model.has_bias, seed=0, device=device)


def runnable(decision, device: str) -> tuple[list[str], dict[str, str]]:
    """Candidates (chosen first) that build here (a dry run: that name a kernel or an adapter), and why each
    other eligible backend does not."""
    ok, why = [], {}
    for backend in (decision.backend, *decision.alternatives):
        candidate = decide(pinned(decision.config, backend))
        if candidate.kernel is None and candidate.adapter is None:
            why[backend] = f"external package {candidate.external_package}, no adapter"
            continue
        refusal = candidate.adapter and adapter_refusal(candidate.adapter, candidate.config.quant)
        if refusal:
            why[backend] = refusal
            continue
        try:
            if device != "dry-run":
                build(candidate, weights_for(candidate, device, num_experts=2))  # the real shape, fewer experts
        except KernelUnavailableError as error:
            why[backend] = str(error)
            continue
        ok.append(backend)
    return ok, why


def inputs(config: MoEConfig, M: int, device):
    gen = torch.Generator(device=device).manual_seed(M)
    m = config.model
    x = torch.randn(M, m.hidden_size, generator=gen, device=device).to(torch.bfloat16)
    ids, w = fused_topk(torch.randn(M, m.num_experts, generator=gen, device=device), top_k=m.top_k, renormalize=True)
    return x, ids, w


def time_point(config: MoEConfig, candidates: list[str], device) -> dict:
    times, errors = {}, {}
    for backend in candidates:
        decision = decide(pinned(config, backend))
        layer = build(decision, weights_for(decision, device))
        times[backend] = {}
        for M in M_LIST:
            x, ids, w = inputs(config, M, device)
            times[backend][M] = time_us(lambda: layer(x, topk_ids=ids, topk_weights=w), graph=True, rep=50)
        errors[backend] = run_forward(layer, num_tokens=CHECK_M, seed=CHECK_M, device=device)["rel_err_vs_reference"]
        print(f"  {backend:18s} rel_err {errors[backend]:.2e}  " +
              " ".join(f"M={M}:{t:.1f}" for M, t in times[backend].items()), flush=True)
        del layer
        gc.collect()
        torch.cuda.empty_cache()
    return {"times_us": times, "rel_err_vs_reference": errors}


def table(rows: list[dict]) -> str:
    lines = ["| model | scheme | M | chosen | fastest | times µs | regret |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        times = ", ".join(f"{b} {t:.1f}" for b, t in r["times_us"].items())
        lines.append(f"| {r['model']} | {r['scheme']} | {r['M']} | {r['chosen']} | {r['fastest']} | {times} | "
                     f"{r['regret']:.3f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/regret")
    ap.add_argument("--ms", nargs="*", type=int, help=f"token counts (default {M_LIST})")
    ap.add_argument("--schemes", nargs="*", help="only schemes whose cell starts with one of these")
    ap.add_argument("--dry-run", action="store_true", help="list the points of an H100 with triton_kernels installed")
    args = ap.parse_args()
    device = "dry-run" if args.dry_run else "cuda"
    M_LIST[:] = args.ms or M_LIST
    platform = DRY_RUN_PLATFORM if args.dry_run else detect()
    report = {"device": "dry run" if args.dry_run else torch.cuda.get_device_name(),
              "platform": platform.model_dump(mode="json"), "torch": torch.__version__, "points": [], "skipped": []}
    for name, config in configs(platform):
        if args.schemes and not scheme_name(config).startswith(tuple(args.schemes)):
            continue
        decision = decide(config)
        if decision.outcome != Outcome.selected:
            continue
        candidates, why = runnable(decision, device)
        entry = {"model": name, "scheme": scheme_name(config), "chosen": decision.backend, "candidates": candidates,
                 "not_runnable": why}
        print(f"{name:14s} {entry['scheme']:40s} chosen {decision.backend:12s} runnable {candidates}", flush=True)
        if len(candidates) < 2 or args.dry_run:
            report["skipped"].append(entry)
            continue
        entry.update(time_point(config, candidates, device))
        entry["chosen_at"] = {M: decide(with_features(config, num_tokens_hint=M)).backend for M in M_LIST}
        report["points"].append(entry)
    rows = []
    for p in report["points"]:
        for M in M_LIST:
            times = {b: p["times_us"][b][M] for b in p["candidates"]}
            fastest, chosen = min(times, key=times.get), p["chosen_at"][M]
            rows.append({"model": p["model"], "scheme": p["scheme"], "M": M, "chosen": chosen, "fastest": fastest,
                         "times_us": times, "regret": times[chosen] / times[fastest]})
    report["rows"] = rows
    if rows:
        report["geomean_regret"] = math.exp(sum(math.log(r["regret"]) for r in rows) / len(rows))
        report["max_regret"] = max(r["regret"] for r in rows)
        print(table(rows))
        print(f"geomean regret {report['geomean_regret']:.4f}, max {report['max_regret']:.4f} over {len(rows)} points")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "regret.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "regret.md").write_text(table(rows) + "\n")


if __name__ == "__main__":
    main()
