"""Persistent GEMMs (GemmConfig.PERSISTENT): PERSISTENT programs per SM, each running tiles in turn with the K loops
flattened into one. Every tile computes what it computes one program per tile, so the layer is the one-program-per-
tile layer (bit-equal in the interpreter, whose sums run in one order); GEMM1's per-program amaxes cover all of a
program's tiles; the configs and batches it cannot serve are refused by name."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl
from kernel_helpers import (DEVICE, TRITON_DTYPE, RecordingKernel, gemm2_on_a_naive_batch, make_layer,
                            needs_interpreter, reference64, rel_err)
from test_fused_moe import triton_tol
from test_tail_tiles import COUNTS, _inputs

from moerules.activation import Activation
from moerules.errors import KernelInputError
from moerules.kernels.scheme import Scheme, quant_for_cell
from moerules.kernels.triton import config as config_module
from moerules.kernels.triton import fused_moe, launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config
from moerules.kernels.triton.device import sm_count

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
UNQUANTIZED = Scheme.from_quant(quant_for_cell("unquantized"))


def _tile(**change) -> GemmConfig:
    return dataclasses.replace(GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=2), **change)


def _persistent(cfg: MoEConfig, programs_per_sm: int) -> MoEConfig:
    return dataclasses.replace(cfg, gemm1=dataclasses.replace(cfg.gemm1, PERSISTENT=programs_per_sm),
                               gemm2=dataclasses.replace(cfg.gemm2, PERSISTENT=programs_per_sm))


def _run(monkeypatch, cell: str, cfg: MoEConfig, *, activation=Activation.swigluoai, lora_rank: int = 0):
    """(the layer's output on COUNTS' routing under cfg, its float64 reference, each GEMM's launch: (grid, keyword
    arguments), GEMM1's partial amaxes or None)."""
    kernels = {name: RecordingKernel(getattr(launch, name)) for name in ("gemm1_gated_kernel", "gemm2_weighted_kernel")}
    for name, kernel in kernels.items():
        monkeypatch.setattr(launch, name, kernel)
    amaxes = []
    real_gemm1 = launch.gemm1
    monkeypatch.setattr(launch, "gemm1", lambda *a, **kw: amaxes.append(real_gemm1(*a, **kw)) or amaxes[-1])
    block_k = 128 if "block128" in cell else 32  # K steps within a scale block
    cfg = dataclasses.replace(cfg, gemm1=dataclasses.replace(cfg.gemm1, BLOCK_K=block_k),
                              gemm2=dataclasses.replace(cfg.gemm2, BLOCK_K=block_k))
    monkeypatch.setattr(launch, "get_config", lambda **kwargs: cfg)
    layer = make_layer("triton.fused_moe", cell, activation=activation, dtype=TRITON_DTYPE, bias=True,
                       device=DEVICE, H=256, I=128, lora_rank=lora_rank)
    x, ids, w = _inputs(layer, COUNTS)
    out = layer(x, topk_ids=ids, topk_weights=w)
    launches = [(k.grids[-1], k.launches[-1]) for k in kernels.values()]
    return out, reference64(layer, x, ids, w), launches, amaxes[-1]


# COUNTS' 200 slots on 8 experts: at BLOCK_M 32, 11 row tiles with real rows of 14 the host bounds; GEMM1 runs 4
# column tiles of each (I=128), GEMM2 8 (H=256). One SM off CUDA, so 1 or 2 programs run all of them.
CELLS = ["unquantized", "fp8_w8a8/tensor/tensor", "int8_w8a16/channel", "fp8_w8a8/block128/group128",
         "mxfp4_w4a16/group32"]
# (programs per SM, swapped, TMA weights, sorted intermediate)
VARIANTS = [(1, False, False, False), (2, True, False, False), (2, False, True, True), (3, True, True, False)]


