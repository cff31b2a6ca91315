"""GEMM2 summing each token's top-k slots itself (GemmConfig.SUM_TOPK) and GEMM1 prefetching GEMM2's weights into L2
(GemmConfig.PREFETCH_W2): the decode-only fields of the tuned files, their checks and where each applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_helpers import DEVICE, TRITON_DTYPE, make_layer, random_inputs, reference64, rel_err, run_with_config
from test_fused_moe import CELLS, triton_tol

from moerules.activation import Activation
from moerules.kernels.scheme import Scheme
from moerules.kernels.scheme import quant_for_cell as quant_of
from moerules.kernels.triton import launch
from moerules.kernels.triton.config import GemmConfig, MoEConfig, check_config

# Tiles of the summed GEMM2: the standard MMA rows (one real row per slot), swapped, and GEMV rows.
SUMMED = {
    "mma": lambda cfg: dataclasses.replace(cfg, gemm2=dataclasses.replace(cfg.gemm2, SUM_TOPK=True)),
    "swapped": lambda cfg: dataclasses.replace(cfg, gemm2=dataclasses.replace(cfg.gemm2, SUM_TOPK=True,
                                                                              SWAP_AB=True)),
    "one_row": lambda cfg: dataclasses.replace(cfg, BLOCK_M=1, gemm2=dataclasses.replace(cfg.gemm2, SUM_TOPK=True)),
}


@pytest.fixture
def no_topk_sum_kernel(monkeypatch):
    """The separate top-k sum must not run: a summed config that silently fell back to it fails here."""
    def refuse(slots, k):
        raise AssertionError("the top-k sum kernel ran, so GEMM2 did not sum the slots")
    monkeypatch.setattr(launch, "topk_sum", refuse)


@pytest.mark.parametrize("tiles", SUMMED)
@pytest.mark.parametrize("cell", CELLS)
def test_summed_topk_every_cell(cell, tiles, poison_empty, no_topk_sum_kernel, monkeypatch):
    # M=3, top-k 4 of 64 experts: the naive assignment (4 * 3 * 4 <= 64); biases and swigluoai, as the cell tests.
    run_with_config(monkeypatch, SUMMED[tiles])
    layer = make_layer("triton.fused_moe", cell, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True, E=64,
                       device=DEVICE)
    x, ids, w = random_inputs(layer, 3, 4, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < triton_tol(cell)


@pytest.mark.parametrize("top_k", [3, 6])
def test_summed_topk_of_a_top_k_that_is_not_a_power_of_two(top_k, poison_empty, no_topk_sum_kernel, monkeypatch):
    run_with_config(monkeypatch, SUMMED["mma"])
    layer = make_layer("triton.fused_moe", "fp8_w8a8/channel/token", dtype=TRITON_DTYPE, E=64, H=144, I=80,
                       device=DEVICE)
    x, ids, w = random_inputs(layer, 2, top_k, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < 1e-2


def test_summed_topk_leaves_out_the_slots_of_other_ranks(no_topk_sum_kernel, monkeypatch):
    """-1 ids (experts on another rank under EP) add nothing: the sum of the routed slots alone."""
    run_with_config(monkeypatch, SUMMED["mma"])
    layer = make_layer("triton.fused_moe", "unquantized", dtype=TRITON_DTYPE, E=64, bias=True, device=DEVICE)
    x, ids, w = random_inputs(layer, 2, 4, device=DEVICE)
    remote = ids.clone()
    remote[:, 1::2] = -1
    local = w.clone()
    local[:, 1::2] = 0.0
    out = launch.fused_moe(x, a_scale=None, weights=layer.weights, topk_ids=remote, topk_weights=w,
                           activation=Activation.silu, quantize_intermediate=lambda t, amaxes: (t, None),
                           out_dtype=x.dtype, remote_slots=True)
    assert rel_err(out, reference64(layer, x, ids, local)) < triton_tol("unquantized")


def test_summed_topk_applies_under_the_naive_assignment_only(monkeypatch):
    """Past the naive assignment's size (4 * M * k > E) the sorted blocks mix tokens, so the separate sum runs."""
    run_with_config(monkeypatch, SUMMED["mma"])
    ran = []
    real = launch.topk_sum
    monkeypatch.setattr(launch, "topk_sum", lambda slots, k: ran.append(k) or real(slots, k))
    layer = make_layer("triton.fused_moe", "unquantized", dtype=TRITON_DTYPE, E=8, device=DEVICE)
    x, ids, w = random_inputs(layer, 5, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < triton_tol("unquantized")
    assert ran == [2]


def test_summed_topk_with_lora_keeps_the_separate_sum(monkeypatch):
    """GEMM2 adds the LoRA delta per slot, so with adapters the slots are summed by the top-k sum kernel."""
    run_with_config(monkeypatch, SUMMED["mma"])
    ran = []
    real = launch.topk_sum
    monkeypatch.setattr(launch, "topk_sum", lambda slots, k: ran.append(k) or real(slots, k))
    layer = make_layer("triton.fused_moe", "unquantized", dtype=TRITON_DTYPE, E=64, lora_rank=8, device=DEVICE)
    x, ids, w = random_inputs(layer, 2, 4, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < triton_tol("unquantized")
    assert ran == [4]


def test_gemm2_names_an_output_of_the_wrong_rows():
    layer = make_layer("triton.fused_moe", "unquantized", dtype=TRITON_DTYPE, E=64, device=DEVICE)
    x, ids, w = random_inputs(layer, 2, 4, device=DEVICE)
    align = launch.moe_align(ids, num_experts=64, block_m=16)
    g = GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    cfg = MoEConfig(BLOCK_M=16, gemm1=g, gemm2=dataclasses.replace(g, SUM_TOPK=True))
    inter = torch.zeros(8, layer.weights.intermediate, dtype=x.dtype, device=DEVICE)
    out = torch.empty(8, layer.hidden_size, dtype=x.dtype, device=DEVICE)
    with pytest.raises(ValueError, match=r"^gemm2: out has 8 rows; this config writes one per token \(2\)$"):
        launch.gemm2(inter, None, weights=layer.weights, topk_weights=w, align=align, cfg=cfg, out=out, top_k=4)


_G = GemmConfig(BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
_UNQUANTIZED = Scheme.from_quant(quant_of("unquantized"))


@pytest.mark.parametrize("gemm1, gemm2, message", [
    (dataclasses.replace(_G, PREFETCH_W2=3), _G,
     "gemm1: PREFETCH_W2=3 must be 0 (off), 1 (on entry) or 2 (after the K loop)"),
    (_G, dataclasses.replace(_G, PREFETCH_W2=1),
     "gemm2: PREFETCH_W2 is a GEMM1 field (GEMM1 prefetches GEMM2's weights); remove it here"),
    (dataclasses.replace(_G, SUM_TOPK=True), _G,
     "gemm1: SUM_TOPK is a GEMM2 field (GEMM2 sums the top-k slots); remove it here"),
])
def test_decode_fields_in_the_wrong_gemm_are_refused(gemm1, gemm2, message):
    with pytest.raises(ValueError) as exc:
        check_config(MoEConfig(BLOCK_M=16, gemm1=gemm1, gemm2=gemm2), _UNQUANTIZED)
    assert str(exc.value) == message


def test_data_files_hold_the_decode_fields_only_where_set():
    plain = MoEConfig(BLOCK_M=16, gemm1=_G, gemm2=_G)
    assert "PREFETCH_W2" not in plain.to_dict()["gemm1"] and "SUM_TOPK" not in plain.to_dict()["gemm2"]
    fused = MoEConfig(BLOCK_M=16, gemm1=dataclasses.replace(_G, PREFETCH_W2=2),
                      gemm2=dataclasses.replace(_G, SUM_TOPK=True))
    d = fused.to_dict()
    assert (d["gemm1"]["PREFETCH_W2"], d["gemm2"]["SUM_TOPK"]) == (2, True)
    assert MoEConfig.from_dict(d) == fused


class _SM90:
    """launch's view of an sm_90 device with `l2` bytes of L2."""

    def __init__(self, monkeypatch, l2: int):
        monkeypatch.setattr(launch, "pdl_kwargs", lambda device: dict(PDL=True, launch_pdl=True))
        monkeypatch.setattr(launch, "_l2_bytes", lambda index: l2)


def test_prefetch_applies_while_the_experts_fit_half_the_l2(monkeypatch):
    layer = make_layer("triton.fused_moe", "unquantized", dtype=TRITON_DTYPE, E=64, H=160, I=96)
    w2 = layer.weights.w2
    expert_bytes = 160 * 96 * w2.element_size()
    g = dataclasses.replace(_G, PREFETCH_W2=2, num_warps=8)
    _SM90(monkeypatch, l2=2 * 8 * expert_bytes)
    kw = launch._w2_prefetch(layer.weights, g, distinct_experts=8, device=torch.device("cuda", 0))
    assert (kw["w2_ptr"] is w2, kw["w2_expert_bytes"], kw["PREFETCH_W2"], kw["LANES"]) == (True, expert_bytes, 2, 256)
    assert launch._w2_prefetch(layer.weights, g, distinct_experts=9, device=torch.device("cuda", 0)) == {}
    assert launch._w2_prefetch(layer.weights, _G, distinct_experts=8, device=torch.device("cuda", 0)) == {}


def test_prefetch_is_not_issued_off_sm90():
    layer = make_layer("triton.fused_moe", "unquantized", dtype=TRITON_DTYPE, E=64)
    g = dataclasses.replace(_G, PREFETCH_W2=1)
    assert launch._w2_prefetch(layer.weights, g, distinct_experts=1, device=torch.device("cpu")) == {}


@pytest.mark.skipif(DEVICE != "cuda", reason="the L2 prefetch is PTX for sm_90")
@pytest.mark.parametrize("where", [1, 2])
@pytest.mark.parametrize("cell", CELLS)
def test_prefetch_leaves_every_cell_exact(cell, where, poison_empty, monkeypatch):
    run_with_config(monkeypatch, lambda cfg: dataclasses.replace(
        cfg, gemm1=dataclasses.replace(cfg.gemm1, PREFETCH_W2=where), gemm2=dataclasses.replace(cfg.gemm2,
                                                                                                 SUM_TOPK=True)))
    layer = make_layer("triton.fused_moe", cell, activation=Activation.swigluoai, dtype=TRITON_DTYPE, bias=True, E=64,
                       device=DEVICE)
    x, ids, w = random_inputs(layer, 3, 4, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), reference64(layer, x, ids, w)) < triton_tol(cell)
