"""Tail tiles (align.py): an expert's remainder of at most TAIL_M rows past its whole BLOCK_M tiles takes one swapped
TAIL_M-row tile in the same launch. The tile table against a model of the rule, its decoding in the GEMM kernels,
the layer computed with tails between other experts' full tiles, and the config checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from kernel_helpers import DEVICE, TRITON_DTYPE, make_layer, reference64, rel_err, run_with_config
from test_fused_moe import triton_tol

from moerules.activation import Activation
from moerules.kernels.scheme import TORCH_DTYPE, Scheme, quant_for_cell
from moerules.kernels.triton import align, launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config
from moerules.kernels.triton.fused_moe import _row_tile

# Runs of 40, 70, 5, 0, 33, 16, 17 and 19 rows: at BLOCK_M 32 / TAIL_M 16 these are a whole tile and a tail, two
# tiles and a padded one (70 - 64 = 6 is a tail), a lone tail, nothing, a tile and a 1-row tail, one tail filled
# exactly, and two remainders past TAIL_M that still pad to a whole tile.
COUNTS = [40, 70, 5, 0, 33, 16, 17, 19]


def routing(counts: list[int], seed: int = 0) -> torch.Tensor:
    """Top-k ids, shuffled, with counts[e] slots routed to expert e."""
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)])
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]


def model_tiles(counts: list[int], block_m: int, tail_m: int) -> tuple[list[int], list[int]]:
    """(the tile codes of the rule, each tail_m-row block's expert) for runs of counts[e] rows."""
    codes, block_experts, row = [], [], 0
    for e, c in enumerate(counts):
        full, rest = divmod(c, block_m)
        sizes = [block_m] * full + ([] if not rest else [tail_m] if rest <= tail_m else [block_m])
        for size in sizes:
            codes.append(2 * (row // tail_m) + (size == tail_m))
            block_experts += [e] * (size // tail_m)
            row += size
    return codes, block_experts


@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize("block_m, tail_m", [(32, 16), (128, 32), (64, 16)])
def test_the_tile_table_is_the_rule(one_program, block_m, tail_m, monkeypatch):
    if not one_program:
        monkeypatch.setattr(align, "_ONE_PROGRAM_SLOTS", 0)  # the grid-wide launches, on the same routing
    counts = [c * block_m // 32 for c in COUNTS]  # the same remainders relative to each block_m
    ids = routing(counts)
    a = align.moe_align(ids.to(DEVICE), num_experts=len(counts), block_m=block_m, tail_m=tail_m)
    codes, block_experts = model_tiles(counts, block_m, tail_m)
    assert a.block_rows == tail_m and a.num_tiles == align.max_blocks(ids.numel(), len(counts), block_m)
    assert a.tiles.cpu().tolist() == codes + [-1] * (a.num_tiles - len(codes))
    used = len(block_experts) * tail_m
    assert int(a.num_post_padded) == used
    assert a.expert_ids[:len(block_experts)].cpu().tolist() == block_experts
    rows = a.sorted_ids[:used].cpu().view(-1, tail_m)
    real = rows < ids.numel()
    assert sorted(rows[real].tolist()) == list(range(ids.numel()))  # every slot exactly once
    for b, e in enumerate(block_experts):
        assert (ids[rows[b][real[b]].long()] == e).all()


def test_no_slots_leave_every_tile_past_the_end():
    a = align.moe_align(torch.empty(0, 8, dtype=torch.int32, device=DEVICE), num_experts=8, block_m=32, tail_m=16)
    assert a.tiles.numel() == a.num_tiles == 0 and int(a.num_post_padded) == 0


def test_the_naive_assignment_has_no_tail_tiles():
    a = align.moe_align(torch.tensor([[3, 60]], dtype=torch.int32, device=DEVICE), num_experts=64, block_m=32,
                        tail_m=16)
    assert a.naive and a.tail_m == 0 and a.tiles is None and a.num_tiles == 2


@triton.jit
def _decode_kernel(tiles_ptr, out_ptr, TAIL_M: tl.constexpr):
    block, tail, past = _row_tile(tiles_ptr, tiles_ptr, tl.program_id(0), 32, TAIL_M, False)
    i = tl.arange(0, 4)
    tl.store(out_ptr + 3 * tl.program_id(0) + i, tl.where(i == 0, block, tl.where(i == 1, tail.to(tl.int32), past)),
             mask=i < 3)


def test_the_gemm_kernels_decode_each_tile_as_the_table_says():
    """(first block, tail, past the end) per tile: the GEMMs' reading of align.py's codes (past the end, only that)."""
    tiles = torch.tensor([0, 4, 5, 7, 10, -1], dtype=torch.int32, device=DEVICE)
    out = torch.full((3 * tiles.numel(),), 9, dtype=torch.int32, device=DEVICE)
    _decode_kernel[(tiles.numel(),)](tiles, out, TAIL_M=16)
    decoded = out.cpu().view(-1, 3).tolist()
    assert decoded[:-1] == [[0, 0, 0], [2, 0, 0], [2, 1, 0], [3, 1, 0], [5, 0, 0]] and decoded[-1][2] == 1


TAILS = MoEConfig(BLOCK_M=32, TAIL_M=16, gemm1=GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4,
                                                            num_stages=2),
                  gemm2=GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=2))


def _inputs(layer, counts: list[int]):
    """Top-2 routing with counts[e] slots on expert e (sorted slot i paired with slot i + half: no expert holds half
    the slots, so each token's two differ), tokens shuffled; random inputs and router weights."""
    slots = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)])
    half = slots.numel() // 2
    g = torch.Generator().manual_seed(2)
    ids = torch.stack([slots[:half], slots[half:]], dim=1)[torch.randperm(half, generator=g)]
    x = torch.randn(half, layer.hidden_size, generator=g).to(TORCH_DTYPE[layer.weights.in_dtype])
    w = torch.softmax(torch.randn(ids.shape, generator=g), dim=1)
    return x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("cell, swap_full, lora_rank", [
    ("unquantized", False, 0), ("unquantized", True, 0), ("fp8_w8a8/tensor/tensor", False, 0),
    ("unquantized", False, 4), ("mxfp4_w4a16/group32", True, 0), ("mxfp8/group32/group32", True, 0)])
