"""Shared builders for the kernel tests."""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path

import pytest
import torch

from moerules.activation import Activation, Dtype
from moerules.kernels import build_layer, make_random_lora, make_random_weights
from moerules.kernels.reference import moe_reference
from moerules.kernels.routing import fused_topk
from moerules.kernels.scheme import TORCH_DTYPE, Scheme
from moerules.kernels.scheme import quant_for_cell as quant_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Dtype for Triton tests: bf16 where tl.dot computes it right (GPU), fp16 under the interpreter (conftest.py).
TRITON_DTYPE = Dtype.bf16 if torch.cuda.is_available() else Dtype.fp16


def needs_interpreter(why: str) -> pytest.MarkDecorator:
    """Skip unless the Triton interpreter runs (CPU): `why` says what needs it."""
    return pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=why)


def make_layer(kernel_id: str, cell: str = "unquantized", *, activation=Activation.silu, dtype=Dtype.fp16,
               E=8, H=160, I=96, bias=False, seed=0, device="cpu", lora_rank=0, weights=None, **kw):
    """A layer on seeded random weights (gated as `activation` is), with random LoRA adapters if lora_rank;
    `weights`: these instead of random ones (E, H, I, bias and seed are then unused)."""
    w = weights or make_random_weights(num_experts=E, hidden=H, intermediate=I, quant=quant_of(cell), in_dtype=dtype,
                                       has_bias=bias, seed=seed, device=device, gated=activation.gated)
    if lora_rank:
        w.lora = make_random_lora(num_experts=E, hidden=H, intermediate=I, rank=lora_rank, in_dtype=dtype,
                                  gated=activation.gated, seed=seed + 100, device=device)
    kw.setdefault("weight_block", Scheme.from_quant(quant_of(cell)).weight_k_block)  # as the rules set it
    return build_layer(kernel_id=kernel_id, prepare_finalize_id="local", quant=quant_of(cell), activation=activation,
                       in_dtype=dtype, activation_format="standard", weights=w, device=device, **kw)


def random_inputs(layer, M: int, top_k: int, *, seed: int = 1, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, layer.hidden_size, generator=g, device=device).to(TORCH_DTYPE[layer.weights.in_dtype])
    ids, w = fused_topk(torch.randn(M, layer.weights.num_experts, generator=g, device=device), top_k=top_k,
                        renormalize=True)
    return x, ids, w


def reference64(layer, x, ids, w) -> torch.Tensor:
    """float64 reference on the same prepared (quantised) input as the layer's experts see."""
    pf = layer.prepare_finalize
    p = pf.prepare(x, topk_ids=ids, topk_weights=w, defer_input_quant=False, a13_scale=layer.weights.a13_scale)
    out = moe_reference(p.hidden_q, weights=layer.weights, topk_ids=ids, topk_weights=w, a_scale=p.a_scale,
                        activation=layer.experts.activation, compute_dtype=torch.float64, swiglu=layer.experts.swiglu)
    return pf.finalize(out, prepared=p, hidden_size=layer.hidden_size)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/Inf (an element was not written?)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def _both_gemms(cfg, **fields):
    return dataclasses.replace(cfg, gemm1=dataclasses.replace(cfg.gemm1, **fields),
                               gemm2=dataclasses.replace(cfg.gemm2, **fields))


def run_with_config(monkeypatch, change) -> None:
    """Every config the layer looks up is passed through `change` (as a tuned file could set it)."""
    from moerules.kernels.triton import launch

    real_get_config = launch.get_config
    monkeypatch.setattr(launch, "get_config", lambda **kwargs: change(real_get_config(**kwargs)))


# SWAP_AB: the weights on the MMA's M side (transposed loads, scale broadcasts, the accumulator's transpose
# before the epilogue). BLOCK_M 1: the GEMV path, on CUDA cores (fused_moe._row_dot), in both orientations.
TILE_VARIANTS = {
    "swapped": lambda cfg: _both_gemms(cfg, SWAP_AB=True),
    "one_row": lambda cfg: dataclasses.replace(cfg, BLOCK_M=1),
    "one_row_swapped": lambda cfg: dataclasses.replace(_both_gemms(cfg, SWAP_AB=True), BLOCK_M=1),
    # 64-row blocks: mostly padding at these shapes, so masked rows in every K step of every cell
    "blocks_of_64": lambda cfg: dataclasses.replace(cfg, BLOCK_M=64),
    # tail tiles (align.py): at these shapes every expert's rows fit one 16-row tail tile, swapped
    "tail_tiles": lambda cfg: dataclasses.replace(cfg, BLOCK_M=32, TAIL_M=16),
}


def bench_module(monkeypatch, name: str):
    """A script of bench/ (vllm_triton, tk_mxfp4) imported as a module, as the scripts import each other."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    return importlib.import_module(name)


class RecordingKernel:
    """A jit kernel's stand-in that records the grid and keyword arguments of each launch, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.grids = kernel, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            self.grids.append(grid)
            return self.kernel[grid](*args, **kwargs)
        return launch


def gemm2_on_a_naive_batch(cfg) -> None:
    """launch.gemm2 with `cfg` handed in (the tuner's path) on a two-slot decode batch of 64 experts, which takes
    the naive assignment: for configs the lookup never pairs with such a batch, whose launch must refuse it."""
    from moerules.kernels.triton import launch
    from moerules.kernels.triton.align import moe_align
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, device=DEVICE, E=64)
    align = moe_align(torch.tensor([[3, 60]], dtype=torch.int32, device=DEVICE), num_experts=64, block_m=cfg.BLOCK_M)
    assert align.naive
    inter = torch.zeros(2, layer.weights.intermediate, dtype=torch.float16, device=DEVICE)
    launch.gemm2(inter, None, weights=layer.weights, topk_weights=torch.ones(1, 2, device=DEVICE), align=align,
                 cfg=cfg, out=torch.empty(2, layer.hidden_size, dtype=torch.float16, device=DEVICE))
