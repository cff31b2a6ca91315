"""GEMM2's own row tiles (MoEConfig.GEMM2_BLOCK_M): GEMM2 runs each BLOCK_M block of the alignment as BLOCK_M /
GEMM2_BLOCK_M tiles, and a tile of padding alone exits. Each output row is still one row's products, so the layer
is the one GEMM2 computes on BLOCK_M tiles; the configs it cannot serve are refused by name."""

from __future__ import annotations

import dataclasses
import os

import pytest
from kernel_helpers import (DEVICE, TRITON_DTYPE, RecordingKernel, gemm2_on_a_naive_batch, make_layer,
                            reference64, rel_err)
from test_fused_moe import triton_tol
from test_tail_tiles import COUNTS, _inputs

from moerules.activation import Activation
from moerules.errors import KernelInputError
from moerules.kernels.scheme import Scheme, quant_for_cell
from moerules.kernels.triton import config as config_module
from moerules.kernels.triton import launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_batched_config, check_config

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GEMM2_KERNEL = launch.gemm2_weighted_kernel


def _tile(**change) -> GemmConfig:
    return dataclasses.replace(GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=2), **change)


def _run(monkeypatch, cell: str, cfg: MoEConfig, lora_rank: int = 0):
    """(the layer's output on COUNTS' routing under cfg, its float64 reference, GEMM2's launch arguments)."""
    gemm2 = RecordingKernel(GEMM2_KERNEL)
    monkeypatch.setattr(launch, "gemm2_weighted_kernel", gemm2)
    block_k = 128 if "block128" in cell else 32  # K steps within a scale block
    cfg = dataclasses.replace(cfg, gemm1=dataclasses.replace(cfg.gemm1, BLOCK_K=block_k),
                              gemm2=dataclasses.replace(cfg.gemm2, BLOCK_K=block_k))
    monkeypatch.setattr(launch, "get_config", lambda **kwargs: cfg)
    layer = make_layer("triton.fused_moe", cell, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True,
                       device=DEVICE, H=256, I=128, lora_rank=lora_rank)
    x, ids, w = _inputs(layer, COUNTS)
    return layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w), gemm2.launches[-1]


# Cells of each kind of GEMM2 input and weight: unquantised, per-tensor FP8, 8-bit weights upcast, block-scaled FP8
# with per-group activations, and MX weights (whose tiles run swapped, launch.fragment_tiles).
CELLS = ["unquantized", "fp8_w8a8/tensor/tensor", "int8_w8a16/channel", "fp8_w8a8/block128/group128",
         "mxfp4_w4a16/group32"]
# (BLOCK_M, GEMM2_BLOCK_M, TAIL_M, swapped, sorted intermediate read by TMA): COUNTS' runs leave whole 16-row tiles
# of padding at every split (a 5-row run in a 32-row block, in a 64-row one three of four tiles); with 16-row tails
# (test_tail_tiles' rule) the parts of a 64-row tile start past tails of other experts, and the tails run whole.
SPLITS = [(32, 16, 0, False, False), (64, 16, 0, True, False), (64, 32, 0, False, True), (64, 32, 16, False, False),
          (64, 16, 16, True, True)]


