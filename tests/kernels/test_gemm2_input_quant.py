"""GEMM2 quantising GEMM1's output itself at decode sizes (launch.gemm2_quantizes_input) computes what the
quantiser launched before it does: the same scale, the same quantised values, the same products."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import make_layer, random_inputs, reference64, rel_err

from moerules.activation import Activation, Dtype
from moerules.kernels.triton import launch

GPU = torch.cuda.is_available()


@pytest.mark.skipif(not GPU, reason="a GPU path: the interpreter's tl.dot on an fp8 tile converted in registers is wrong")
@pytest.mark.parametrize("cell", ["fp8_w8a8/tensor/tensor", "fp8_w8a8/channel/tensor"])
@pytest.mark.parametrize("M,top_k,E,I", [(1, 8, 128, 96), (13, 2, 8, 96), (16, 8, 128, 2048)])  # partial amaxes
def test_gemm2_quantises_its_input_as_the_quantiser_does(cell, M, top_k, E, I, monkeypatch):
    layer = make_layer("triton.fused_moe", cell, activation=Activation.silu, dtype=Dtype.bf16, E=E, H=256, I=I,
                       bias=True, device="cuda")
    x, ids, w = random_inputs(layer, M, top_k, device="cuda")
    assert launch.gemm2_quantizes_input(layer.weights, M * top_k, x.device)
    fused = layer(x, topk_ids=ids, topk_weights=w)
    monkeypatch.setattr(launch, "_GEMM2_QUANT_SLOTS", 0)
    separate = layer(x, topk_ids=ids, topk_weights=w)
    assert torch.equal(fused, separate)
    assert rel_err(fused, reference64(layer, x, ids, w)) < 3e-2


def test_only_dynamic_per_tensor_decode_batches_on_a_gpu():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    per_tensor = make_layer("triton.fused_moe", "fp8_w8a8/tensor/tensor").weights
    assert launch.gemm2_quantizes_input(per_tensor, 128, gpu)
    assert not launch.gemm2_quantizes_input(per_tensor, 129, gpu)
    assert not launch.gemm2_quantizes_input(per_tensor, 8, cpu)
    for cell in ("fp8_w8a8/tensor/tensor-static", "fp8_w8a8/channel/token", "int8_w8a8/channel/token",
                 "fp8_w8a8/block128/group128", "unquantized"):
        assert not launch.gemm2_quantizes_input(make_layer("triton.fused_moe", cell).weights, 8, gpu), cell