@pytest.mark.parametrize("per_sm, swap, tma, sorted_inter", VARIANTS)
@pytest.mark.parametrize("cell", CELLS)
def test_persistent_gemms_give_the_one_program_per_tile_layer(cell, per_sm, swap, tma, sorted_inter, poison_empty,
                                                              monkeypatch):
    """Against the float64 reference within the cell's tolerance and, in the interpreter, bit-equal to the same tiles
    one program per tile, partial amaxes (FP8 per tensor) included in their maximum; each GEMM launched
    min(tiles, PERSISTENT * SMs) programs."""
    sortable = cell in ("unquantized", "fp8_w8a8/tensor/tensor", "int8_w8a16/channel")
    mx = cell.startswith("mxfp4")
    cfg = MoEConfig(BLOCK_M=32, gemm1=_tile(SWAP_AB=swap, TMA=tma and not mx), gemm2=_tile(SWAP_AB=swap, TMA=tma),
                    SORTED_INTER=sorted_inter and sortable)
    out, ref, launches, amaxes = _run(monkeypatch, cell, _persistent(cfg, per_sm))
    whole, _, whole_launches, whole_amaxes = _run(monkeypatch, cell, cfg)
    for (grid, args), (whole_grid, _) in zip(launches, whole_launches):
        assert args["PERSISTENT"] and grid == (min(whole_grid[0], per_sm * sm_count(torch.device(DEVICE))),)
    assert rel_err(out, ref) < triton_tol(cell)
    if cell == "fp8_w8a8/tensor/tensor":
        assert amaxes.numel() == launches[0][0][0] and amaxes.max() == whole_amaxes.max() > 0
    if INTERPRETED:
        assert torch.equal(out, whole)


def test_persistent_half_mma_tiles_give_the_one_program_per_tile_layer(poison_empty, monkeypatch):
    """Block-scaled tiles as two promoted halves (GemmConfig.HALF_MMA; gate and up halves need silu's halves layout)."""
    cell = "fp8_w8a8/block128/group128"
    cfg = MoEConfig(BLOCK_M=32, gemm1=_tile(HALF_MMA=True), gemm2=_tile(BLOCK_N=64, HALF_MMA=True))
    out, ref, launches, _ = _run(monkeypatch, cell, _persistent(cfg, 2), activation=Activation.silu)
    whole = _run(monkeypatch, cell, cfg, activation=Activation.silu)[0]
    assert all(args["HALF_MMA"] and args["PERSISTENT"] for _, args in launches)
    assert rel_err(out, ref) < triton_tol(cell)
    if INTERPRETED:
        assert torch.equal(out, whole)


def test_persistent_gemms_take_the_lora_delta(poison_empty, monkeypatch):
    cfg = MoEConfig(BLOCK_M=32, gemm1=_tile(), gemm2=_tile())
    out, ref, launches, _ = _run(monkeypatch, "unquantized", _persistent(cfg, 1), lora_rank=4)
    assert all(args["HAS_LORA"] and args["PERSISTENT"] for _, args in launches)
    assert rel_err(out, ref) < triton_tol("unquantized")
    if INTERPRETED:
        assert torch.equal(out, _run(monkeypatch, "unquantized", cfg, lora_rank=4)[0])


def test_a_program_past_the_real_tiles_stores_a_zero_amax(monkeypatch):
    """More programs than real tiles (the grid is bounded by the host's count of possible tiles): the idle programs'
    partial amaxes are 0, not the poisoned buffer's NaN."""
    monkeypatch.setattr(launch, "sm_count", lambda device: 64)
    cfg = _persistent(MoEConfig(BLOCK_M=32, gemm1=_tile(), gemm2=_tile()), 1)
    _, _, launches, amaxes = _run(monkeypatch, "fp8_w8a8/tensor/tensor", cfg)
    assert launches[0][0] == (14 * 4,) and amaxes.numel() == 14 * 4  # 14 possible row tiles x 4 column tiles
    assert torch.isfinite(amaxes).all() and (amaxes[11 * 4:] == 0).all() and (amaxes[:11 * 4] > 0).all()


BASE = MoEConfig(BLOCK_M=64, gemm1=_tile(), gemm2=_tile())


