"""Probe: the whole forward with and without dependent launches (kernels/triton/pdl.py) and with torch's top-k sum
instead of ours (kernels/triton/topk_sum.py), timed in turn in one process; and the top-k sum alone.

    python bench/pdl_probe.py --out DIR --points qwen3-30b-a3b:bf16:4096 gpt-oss-20b:mxfp4:16 [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import TIMED_SCHEMES, Bench, fastest_interleaved, report_row  # noqa: E402

from moerules.kernels.scheme import Scheme  # noqa: E402
from moerules.kernels.triton import align, launch, quant, topk_sum  # noqa: E402

_PDL_USERS = (align, launch, quant, topk_sum)


@contextlib.contextmanager
def variant(name: str):
    """Within: 'ours' as built; 'no_pdl' every kernel launched plainly; 'torch_sum' torch's sum over the top-k."""
    saved = [m.pdl_kwargs for m in _PDL_USERS] + [launch.topk_sum]
    if name == "no_pdl":
        for m in _PDL_USERS:
            m.pdl_kwargs = lambda device: dict(PDL=False, launch_pdl=False)
    if name == "torch_sum":
        launch.topk_sum = lambda slots, k: slots.view(-1, k, slots.shape[1]).sum(dim=1)
    try:
        yield
    finally:
        for m, f in zip(_PDL_USERS, saved):
            m.pdl_kwargs = f
        launch.topk_sum = saved[-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--points", nargs="+", required=True, help="model:scheme:M")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    b = Bench(argparse.Namespace(smoke=False, models=sorted({pt.split(":")[0] for pt in args.points}), out=args.out,
                                 ms=None, schemes=None))
    rows = []
    for point in args.points:
        name, sname, M = point.split(":")
        layer = b.layer(name, Scheme.from_quant(TIMED_SCHEMES[sname]).cell, "triton.fused_moe")
        x, ids, tw = b.inputs(name, int(M))

        def forward(v):
            def run():
                with variant(v):
                    return layer(x, topk_ids=ids, topk_weights=tw)
            return run
        sides = {v: {"": forward(v)} for v in ("ours", "no_pdl", "torch_sum")}
        slots = torch.randn(int(M) * ids.shape[1], layer.hidden_size, device="cuda", dtype=torch.bfloat16)
        k = ids.shape[1]
        sides["sum_ours"] = {"": lambda: topk_sum.topk_sum(slots, k)}
        sides["sum_torch"] = {"": lambda: slots.view(-1, k, slots.shape[1]).sum(dim=1)}
        times = fastest_interleaved(b.interleaved_us, args.rounds, sides)
        report_row(rows, {"point": point, **{key: round(t, 1) for key, t in times.items()}},
                   Path(args.out, "pdl_probe.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
