"""The intermediate laid out by aligned row (MoEConfig.SORTED_INTER): GEMM1 stores the r-th row of the sorted order
at row r, GEMM2 reads each A tile as one box of rows (by address, or by TMA with gemm2.TMA). It moves values, never
changes them: every cell that can sort gives the unsorted output bit for bit; the others are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_helpers import DEVICE, TRITON_DTYPE, bench_module, make_layer, quant_of, random_inputs, run_with_config

from moerules.activation import Activation
from moerules.errors import KernelInputError
from moerules.kernels.scheme import Scheme, scheme_cells
from moerules.kernels.triton import config as config_module
from moerules.kernels.triton import launch
from moerules.kernels.triton.align import moe_align
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config


def _layout(sort: bool, tma: bool, **change):
    return lambda cfg: dataclasses.replace(cfg, SORTED_INTER=sort, gemm2=dataclasses.replace(cfg.gemm2, TMA=tma),
                                           **change)


# Each variant is compared with the same tiles laid out by slot: other tiles may round differently (on the H100 the
# FP8 cell's 32-row tiles with swapped 16-row tails quantise a few intermediate values one FP8 step apart).
SORTED_VARIANTS = {
    "by_address": dict(tma=False),
    "by_tma": dict(tma=True),
    # tail tiles (align.py), read by address under TMA: 32-row tiles and 16-row tails (TAILS_M tokens give both)
    "tails_by_address": dict(tma=False, BLOCK_M=32, TAIL_M=16),
    "tails_by_tma": dict(tma=True, BLOCK_M=32, TAIL_M=16),
}
TAILS_M = 70  # 140 slots on 8 experts


def _sortable(cell: str) -> bool:
    g = GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    try:
        check_config(MoEConfig(BLOCK_M=16, gemm1=g, gemm2=g, SORTED_INTER=True), Scheme.from_quant(quant_of(cell)))
    except ValueError:
        return False
    return True


SORTABLE = [c for c in scheme_cells() if _sortable(c)]


def _forward(cell: str, monkeypatch, change=None, *, lora_rank: int = 0, M: int = 13) -> torch.Tensor:
    with monkeypatch.context() as m:
        if change:
            run_with_config(m, change)
        layer = make_layer("triton.fused_moe", cell, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True,
                           device=DEVICE, lora_rank=lora_rank)
        x, ids, w = random_inputs(layer, M, 2, device=DEVICE)
        assert not moe_align(ids, num_experts=layer.weights.num_experts, block_m=16).naive
        return layer(x, topk_ids=ids, topk_weights=w)


def test_the_sortable_cells_are_the_unquantised_and_per_tensor_intermediates():
    assert "unquantized" in SORTABLE and "fp8_w8a8/tensor/tensor" in SORTABLE and "int8_w8a16/channel" in SORTABLE
    assert not [c for c in SORTABLE if "token" in c or "group" in c or c.startswith("mx")]


# Tail tiles change only which rows a tile starts at, not the arithmetic: three cells (one per kind of GEMM2 input)
# cover them, every sortable cell the plain tiles.
TAIL_CELLS = ["unquantized", "fp8_w8a8/tensor/tensor", "int8_w8a16/channel"]
CASES = [(c, v) for c in SORTABLE for v in SORTED_VARIANTS if not v.startswith("tails") or c in TAIL_CELLS]


@pytest.mark.parametrize("cell,variant", CASES)
def test_a_sorted_intermediate_gives_the_slot_ordered_output_bit_for_bit(cell, variant, poison_empty, monkeypatch):
    """Buffers poisoned with NaN: a row GEMM1 did not write, or GEMM2 read from the wrong row, would show."""
    M = TAILS_M if variant.startswith("tails") else 13
    unsorted = _forward(cell, monkeypatch, _layout(False, **SORTED_VARIANTS[variant]), M=M)
    assert torch.isfinite(unsorted).all()
    assert torch.equal(_forward(cell, monkeypatch, _layout(True, **SORTED_VARIANTS[variant]), M=M), unsorted)


def test_lora_keeps_the_slot_layout(poison_empty, monkeypatch):
    """LoRA's GEMM2 shrink reads the intermediate by slot, so a sorted config runs unsorted there, same bits."""
    assert torch.equal(_forward("unquantized", monkeypatch, _layout(True, tma=False), lora_rank=4),
                       _forward("unquantized", monkeypatch, _layout(False, tma=False), lora_rank=4))