@pytest.mark.parametrize("cfg, message", [
    (_persistent(BASE, 5), r"^gemm1: PERSISTENT=5 must be the programs per SM, from 1 to 4, or 0 for one program per "
                           r"tile$"),
    (_persistent(dataclasses.replace(BASE, TAIL_M=16), 1),
     r"^gemm1: PERSISTENT runs whole BLOCK_M tiles of the sorted assignment, one tile shape, so not with GEMV rows "
     r"\(BLOCK_M 1\), CHAIN, TAIL_M or GEMM2_BLOCK_M; remove PERSISTENT or those fields$"),
    (_persistent(dataclasses.replace(BASE, BLOCK_M=1), 1), r"^gemm1: PERSISTENT runs whole BLOCK_M tiles"),
    (_persistent(dataclasses.replace(BASE, CHAIN=True), 1), r"^gemm1: PERSISTENT runs whole BLOCK_M tiles"),
    (dataclasses.replace(BASE, GEMM2_BLOCK_M=32, gemm2=_tile(PERSISTENT=1)), r"^gemm2: PERSISTENT runs whole BLOCK_M"),
])
def test_configs_a_persistent_gemm_cannot_run_are_refused(cfg, message):
    with pytest.raises(ValueError, match=message):
        check_config(cfg, UNQUANTIZED)


def test_gemm1_alone_may_be_persistent_under_gemm2_row_tiles():
    check_config(dataclasses.replace(BASE, GEMM2_BLOCK_M=32, gemm1=_tile(PERSISTENT=1)), UNQUANTIZED)


def test_a_naive_batch_is_refused_by_the_launch():
    """A config handed in (the tuner's path) on a decode batch, which the lookup never pairs with such an entry."""
    with pytest.raises(KernelInputError, match=r"^gemm2: PERSISTENT runs the blocks of the sorted assignment, and this "
                                               r"batch takes the naive one \(one slot per block, 4 \* slots <= "
                                               r"experts\): give it a config without PERSISTENT$"):
        gemm2_on_a_naive_batch(MoEConfig(BLOCK_M=32, gemm1=_tile(), gemm2=_tile(PERSISTENT=1)))


def test_persistent_entries_serve_only_batches_of_the_sorted_assignment():
    table = {1: MoEConfig(BLOCK_M=32, gemm1=_tile(PERSISTENT=1), gemm2=_tile()),
             64: MoEConfig(BLOCK_M=16, gemm1=_tile(), gemm2=_tile())}
    assert list(config_module._entries_for(table, rows_per_expert=0.1, gemv_rows=1, naive=True)) == [64]
    assert list(config_module._entries_for(table, rows_per_expert=0.1, gemv_rows=1, naive=False)) == [1, 64]


def test_persistent_round_trips_through_a_data_file_entry():
    cfg = MoEConfig(BLOCK_M=64, gemm1=_tile(), gemm2=_tile(PERSISTENT=2))
    assert cfg.to_dict()["gemm2"]["PERSISTENT"] == 2 and "PERSISTENT" not in cfg.to_dict()["gemm1"]
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg and cfg.persistent and not BASE.persistent


@triton.jit
def _registers_amax_kernel(x_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))[None, :]
    tl.store(out_ptr, fused_moe._registers_amax(x, x == x, out_ptr.dtype.element_ty, False))


# fp32 values either side of where rounding to fp16 (65504, then Inf from 65520) and to bf16 (0x1.fep+127, then Inf
# from 0x1.ffp+127) leaves the finite values, with NaN and Inf.
EDGES = {torch.float16: [65519.0, -65520.0, 70000.0, 1000.0],
         torch.bfloat16: [float.fromhex("0x1.fefffep+127"), -float.fromhex("0x1.ffp+127"), 3.4e38, 1e38]}


@needs_interpreter("a jit kernel on CPU tensors")
@pytest.mark.parametrize("dtype", list(EDGES))
@pytest.mark.parametrize("drop", [0, 1])
def test_the_amax_in_registers_is_the_finite_amax_of_the_stored_values(dtype, drop):
    """What the read-back takes (quantize.finite_amax of the stored tile): each value rounded to the stored dtype,
    those that become Inf or are NaN left out. Dropping the largest finite one shows the next."""
    values = EDGES[dtype][drop:] + [float("nan"), float("inf"), -5.0, 0.0, 0.0, 0.0]
    x = torch.tensor(values + [0.0] * (16 - len(values)), dtype=torch.float32)
    out = torch.empty(1, dtype=dtype)
    _registers_amax_kernel[(1,)](x, out, N=16)
    stored = x.to(dtype).float().abs()
    largest_kept = torch.tensor(EDGES[dtype][3 if drop else 0]).to(dtype).float().abs().item()
    assert out.float().item() == stored[torch.isfinite(stored)].max().item() == largest_kept
