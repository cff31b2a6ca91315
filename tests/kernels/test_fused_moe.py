"""Every (backend x scheme x activation) cell runnable here, against a float64 reference.

The reference consumes the same quantised input and re-quantises the intermediate the same
way, so the tolerances bound the kernels' own arithmetic (fp32 accumulation, in_dtype
output and intermediate rounding), not quantisation noise:
  unquantised / W8A16, fp16 out:   2e-3  (fp16 rounding is ~3e-4 relative); bf16 out (GPU): 8e-3
  W8A8:                            1e-2  (a 1-ulp difference in the fp16 intermediate can flip
                                          one fp8/int8 rounding of the GEMM2 input)
  bf16 out (reference, grouped_mm): 2e-2 (bf16 rounding is ~3e-3; grouped_mm also rounds the
                                          GEMM1 output to bf16 before the activation)
Shapes are small and not multiples of any block (H=160, I=96) to keep CI at a few minutes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (DEVICE, TILE_VARIANTS, TRITON_DTYPE, make_layer, random_inputs, reference64, rel_err,
                            run_with_config)

from moerules.activation import Activation, Dtype, SwigluParams
from moerules.kernels.activations import GATED_ACTIVATIONS
from moerules.kernels.scheme import scheme_cells

CELLS = list(scheme_cells())
ACTIVATIONS = sorted(GATED_ACTIVATIONS, key=lambda a: a.value)


def triton_tol(cell: str) -> float:
    if "w8a8" in cell:
        return 1e-2
    return 2e-3 if TRITON_DTYPE == Dtype.fp16 else 8e-3  # bf16 output rounding is ~8x coarser


@pytest.mark.parametrize("cell", CELLS)
def test_triton_every_cell(cell, poison_empty):
    # Biases on, swigluoai (interleaved, clamped) on the quantised cells: the hardest epilogue everywhere.
    layer = make_layer("triton.fused_moe", cell, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True,
                       device=DEVICE)
    x, ids, w = random_inputs(layer, 13, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < triton_tol(cell)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a8/block128/group128", "int8_w8a8/channel/token"])
def test_triton_every_activation(cell, activation, poison_empty):
    layer = make_layer("triton.fused_moe", cell, activation=activation, dtype=TRITON_DTYPE, device=DEVICE)
    x, ids, w = random_inputs(layer, 11, 3, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < triton_tol(cell)


@pytest.mark.parametrize("M,top_k,E", [
    (1, 2, 8),      # M=1: 6 of 8 experts get no token
    (1, 1, 64),     # top_k=1 and the naive (one block per slot) assignment path
    (3, 4, 64),     # naive path with several slots
    (70, 2, 4),     # several BLOCK_M blocks per expert
    (40, 1, 16),    # top_k=1 through the sorted path
])
@pytest.mark.parametrize("variant", [None, "one_row"])
def test_triton_edge_shapes(M, top_k, E, variant, poison_empty, monkeypatch):
    if variant:
        run_with_config(monkeypatch, TILE_VARIANTS[variant])
    layer = make_layer("triton.fused_moe", "fp8_w8a8/channel/token", dtype=TRITON_DTYPE, E=E, H=144, I=80,
                       device=DEVICE)
    x, ids, w = random_inputs(layer, M, top_k, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < 1e-2


@pytest.mark.parametrize("kernel_id", ["triton.fused_moe", "torch.grouped_mm", "torch.reference"])
def test_zero_tokens(kernel_id):
    dtype = TRITON_DTYPE if kernel_id == "triton.fused_moe" else Dtype.bf16
    layer = make_layer(kernel_id, dtype=dtype, device=DEVICE)
    x, ids, w = random_inputs(layer, 0, 2, device=DEVICE)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert out.shape == (0, layer.hidden_size) and out.dtype == x.dtype


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [Dtype.bf16, Dtype.fp32])
def test_grouped_mm_unquantized(dtype, activation):
    layer = make_layer("torch.grouped_mm", dtype=dtype, activation=activation, bias=True, device=DEVICE)
    x, ids, w = random_inputs(layer, 9, 2, device=DEVICE)
    tol = 2e-2 if dtype == Dtype.bf16 else 1e-5
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_grouped_mm is CUDA-only")
def test_grouped_mm_fp8_rowwise():
    layer = make_layer("torch.grouped_mm", "fp8_w8a8/channel/token", dtype=Dtype.bf16, H=256, I=128, device=DEVICE)
    x, ids, w = random_inputs(layer, 33, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < 3e-2


@pytest.mark.parametrize("cell", CELLS)
def test_reference_backend_bf16(cell):
    """The fp32 CPU backend itself, in bf16, against the float64 yardstick."""
    layer = make_layer("torch.reference", cell, dtype=Dtype.bf16, activation=Activation.gelu, bias=True,
                       device=DEVICE)
    x, ids, w = random_inputs(layer, 7, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < 2e-2


def test_reference_matches_dense_math():
    """The yardstick itself, for the unquantised case, against a direct per-token formula."""
    layer = make_layer("torch.reference", dtype=Dtype.fp32, activation=Activation.silu, bias=True)
    x, ids, w = random_inputs(layer, 5, 2)
    W = layer.weights
    expected = torch.zeros(5, layer.hidden_size, dtype=torch.float64)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            h = W.w13[e].double() @ x[t].double() + W.w13_bias[e].double()
            g, u = h.chunk(2)
            y = W.w2[e].double() @ (torch.nn.functional.silu(g) * u).float().double() + W.w2_bias[e].double()
            expected[t] += w[t, j].double() * y
    assert rel_err(reference64(layer, x, ids, w), expected) < 1e-6


# Clamps most pre-activations of these random layers (they are O(1)), so the parameters decide the output.
MODEL_SWIGLU = SwigluParams(limit=0.5, alpha=1.2)


@pytest.mark.parametrize("kernel_id", ["triton.fused_moe", "torch.grouped_mm", "torch.reference"])
def test_a_models_swiglu_limit_and_alpha_reach_the_kernel(kernel_id, poison_empty):
    layer = make_layer(kernel_id, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True, device=DEVICE,
                       swiglu=MODEL_SWIGLU)
    x, ids, w = random_inputs(layer, 13, 2, device=DEVICE)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert rel_err(out, reference64(layer, x, ids, w)) < 2e-2
    layer.experts.swiglu = SwigluParams()  # gpt-oss's 7.0 / 1.702: what the kernels hard-coded before
    assert rel_err(out, reference64(layer, x, ids, w)) > 0.2


@pytest.mark.parametrize("variant", TILE_VARIANTS)
@pytest.mark.parametrize("cell", CELLS)
def test_triton_tile_variants_every_cell(cell, variant, poison_empty, monkeypatch):
    """Each tile variant computes the same layer as the standard tiles, in every scheme."""
    run_with_config(monkeypatch, TILE_VARIANTS[variant])
    layer = make_layer("triton.fused_moe", cell, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True,
                       device=DEVICE)
    x, ids, w = random_inputs(layer, 13, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < triton_tol(cell)
