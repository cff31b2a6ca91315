"""GEMM1's epilogue amax (launch.gemm1, AMAX): GEMM2's dynamic per-tensor scale without an amax pass over the
intermediate. The partial amaxes must give exactly the scale that pass gives, non-finite values left out."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_helpers import DEVICE, RecordingKernel, make_layer, random_inputs, reference64, rel_err

from moerules.kernels.qrange import scale_from_amax
from moerules.kernels.quantize import finite_amax
from moerules.kernels.triton.config import GemmConfig, MoEConfig
from moerules.kernels.triton.fused_moe import _stored_amax
from moerules.kernels.triton import launch
from moerules.kernels.triton.launch import fused_moe
from moerules.kernels.triton.quant import needs_amax_pass, scale_of_partials

FP8 = torch.float8_e4m3fn
TOL = 1e-2  # test_fused_moe.py's W8A8 bound (triton_tol)


def _forward(layer, M: int, k: int, *, poison_row: bool = False, config: MoEConfig | None = None):
    """fused_moe on the layer's weights (with `config`, else the tuned one), recording what quantize_intermediate
    received."""
    x, ids, w = random_inputs(layer, M, k, device=DEVICE)
    if poison_row:
        x[3] = float("inf")
    seen = {}
    quantize = layer.experts.quantize_intermediate(layer.weights)

    def recording(inter, amaxes):
        seen.update(inter=inter.clone(), amaxes=amaxes)
        return quantize(inter, amaxes)
    pf = layer.prepare_finalize
    p = pf.prepare(x, topk_ids=ids, topk_weights=w, defer_input_quant=False, a13_scale=layer.weights.a13_scale)
    out = fused_moe(p.hidden_q, a_scale=p.a_scale, weights=layer.weights, topk_ids=ids, topk_weights=w,
                    activation=layer.experts.activation, quantize_intermediate=recording,
                    out_dtype=x.dtype, config=config)
    return out, seen, (x, ids, w)


def _tile(swap: bool) -> MoEConfig:
    gemm = GemmConfig(BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2, SWAP_AB=swap)
    return MoEConfig(BLOCK_M=16, gemm1=gemm, gemm2=gemm)


@pytest.mark.parametrize("I, bias", [(128, False), (120, True)], ids=["unmasked", "masked"])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("poison_row", [False, True])
def test_gemm1_amaxes_give_exactly_the_scale_of_an_amax_pass(poison_row, swap, I, bias, poison_empty):
    """70 tokens x top-2 x I=128 = 17,920 intermediate elements, past one quantiser program: GEMM1 writes one
    finite amax per program (the early-returning ones 0, in NaN-poisoned memory), and their scale is the one
    quantize_activation's amax pass computes, bit for bit; with a token of Inf (its rows NaN/Inf) too. Both ways
    GEMM1 takes its amax: from the registers, and read back from memory (swapped tiles, fused_moe._stored_amax);
    and both ways the registers' amax runs: over the whole tile, and masked (a bias, I past the last tile)."""
    layer = make_layer("triton.fused_moe", "fp8_w8a8/tensor/tensor", E=4, H=160, I=I, bias=bias, device=DEVICE)
    out, seen, (x, ids, w) = _forward(layer, 70, 2, poison_row=poison_row, config=_tile(swap))
    inter, amaxes = seen["inter"], seen["amaxes"]
    assert needs_amax_pass(inter.numel()) and amaxes is not None
    assert torch.isfinite(amaxes).all() and (amaxes >= 0).all()
    assert amaxes.max() == finite_amax(inter.float())
    assert torch.equal(scale_of_partials(amaxes, FP8), scale_from_amax(finite_amax(inter.float()), FP8).reshape(1))
    if not poison_row:
        assert rel_err(out, reference64(layer, x, ids, w)) < TOL


@pytest.mark.parametrize("I, bias, masked", [(128, False, False), (120, False, True), (128, True, True)])
def test_the_amax_is_masked_where_values_outside_the_stored_tile_can_be_non_zero(I, bias, masked, monkeypatch):
    """launch._amax_mask: a bias lifts GEMM1's padding rows to act(bias_gate) * bias_up, and columns past I (120 is
    not a multiple of BLOCK_N 32) read weight row 0; otherwise both are zero or absent, and the per-value select of
    the mask goes."""
    recording = RecordingKernel(launch.gemm1_gated_kernel)
    monkeypatch.setattr(launch, "gemm1_gated_kernel", recording)
    layer = make_layer("triton.fused_moe", "fp8_w8a8/tensor/tensor", E=4, H=160, I=I, bias=bias, device=DEVICE)
    _forward(layer, 70, 2, config=_tile(False))
    assert [(k["AMAX"], k["AMAX_MASK"]) for k in recording.launches] == [(True, masked)]


@pytest.mark.parametrize("cell, M", [
    ("fp8_w8a8/tensor/tensor", 11),          # 2,112 elements: the quantiser's single program reads them once
    ("fp8_w8a8/tensor/tensor-static", 70),   # a static scale: no amax at all
    ("fp8_w8a8/channel/token", 70),          # per-token scales
    ("unquantized", 70),                     # no quantisation
])
def test_no_amaxes_where_no_amax_pass_would_run(cell, M, poison_empty):
    layer = make_layer("triton.fused_moe", cell, E=4, H=160, I=128, device=DEVICE)
    _, seen, _ = _forward(layer, M, 2)
    assert seen["amaxes"] is None


