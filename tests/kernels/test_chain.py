"""MoEConfig.CHAIN: GEMM1, GEMM2 and the top-k sum in one launch (chain.py).

The chained tiles are gemm1_tile's and gemm2_tile's, and the sum adds the slot rows in topk_sum's order, so the
output must equal the three launches' bit for bit; shapes are not multiples of the tiles (H=160, I=96), so edge
tiles and partial column blocks are covered."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_helpers import (DEVICE, TRITON_DTYPE, bench_module, make_layer, random_inputs, reference64, rel_err,
                            run_with_config)

from moerules.activation import Activation
from moerules.errors import KernelInputError
from moerules.kernels.scheme import Scheme, quant_for_cell
from moerules.kernels.triton import config, launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config

G1 = GemmConfig(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
G2 = GemmConfig(BLOCK_N=64, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
MMA = MoEConfig(BLOCK_M=16, gemm1=G1, gemm2=G2)
GEMV = MoEConfig(BLOCK_M=1, gemm1=G1, gemm2=G2)
SWAPPED = MoEConfig(BLOCK_M=16, gemm1=dataclasses.replace(G1, SWAP_AB=True), gemm2=dataclasses.replace(G2, SWAP_AB=True))
# MXFP4 tiles as fragment_tiles leaves them (whole 32-row slabs for the paired GEMM1 tile, K steps of 128 for GEMV).
MX = MoEConfig(BLOCK_M=16, gemm1=dataclasses.replace(G1, BLOCK_K=128), gemm2=dataclasses.replace(G2, BLOCK_K=128))
CHAINED = {"mma": MMA, "gemv": GEMV, "swapped": SWAPPED}


def chained(cfg: MoEConfig) -> MoEConfig:
    return dataclasses.replace(cfg, CHAIN=True)


def both_ways(monkeypatch, layer, cfg, *inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(the three launches' output, the chained launch's) of the layer on `inputs` with tile config `cfg`."""
    run_with_config(monkeypatch, lambda _: cfg)
    apart = layer(*inputs[:1], topk_ids=inputs[1], topk_weights=inputs[2])
    run_with_config(monkeypatch, lambda _: chained(cfg))
    return apart, layer(*inputs[:1], topk_ids=inputs[1], topk_weights=inputs[2])


def sync_counters_zero() -> bool:
    return all(not buf.any() for buffers in launch._CHAIN_SYNC.values() for buf in buffers)


@pytest.mark.parametrize("tiles", CHAINED)
@pytest.mark.parametrize("cell, activation, bias", [
    ("unquantized", Activation.silu, False),
    ("unquantized", Activation.swigluoai, True),   # interleaved gate/up pairs, biases in both GEMMs
    ("unquantized", Activation.gelu_no_mul, False),  # non-gated: GEMM1's tile holds BLOCK_N rows
    ("fp8_w8a16/tensor", Activation.silu, False),
    ("int8_w8a16/channel", Activation.silu, True),
])
@pytest.mark.parametrize("M, top_k", [(1, 4), (2, 8), (3, 1)])
def test_chained_equals_the_three_launches(tiles, cell, activation, bias, M, top_k, poison_empty, monkeypatch):
    layer = make_layer("triton.fused_moe", cell, activation=activation, dtype=TRITON_DTYPE, bias=bias, E=64,
                       device=DEVICE)
    inputs = random_inputs(layer, M, top_k, device=DEVICE)
    apart, together = both_ways(monkeypatch, layer, CHAINED[tiles], *inputs)
    assert torch.equal(together, apart)
    assert sync_counters_zero()


@pytest.mark.parametrize("block_m", [16, 1])
def test_chained_mxfp4_equals_the_three_launches(block_m, poison_empty, monkeypatch):
    """gpt-oss's arithmetic: MXFP4 weights in fragment order, swigluoai, biases."""
    layer = make_layer("triton.fused_moe", "mxfp4_w4a16/group32", activation=Activation.swigluoai, bias=True,
                       dtype=TRITON_DTYPE, E=64, device=DEVICE)
    inputs = random_inputs(layer, 2, 4, device=DEVICE)
    apart, together = both_ways(monkeypatch, layer, dataclasses.replace(MX, BLOCK_M=block_m), *inputs)
    assert torch.equal(together, apart)