def test_tail_tiles_compute_the_layer(cell, swap_full, lora_rank, poison_empty, monkeypatch):
    """Tails beside other experts' whole tiles (COUNTS), the whole tiles swapped or not, with LoRA, MX weights (the
    tuned MX tiles are all swapped): the float64 reference within the tolerance of the standard tiles, and the
    launches took the table."""
    cfg = dataclasses.replace(TAILS, gemm1=dataclasses.replace(TAILS.gemm1, SWAP_AB=swap_full),
                              gemm2=dataclasses.replace(TAILS.gemm2, SWAP_AB=swap_full))
    run_with_config(monkeypatch, lambda _: cfg)
    aligned = []
    real_align = align.moe_align
    monkeypatch.setattr(launch, "moe_align", lambda *a, **k: aligned.append(real_align(*a, **k)) or aligned[-1])
    layer = make_layer("triton.fused_moe", cell, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True,
                       device=DEVICE, lora_rank=lora_rank)
    x, ids, w = _inputs(layer, COUNTS)
    err = rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w))
    assert err < triton_tol(cell)
    assert [(a.block_m, a.tail_m, int(((a.tiles >= 0) & (a.tiles % 2 == 1)).sum())) for a in aligned] == [(32, 16, 5)]


@pytest.mark.parametrize("tail_m", [8, 24, 32, 64])
def test_a_tail_must_be_a_power_of_two_from_16_below_block_m(tail_m):
    with pytest.raises(ValueError, match=rf"^TAIL_M={tail_m} must be a power of two from 16 \(the smallest tl.dot "
                                         rf"tile\) below BLOCK_M=32, or 0 for no tail tiles$"):
        check_config(dataclasses.replace(TAILS, TAIL_M=tail_m), Scheme.from_quant(quant_for_cell("unquantized")))


def test_chained_launches_refuse_tail_tiles():
    g = dataclasses.replace(TAILS.gemm1, BLOCK_N=16)
    with pytest.raises(ValueError, match=r"^CHAIN: chained launches take the naive assignment, one slot per block, "
                                         r"so no tail tiles; remove TAIL_M from this config$"):
        check_config(MoEConfig(BLOCK_M=32, TAIL_M=16, gemm1=g, gemm2=g, CHAIN=True),
                     Scheme.from_quant(quant_for_cell("unquantized")))


def test_tail_m_round_trips_through_a_data_file_entry():
    assert TAILS.to_dict()["TAIL_M"] == 16 and MoEConfig.from_dict(TAILS.to_dict()) == TAILS
    no_tails = dataclasses.replace(TAILS, TAIL_M=0)
    assert "TAIL_M" not in no_tails.to_dict() and MoEConfig.from_dict(no_tails.to_dict()) == no_tails


def test_a_config_handed_to_the_launcher_is_checked_before_any_kernel_runs():
    """`launch.fused_moe(config=...)` (the tuner's and the probes' path) skips the file lookup and its check: a tail
    at BLOCK_M ran the kernels past their tile table on the H200 (cudaErrorInvalidAddressSpace, s42); now it is the
    config's ValueError."""
    layer = make_layer("triton.fused_moe", "unquantized", dtype=TRITON_DTYPE, device=DEVICE)
    x, ids, w = _inputs(layer, COUNTS)
    with pytest.raises(ValueError, match=r"^TAIL_M=32 must be a power of two from 16 \(the smallest tl.dot tile\) "
                                         r"below BLOCK_M=32, or 0 for no tail tiles$"):
        launch.fused_moe(x, a_scale=None, weights=layer.weights, topk_ids=ids, topk_weights=w,
                         activation=Activation.silu, quantize_intermediate=lambda inter, amaxes: (inter, None),
                         out_dtype=x.dtype, config=dataclasses.replace(TAILS, TAIL_M=32))