@triton.jit
def _store_and_take_amax(src_ptr, out_ptr, amax_ptr, rows, cols, SWAP_AB: tl.constexpr, AMAX_MASK: tl.constexpr,
                         R: tl.constexpr, C: tl.constexpr):
    """GEMM1's epilogue in small: cast an [R, C] fp32 tile to out's dtype, store its [rows, cols] corner,
    write that corner's amax as _stored_amax takes it."""
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    tile_ok = (r < rows)[:, None] & (c < cols)[None, :]
    tile = tl.load(src_ptr + r[:, None] * C + c[None, :])
    out_ptrs = out_ptr + r[:, None] * C + c[None, :]
    tl.store(out_ptrs, tile.to(out_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(amax_ptr, _stored_amax(tile, out_ptrs, tile_ok, SWAP_AB, AMAX_MASK))


INF, NAN = float("inf"), float("nan")
R, C, ROWS, COLS = 16, 32, 11, 27   # the tile, and the corner of it a program stores (rows, columns past N)


def _amax_in_kernel(tile: torch.Tensor, dtype: torch.dtype, swap: bool, *,
                    mask: bool = True) -> tuple[float, torch.Tensor]:
    """The amax the kernel wrote, and the corner it stored (as fp32: what an amax pass would read)."""
    out = torch.full((R, C), NAN, dtype=dtype, device=DEVICE)   # unstored memory must not be read
    amax = torch.full((1,), NAN, device=DEVICE)
    _store_and_take_amax[(1,)](tile.to(DEVICE), out, amax, ROWS, COLS, SWAP_AB=swap, AMAX_MASK=mask, R=R, C=C)
    return amax.item(), out[:ROWS, :COLS].float()


def _tile_with(*values) -> torch.Tensor:
    """Values below 1 everywhere, the given ones at spots of the stored corner, and a large value outside it
    (a row past the block's end and a column past N), which the amax must not see."""
    tile = torch.rand(R, C, generator=torch.Generator().manual_seed(0)) * 2 - 1
    for i, value in enumerate(values):
        tile[2 + i, 5 + 3 * i] = value
    tile[ROWS, 0] = tile[0, COLS] = 500.0
    return tile


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("values", [
    (),                                # the plain max of |x|
    (-7.5, 3.0),                       # a negative value sets it
    (INF, -2.0),                       # Inf left out, the next finite value counts
    (-INF, 4.0),
    (NAN, -6.0),
    (INF, -INF, NAN),                  # the finite values below 1 remain
], ids=["plain", "negative", "inf", "-inf", "nan", "all-kinds"])
def test_the_stored_amax_is_the_finite_amax_of_what_was_stored(values, dtype, swap):
    """Both ways _stored_amax takes it (from the registers; read back after a barrier for swapped tiles) give
    exactly quantize.finite_amax of the stored corner, as stored (in out's dtype: the interpreter rounds fp32 to
    bf16 otherwise than torch), nothing outside it."""
    amax, stored = _amax_in_kernel(_tile_with(*values), dtype, swap)
    assert amax == finite_amax(stored).item()
    finite = [abs(v) for v in values if abs(v) < INF]
    if finite:
        assert amax == max(finite)   # each exact in bf16
    else:
        assert 0.9 < amax <= 1.0     # the random values'


@pytest.mark.parametrize("swap", [False, True])
def test_a_corner_of_only_non_finite_values_has_amax_zero(swap):
    tile = torch.full((R, C), NAN)
    tile[::2] = INF
    tile[ROWS, 0] = 500.0
    assert _amax_in_kernel(tile, torch.float16, swap)[0] == 0.0


@pytest.mark.parametrize("swap", [False, True])
def test_unmasked_the_whole_tile_counts(swap):
    """AMAX_MASK False (launch._amax_mask: nothing outside the stored corner can be non-zero) reduces the whole
    register tile; the read-back way (swapped tiles, or a non-finite register amax) still reads the corner alone."""
    tile = _tile_with(-7.5)
    assert _amax_in_kernel(tile, torch.bfloat16, swap, mask=False)[0] == (7.5 if swap else 500.0)
    tile[ROWS:] = 0.0
    tile[:, COLS:] = 0.0
    assert _amax_in_kernel(tile, torch.bfloat16, swap, mask=False)[0] == 7.5


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the interpreter's numpy cast to fp16 warns of the Inf
@pytest.mark.parametrize("swap", [False, True])
def test_a_value_that_rounds_to_inf_when_stored_is_left_out(swap):
    """7e4 is finite in fp32 but Inf in fp16, so the intermediate GEMM2 quantises holds Inf there: the amax is
    the stored values', as an amax pass over the intermediate would take it (65504 is fp16's largest finite)."""
    tile = _tile_with(7e4, 65504.0)
    assert _amax_in_kernel(tile, torch.float16, swap)[0] == 65504.0
    assert _amax_in_kernel(tile, torch.float32, swap)[0] == 7e4