def test_chained_output_is_the_layer(poison_empty, monkeypatch):
    """Not only the same as the other path: the float64 reference's, within test_fused_moe's tolerance."""
    run_with_config(monkeypatch, lambda _: chained(MMA))
    layer = make_layer("triton.fused_moe", activation=Activation.swigluoai, bias=True, dtype=TRITON_DTYPE, E=64,
                       device=DEVICE)
    x, ids, w = random_inputs(layer, 2, 8, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < 8e-3


def test_every_call_starts_from_zeroed_counters(poison_empty, monkeypatch):
    """The last program resets the counters: repeated calls, and a call with more slots after one with fewer,
    give each call's own output (a stale counter would release GEMM2 tiles early or sum twice)."""
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, E=64, device=DEVICE)
    small, large = random_inputs(layer, 1, 4, device=DEVICE), random_inputs(layer, 2, 8, seed=2, device=DEVICE)
    apart_small, first = both_ways(monkeypatch, layer, MMA, *small)
    apart_large, _ = both_ways(monkeypatch, layer, MMA, *large)
    for inputs, expected in [(small, apart_small), (large, apart_large), (small, apart_small)]:
        assert torch.equal(layer(inputs[0], topk_ids=inputs[1], topk_weights=inputs[2]), expected)
        assert sync_counters_zero()


def test_remote_slots_add_nothing(monkeypatch):
    """Under EP a slot whose expert is on another rank (-1) leaves its zeroed row: the token sums the others."""
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, E=64, device=DEVICE)
    x, ids, w = random_inputs(layer, 2, 4, device=DEVICE)
    ids = ids.clone()
    ids[0, 1] = ids[1, 3] = -1
    x_q = x.contiguous()

    def run(cfg):
        return launch.fused_moe(x_q, a_scale=None, weights=layer.weights, topk_ids=ids, topk_weights=w,
                                activation=Activation.silu, quantize_intermediate=lambda t, a: (t, None),
                                out_dtype=x.dtype, config=cfg, remote_slots=True)
    assert torch.equal(run(chained(MMA)), run(MMA))


def test_chained_is_one_launch(monkeypatch):
    """Neither GEMM kernel nor the top-k sum is launched."""
    for name in ("gemm1_gated_kernel", "gemm2_weighted_kernel", "topk_sum"):
        monkeypatch.setattr(launch, name, None)
    run_with_config(monkeypatch, lambda _: chained(MMA))
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, E=64, device=DEVICE)
    x, ids, w = random_inputs(layer, 1, 4, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < 8e-3


def test_a_batch_past_the_naive_assignment_is_refused(monkeypatch):
    run_with_config(monkeypatch, lambda _: chained(MMA))
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, E=8, device=DEVICE)
    x, ids, w = random_inputs(layer, 3, 2, device=DEVICE)
    with pytest.raises(KernelInputError, match=r"^CHAIN runs decode batches under the naive assignment \(4 \* slots "
                                               r"<= experts\) and without LoRA; this one has 6 slots for 8 experts: "
                                               r"give it a config without CHAIN$"):
        layer(x, topk_ids=ids, topk_weights=w)


def test_lora_is_refused(monkeypatch):
    run_with_config(monkeypatch, lambda _: chained(MMA))
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, E=64, device=DEVICE, lora_rank=4)
    x, ids, w = random_inputs(layer, 1, 2, device=DEVICE)
    with pytest.raises(KernelInputError, match=r"this one has 2 slots for 64 experts and LoRA adapters: give it a "
                                               r"config without CHAIN$"):
        layer(x, topk_ids=ids, topk_weights=w)


@pytest.mark.parametrize("cell", ["fp8_w8a8/tensor/tensor", "int8_w8a8/channel/token", "mxfp8/group32/group32"])
def test_a_quantised_intermediate_is_refused(cell):
    with pytest.raises(ValueError, match=rf"^CHAIN: GEMM2 must read the intermediate unquantised, and {cell} "
                                         r"quantises it; remove CHAIN from this config$"):
        check_config(chained(MX), Scheme.from_quant(quant_for_cell(cell)))


