"""Which fragment-order MXFP4 GEMV tiles (BLOCK_M 1) compute right on this GPU: a table of relative errors.

    python bench/fp4_gemv_probe.py --out DIR

`launch.fragment_tiles` runs GEMV rows on 4 warps with K steps >= 128 because other GEMV tiles were wrong on the
H200 (first seen at BLOCK_K 64: rel. err 0.85) and right under the interpreter. This lifts that guard (each
tile's own warps and K step) and runs each GEMV tile
(BLOCK_K x GEMM1 BLOCK_N x warps x dtype; swapped, as every MXFP4 tile now runs: s28 d.'s table also has
unswapped rows, taken before) of a small gpt-oss-shaped layer (E=4, H=160, I=96, swigluoai:
paired w13) against the float64 reference on the same quantised weights, so the floor can be set from data.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from moerules.activation import Activation, Dtype
from moerules.kernels import build_layer, make_random_weights
from moerules.kernels.reference import moe_reference
from moerules.kernels.routing import fused_topk
from moerules.kernels.scheme import TORCH_DTYPE, quant_for_cell
from moerules.kernels.triton import launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig

MXFP4 = quant_for_cell("mxfp4_w4a16/group32")


def rel_err(layer, dtype: Dtype, cfg: MoEConfig) -> float:
    launch.get_config = lambda **_: cfg
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(11, layer.hidden_size, generator=g, device="cuda").to(TORCH_DTYPE[dtype])
    ids, w = fused_topk(torch.randn(11, 4, generator=g, device="cuda"), top_k=2, renormalize=True)
    out = layer(x, topk_ids=ids, topk_weights=w).double()
    pf = layer.prepare_finalize
    p = pf.prepare(x, topk_ids=ids, topk_weights=w, defer_input_quant=False, a13_scale=None)
    ref = pf.finalize(moe_reference(p.hidden_q, weights=layer.weights, topk_ids=ids, topk_weights=w, a_scale=None,
                                    activation=layer.experts.activation, compute_dtype=torch.float64,
                                    swiglu=layer.experts.swiglu), prepared=p, hidden_size=layer.hidden_size)
    return ((out - ref).norm() / ref.norm()).item()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    launch._GEMV_FRAGMENT_K = 0
    rows = []
    for dtype in (Dtype.fp16, Dtype.bf16):
        weights = make_random_weights(num_experts=4, hidden=160, intermediate=96, quant=MXFP4, in_dtype=dtype,
                                      has_bias=True, seed=0, device="cuda", gated=True)
        layer = build_layer(kernel_id="triton.fused_moe", prepare_finalize_id="local", quant=MXFP4,
                            activation=Activation.swigluoai, in_dtype=dtype, activation_format="standard",
                            weights=weights, device="cuda", weight_block=32)
        for block_k, bn1, warps in itertools.product((64, 32, 128, 256), (16, 32), (1, 4)):
            launch._GEMV_FRAGMENT_WARPS = warps  # the guard keeps this tile's own warps

            def tile(n):
                return GemmConfig(BLOCK_N=n, BLOCK_K=block_k, GROUP_M=1, num_warps=warps, num_stages=2, SWAP_AB=True)
            err = rel_err(layer, dtype, MoEConfig(BLOCK_M=1, gemm1=tile(bn1), gemm2=tile(16)))
            rows.append({"dtype": dtype.value, "BLOCK_K": block_k, "gemm1_BLOCK_N": bn1, "warps": warps,
                         "rel_err": err})
            print(f"{dtype.value} K{block_k} N{bn1} w{warps}: {err:.2e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_probe.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
