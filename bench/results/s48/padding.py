"""Rows GEMM2 computes per real row (slot) at the grid's M >= 1024 points under the H100 files, as the aligned
blocks pad them, and with GEMM2 on 64- or 32-row tiles (MoEConfig.GEMM2_BLOCK_M: parts holding padding alone exit).
Routing as bench/moe.py's `Bench.inputs` draws it on the CPU. No GPU needed:

    PYTHONPATH=bench python bench/results/s48/padding.py > bench/results/s48/padding.txt
"""

import torch
from moe import MODELS, TIMED_SCHEMES

from moerules.kernels.routing import fused_topk
from moerules.kernels.scheme import Scheme
from moerules.kernels.triton.config import get_config

H100 = "NVIDIA H100 80GB HBM3"


def counts(name: str, M: int) -> list[int]:
    """Slots per expert of Bench.inputs(name, M) (seed 1: x first, then the router logits)."""
    m = MODELS[name]
    gen = torch.Generator().manual_seed(1)
    torch.randn(M, m.H, generator=gen)
    ids, _ = fused_topk(torch.randn(M, m.E, generator=gen), top_k=m.k, renormalize=True)
    return torch.bincount(ids.flatten(), minlength=m.E).tolist()


def gemm2_rows(runs: list[int], block_m: int, tail_m: int, rows: int) -> int:
    """GEMM2's computed rows: whole BLOCK_M tiles, a remainder of at most TAIL_M as one tail tile, else its BLOCK_M tile
    in parts of `rows` (0: whole) of which those holding padding alone exit."""
    total = 0
    for c in runs:
        full, rest = divmod(c, block_m)
        total += full * block_m
        if rest:
            total += tail_m if tail_m and rest <= tail_m else -(-rest // rows) * rows if rows else block_m
    return total


for name, m in MODELS.items():
    for sname in ("bf16", "fp8_tensor", "fp8_block"):
        if sname == "fp8_block" and name != "deepseek-v3":
            continue  # the grid's block-128 points
        for M in (1024, 4096, 16384):
            cfg = get_config(num_tokens=M, num_experts=m.E, intermediate=m.I, top_k=m.k,
                             scheme=Scheme.from_quant(TIMED_SCHEMES[sname]), in_dtype_name="bf16", device_name=H100)
            runs, real = counts(name, M), M * m.k
            split = "  ".join(f"g{g}: {gemm2_rows(runs, cfg.BLOCK_M, cfg.TAIL_M, g) / real:.3f}" for g in (64, 32)
                              if cfg.TAIL_M <= g < cfg.BLOCK_M)
            print(f"{name:14} {sname:10} M={M:5}  BLOCK_M {cfg.BLOCK_M:3} TAIL {cfg.TAIL_M:2}  rows/real "
                  f"{gemm2_rows(runs, cfg.BLOCK_M, cfg.TAIL_M, 0) / real:.3f}  {split}")
