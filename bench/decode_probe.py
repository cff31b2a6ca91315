"""Probe: where a decode forward's time goes. Per point: the whole forward (graph replay, do_bench median) and, from
one profiled replay, each GPU kernel's duration and the span from the first kernel's start to the last one's end.

    python bench/decode_probe.py --out DIR [--models ..] [--schemes ..] [--ms ..]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import TIMED_SCHEMES, Bench, captured_graph, report_row  # noqa: E402

from moerules.kernels.scheme import Scheme  # noqa: E402


def kernel_trace(fn) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of each GPU kernel one call of fn runs (fn replays a graph), in start order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    # the weights leave L2 first, as before every timed replay (do_bench's flush): without it, the previous
    # replay's last weights (up to 50 MB on the H100) made the traced kernels read faster than the timed ones
    torch.empty(256 << 20, dtype=torch.int8, device="cuda").zero_()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    starts = sorted((e.time_range.start, e.name[:60], e.time_range.end - e.time_range.start) for e in events)
    return [(name, start, duration) for start, name, duration in starts]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b", "deepseek-v3"])
    p.add_argument("--schemes", nargs="+", default=["bf16", "fp8_tensor"])
    p.add_argument("--ms", nargs="+", type=int, default=[1, 16])
    args = p.parse_args(argv)
    b = Bench(argparse.Namespace(smoke=False, models=args.models, out=args.out, ms=args.ms, schemes=args.schemes))
    rows = []
    # What the timing itself costs: a graph of one one-element fill, timed as the forwards are (L2 flushed before
    # each replay), so each forward's time above its kernels' span can be told from this fixed part.
    one = torch.empty(1, device="cuda")
    report_row(rows, {"model": "one-kernel graph", "scheme": "-", "M": 0,
                      "forward_us": b.time_us(lambda: one.fill_(0.0), graph=True)}, Path(args.out, "decode_probe.json"))
    for name in args.models:
        for sname in [s for s in b.timed_schemes(name) if s in args.schemes]:
            layer = b.layer(name, Scheme.from_quant(TIMED_SCHEMES[sname]).cell, "triton.fused_moe")
            for M in args.ms:
                x, ids, tw = b.inputs(name, M)
                fn = lambda: layer(x, topk_ids=ids, topk_weights=tw)  # noqa: E731
                forward = b.time_us(fn, graph=True)
                g = captured_graph(fn)
                trace = kernel_trace(g.replay)
                span = trace[-1][1] + trace[-1][2] - trace[0][1] if trace else 0.0
                row = {"model": name, "scheme": sname, "M": M, "forward_us": forward, "span_us": span,
                       "kernels_us": sum(t[2] for t in trace), "kernels": [(n, round(d, 2)) for n, _, d in trace]}
                report_row(rows, row, Path(args.out, "decode_probe.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