@pytest.mark.parametrize("block_m, rows, tail_m, swap, sorted_tma", SPLITS)
@pytest.mark.parametrize("cell", CELLS)
def test_gemm2_row_tiles_give_the_block_m_layer(cell, block_m, rows, tail_m, swap, sorted_tma, poison_empty,
                                               monkeypatch):
    """Against the float64 reference within the cell's tolerance, and in the interpreter, whose sums run in one order,
    the layer of GEMM2 on BLOCK_M tiles within fp32 rounding; GEMM2 launched SPLIT tiles per row tile."""
    sortable = cell in ("unquantized", "fp8_w8a8/tensor/tensor", "int8_w8a16/channel")
    g2 = _tile(SWAP_AB=swap, TMA=sorted_tma and sortable)
    cfg = MoEConfig(BLOCK_M=block_m, gemm1=_tile(SWAP_AB=swap), gemm2=g2, SORTED_INTER=sorted_tma and sortable,
                    TAIL_M=tail_m)
    out, ref, args = _run(monkeypatch, cell, dataclasses.replace(cfg, GEMM2_BLOCK_M=rows))
    whole, _, whole_args = _run(monkeypatch, cell, cfg)
    assert (args["BLOCK_M"], args["SPLIT"], args["TAIL_M"], args["num_m_blocks"]) == (
        rows, block_m // rows, tail_m, whole_args["num_m_blocks"] * block_m // rows)
    assert rel_err(out, ref) < triton_tol(cell)
    if INTERPRETED:
        assert rel_err(out, whole) < 1e-6


def test_gemm2_row_tiles_take_the_lora_delta_by_slot(poison_empty, monkeypatch):
    """LoRA's GEMM2 shrink runs over the alignment's BLOCK_M blocks and is read back by slot in GEMM2's epilogue."""
    cfg = MoEConfig(BLOCK_M=32, gemm1=_tile(), gemm2=_tile())
    out, ref, args = _run(monkeypatch, "unquantized", dataclasses.replace(cfg, GEMM2_BLOCK_M=16), lora_rank=4)
    assert args["SPLIT"] == 2 and args["HAS_LORA"] and rel_err(out, ref) < triton_tol("unquantized")
    if INTERPRETED:
        assert rel_err(out, _run(monkeypatch, "unquantized", cfg, lora_rank=4)[0]) < 1e-6


@pytest.mark.parametrize("rows, message", [
    (8, r"^GEMM2_BLOCK_M=8 must be a power of two from 16 \(the smallest tl.dot tile\) below BLOCK_M=64, or 0 for "
        r"GEMM2 tiles of BLOCK_M rows$"),
    (48, r"^GEMM2_BLOCK_M=48 must be a power of two"),
    (64, r"^GEMM2_BLOCK_M=64 must be a power of two"),
])
def test_gemm2_rows_must_split_block_m_into_tl_dot_tiles(rows, message):
    with pytest.raises(ValueError, match=message):
        check_config(MoEConfig(BLOCK_M=64, gemm1=_tile(), gemm2=_tile(), GEMM2_BLOCK_M=rows),
                     Scheme.from_quant(quant_for_cell("unquantized")))


def test_gemm2_rows_must_hold_whole_tail_blocks():
    cfg = MoEConfig(BLOCK_M=128, gemm1=_tile(), gemm2=_tile(), TAIL_M=64, GEMM2_BLOCK_M=32)
    with pytest.raises(ValueError, match=r"^GEMM2_BLOCK_M=32: GEMM2's tiles are whole blocks of the alignment, "
                                         r"TAIL_M=64 rows each; make GEMM2_BLOCK_M at least TAIL_M$"):
        check_config(cfg, Scheme.from_quant(quant_for_cell("unquantized")))


def test_gemm2_rows_refuse_chained_launches():
    cfg = MoEConfig(BLOCK_M=64, gemm1=_tile(), gemm2=_tile(), GEMM2_BLOCK_M=32, CHAIN=True)
    with pytest.raises(ValueError, match=r"^GEMM2_BLOCK_M splits the BLOCK_M blocks of the sorted assignment, which "
                                         r"chained launches do not use; remove GEMM2_BLOCK_M or CHAIN$"):
        config_module._check_gemm2_rows(cfg)


def test_the_batched_kernels_refuse_gemm2_rows():
    with pytest.raises(ValueError, match=r"^GEMM2_BLOCK_M: the batched kernels run both GEMMs on BLOCK_M rows; "
                                         r"remove GEMM2_BLOCK_M$"):
        check_batched_config(MoEConfig(BLOCK_M=64, gemm1=_tile(), gemm2=_tile(), GEMM2_BLOCK_M=32),
                             Scheme.from_quant(quant_for_cell("unquantized")))


def test_a_naive_batch_is_refused_by_the_launch():
    """A config handed in (the tuner's path) on a decode batch, which the lookup never pairs with such an entry."""
    with pytest.raises(KernelInputError, match=r"^gemm2: GEMM2_BLOCK_M splits the blocks of the sorted assignment, "
                                               r"and this batch takes the naive one \(one slot per block, 4 \* slots "
                                               r"<= experts\): give it a config without GEMM2_BLOCK_M$"):
        gemm2_on_a_naive_batch(MoEConfig(BLOCK_M=32, gemm1=_tile(), gemm2=_tile(), GEMM2_BLOCK_M=16))


def test_gemm2_row_entries_serve_only_batches_of_the_sorted_assignment():
    table = {1: MoEConfig(BLOCK_M=32, gemm1=_tile(), gemm2=_tile(), GEMM2_BLOCK_M=16),
             64: MoEConfig(BLOCK_M=16, gemm1=_tile(), gemm2=_tile())}
    assert list(config_module._entries_for(table, rows_per_expert=0.1, gemv_rows=1, naive=True)) == [64]
    assert list(config_module._entries_for(table, rows_per_expert=0.1, gemv_rows=1, naive=False)) == [1, 64]


def test_gemm2_block_m_round_trips_through_a_data_file_entry():
    cfg = MoEConfig(BLOCK_M=64, gemm1=_tile(), gemm2=_tile(), GEMM2_BLOCK_M=32)
    assert cfg.to_dict()["GEMM2_BLOCK_M"] == 32 and MoEConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.gemm2_block_m == 32 and dataclasses.replace(cfg, GEMM2_BLOCK_M=0).gemm2_block_m == 64
    assert "GEMM2_BLOCK_M" not in dataclasses.replace(cfg, GEMM2_BLOCK_M=0).to_dict()