@pytest.mark.parametrize("gemm2, message", [
    (dataclasses.replace(G2, num_warps=8), r"^CHAIN: one launch runs both GEMMs, so gemm1 and gemm2 need the same "
                                           r"num_warps and MAXNREG \(here 4/None and 8/None\)$"),
    (dataclasses.replace(G2, MAXNREG=128), r"\(here 4/None and 4/128\)$"),
    (dataclasses.replace(G2, TMA=True), r'^CHAIN: the chained tiles load their weights by address; set "TMA": false '
                                        r"in both GEMMs$"),
])
def test_one_launch_needs_one_warp_count_and_address_loads(gemm2, message):
    with pytest.raises(ValueError, match=message):
        check_config(MoEConfig(BLOCK_M=16, gemm1=G1, gemm2=gemm2, CHAIN=True), Scheme.from_quant(quant_for_cell(
            "unquantized")))


@pytest.mark.parametrize("num_tokens, expected", [(1, chained(MMA)), (4, chained(MMA)), (5, MMA)])
def test_chained_entries_serve_naive_batches_only(monkeypatch, num_tokens, expected):
    """Qwen3-30B-A3B's shape (E=128, top-8): M <= 4 takes the naive assignment and the chained M=1 entry; M=5 the
    nearest entry that is not chained, though M=1's is nearer."""
    monkeypatch.setattr(config, "_load_file", lambda name: {1: chained(MMA), 64: MMA})
    got = config.get_config(num_tokens=num_tokens, num_experts=128, intermediate=768, top_k=8,
                            scheme=Scheme.from_quant(quant_for_cell("unquantized")), in_dtype_name="bf16",
                            device_name="NVIDIA H200")
    assert got == expected


def test_chain_round_trips_through_a_data_file_entry():
    assert chained(MMA).to_dict()["CHAIN"] is True
    assert MoEConfig.from_dict(chained(MMA).to_dict()) == chained(MMA)
    assert "CHAIN" not in MMA.to_dict() and MoEConfig.from_dict(MMA.to_dict()) == MMA


def test_the_tile_probe_times_a_chained_variant(monkeypatch):
    """bench/tma_probe.py --tile 'chain={"CHAIN": true}': the config in use, chained."""
    name, change = bench_module(monkeypatch, "tma_probe").tile_variant('chain={"CHAIN": true}')
    assert (name, change(MMA, {})) == ("chain", chained(MMA))


@pytest.mark.parametrize("num_tokens, chains", [(1, False), (2, False), (3, True), (4, True), (5, False)])
def test_the_h200_file_chains_qwen3_decode_at_three_and_four_tokens(num_tokens, chains):
    """Qwen3-30B-A3B bf16 on the H200: chained 1.06x / 1.09x faster at M=3 / 4, 0.94-0.98x at M=1-2 (bench/results/
    s39); M=5 is past the naive assignment."""
    got = config.get_config(num_tokens=num_tokens, num_experts=128, intermediate=768, top_k=8,
                            scheme=Scheme.from_quant(quant_for_cell("unquantized")), in_dtype_name="bf16",
                            device_name="NVIDIA H200")
    assert got.CHAIN is chains


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_chained_forward_replays_to_the_eager_output(monkeypatch):
    """As a serving engine runs decode: the forward captured in a CUDA graph (on torch's capture stream, whose
    counter buffer is first made inside the capture) and replayed, between eager calls on the default stream."""
    run_with_config(monkeypatch, lambda _: chained(MMA))
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, E=64, device=DEVICE)
    x, ids, w = random_inputs(layer, 2, 8, device=DEVICE)
    eager = layer(x, topk_ids=ids, topk_weights=w)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x, topk_ids=ids, topk_weights=w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(x, topk_ids=ids, topk_weights=w)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        assert torch.equal(layer(x, topk_ids=ids, topk_weights=w), eager)
    assert sync_counters_zero()