@pytest.mark.parametrize("change", [dict(BLOCK_M=1), dict(CHAIN=True)])
def test_layouts_without_sorted_blocks_are_refused(change):
    g = GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    cfg = dataclasses.replace(MoEConfig(BLOCK_M=16, gemm1=g, gemm2=g, SORTED_INTER=True), **change)
    with pytest.raises(ValueError, match=r"^SORTED_INTER: the intermediate is laid out by the blocks of the sorted "
                                         r"assignment, which GEMV rows \(BLOCK_M 1\) and chained launches do not use; "
                                         r"remove SORTED_INTER from this config$"):
        check_config(cfg, Scheme.from_quant(quant_of("unquantized")))


@pytest.mark.parametrize("cell", ["fp8_w8a8/channel/token", "fp8_w8a8/block128/group128", "mxfp4_w4a16/group32"])
def test_intermediates_scaled_by_row_are_refused(cell):
    g = GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    scheme = Scheme.from_quant(quant_of(cell))
    with pytest.raises(ValueError, match=rf"^SORTED_INTER: {cell} gives the intermediate scales per row or group, "
                                         rf"which GEMM2 reads by slot; only unquantised and per-tensor intermediates "
                                         rf"can be sorted, so remove SORTED_INTER from this config$"):
        check_config(MoEConfig(BLOCK_M=16, gemm1=g, gemm2=g, SORTED_INTER=True), scheme)


def test_a_buffer_of_the_other_layout_is_refused_before_any_launch():
    layer = make_layer("triton.fused_moe", dtype=TRITON_DTYPE, device=DEVICE)
    w = layer.weights
    x, ids, _ = random_inputs(layer, 13, 2, device=DEVICE)
    g = GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    cfg = MoEConfig(BLOCK_M=16, gemm1=g, gemm2=g, SORTED_INTER=True)
    align = moe_align(ids, num_experts=w.num_experts, block_m=16)
    slot_rows = torch.empty(ids.numel(), w.intermediate, dtype=x.dtype, device=DEVICE)
    rows = align.num_blocks * 16
    with pytest.raises(KernelInputError, match=rf"^gemm1: the intermediate has {ids.numel()} rows, and this config "
                                               rf"lays it out in {rows}, one per aligned row \(SORTED_INTER\); "
                                               rf"allocate it with launch.intermediate_buffer$"):
        launch.gemm1(x, None, weights=w, align=align, cfg=cfg, activation=layer.experts.activation, out=slot_rows,
                     top_k=2)
    assert launch.intermediate_buffer(w, align, cfg, num_slots=ids.numel(), dtype=x.dtype).shape == \
        (rows, w.intermediate)


def test_sorted_entries_serve_only_batches_of_the_sorted_assignment():
    g = GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    table = {1: MoEConfig(BLOCK_M=16, gemm1=g, gemm2=g, SORTED_INTER=True), 64: MoEConfig(BLOCK_M=16, gemm1=g, gemm2=g)}
    assert list(config_module._entries_for(table, rows_per_expert=0.1, gemv_rows=1, naive=True)) == [64]
    assert list(config_module._entries_for(table, rows_per_expert=0.1, gemv_rows=1, naive=False)) == [1, 64]


def test_the_field_is_written_only_where_set():
    g = GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    cfg = MoEConfig(BLOCK_M=16, gemm1=g, gemm2=g, SORTED_INTER=True)
    assert cfg.to_dict()["SORTED_INTER"] is True and MoEConfig.from_dict(cfg.to_dict()) == cfg
    assert "SORTED_INTER" not in dataclasses.replace(cfg, SORTED_INTER=False).to_dict()


def test_the_gemm2_probe_runs_warp_specialised_variants_only_when_asked(monkeypatch):
    """Their first launch never returned on the H100 (bench/results/s46), and a hung launch holds the device's call."""
    probe = bench_module(monkeypatch, "sorted_gemm2_probe")
    plain = probe.variants(128)
    assert list(plain) == ["n128k128s3", "n256k64s4", "n128k64s4",
                           "n128k128s3_persist", "n256k64s4_persist", "n128k64s4_persist"]
    asked = probe.variants(128, warp_specialized=True)
    assert list(asked)[:6] == list(plain)
    assert list(asked)[6:] == ["n128k128s3_persist_ws", "n256k64s4_persist_ws", "n128k64s4_persist_ws"]
    assert all(f["WS"] and f["num_warps"] == 4 for n, f in asked.items() if n.endswith("_ws"))
