"""The batched activation format: `local_batched`, `torch.batched_reference` and `triton.batched_moe`.

Yardstick: `standard_reference64`, the float64 torch reference of the same weights and routing
through the *standard* local prepare/finalize, so no batched code is on the reference side.
The batched path quantises the input on [T, H] before batching (the same q and scales as the
standard path) and re-quantises the intermediate over the valid rows, so the tolerances are those
of the standard Triton tests (test_fused_moe.py):
  unquantised / W8A16: 2e-3 with fp16 output (interpreter), 8e-3 with bf16 output (GPU)
  W8A8:                1e-2 (a 1-ulp difference in the intermediate can flip one fp8 rounding)
  batched reference in float64 vs the standard one: 1e-12 (the same arithmetic, row by row)
Padding rows (past expert_num_tokens) of the prepared input, its scales and every buffer the
Triton experts allocate are poisoned, with NaN (must not leak) or with large finite values (must
not inflate a per-tensor scale). Under the interpreter the Triton tests run in fp16 (conftest.py).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from kernel_helpers import DEVICE, TRITON_DTYPE, RecordingKernel, random_inputs, rel_err

from moerules.activation import Activation, Dtype, SwigluParams
from moerules.kernels import KernelBuildError, build_layer, make_random_weights
from moerules.kernels.batched import LocalBatchedPrepareFinalize, batched_reference, from_batched, plan_batches
from moerules.kernels.interfaces import BatchedExperts
from moerules.kernels.prepare_finalize import LocalPrepareFinalize
from moerules.kernels.reference import moe_reference
from moerules.kernels.registry import EXPERTS
from moerules.kernels.scheme import scheme_cells
from moerules.kernels.scheme import quant_for_cell as quant_of
from moerules.kernels.triton.config import batched_config, check_batched_config
from moerules.quant import Granularity, QuantConfig, QuantFamily

BATCHED_TRITON_CELLS = sorted(EXPERTS["triton.batched_moe"].cells)
PER_TENSOR_DYNAMIC = ["fp8_w8a8/tensor/tensor", "fp8_w8a8/channel/tensor"]


def tol(cell: str, dtype: Dtype) -> float:
    if "w8a8" in cell:
        return 1e-2
    return 2e-3 if dtype == Dtype.fp16 else 8e-3


def batched_layer(kernel_id="triton.batched_moe", cell="unquantized", *, activation=Activation.silu,
                  dtype=TRITON_DTYPE, E=8, H=160, I=96, bias=False, device=DEVICE, **kw):
    w = make_random_weights(num_experts=E, hidden=H, intermediate=I, quant=quant_of(cell), in_dtype=dtype,
                            has_bias=bias, seed=0, device=device)
    return build_layer(kernel_id=kernel_id, prepare_finalize_id="local_batched", quant=quant_of(cell),
                       activation=activation, in_dtype=dtype, activation_format="batched", weights=w, device=device,
                       **kw)


def standard_reference64(layer, x, ids, w) -> torch.Tensor:
    """float64 reference through the standard `local` prepare/finalize, independent of the layer's batching."""
    pf = LocalPrepareFinalize(scheme=layer.weights.scheme, hidden_pad=layer.prepare_finalize.hidden_pad)
    p = pf.prepare(x, topk_ids=ids, topk_weights=w, defer_input_quant=False, a13_scale=layer.weights.a13_scale)
    out = moe_reference(p.hidden_q, weights=layer.weights, topk_ids=ids, topk_weights=w, a_scale=p.a_scale,
                        activation=layer.experts.activation, compute_dtype=torch.float64, swiglu=layer.experts.swiglu)
    return out[:, :layer.hidden_size]


def padding_mask(prepared) -> torch.Tensor:
    M = prepared.hidden_q.shape[1]
    return torch.arange(M, device=prepared.hidden_q.device)[None, :] >= prepared.expert_num_tokens.long()[:, None]


def _fill(t: torch.Tensor, mask: torch.Tensor, value: float) -> None:
    if t.element_size() == 1:  # fp8: no index_put, write the bytes of the (saturated) value
        t.view(torch.uint8)[mask] = torch.tensor(value).clamp(-448, 448).to(t.dtype).view(torch.uint8).item()
    else:
        t[mask] = value


POISON = {"nan": float("nan"), "big": 3.0e4}


@pytest.fixture
def poison(request, monkeypatch):
    """Poison the padding of every prepared batch (input rows and scales) and every torch.empty of the
    Triton batched launcher, with POISON[request.param] (NaN by default)."""
    from moerules.kernels.triton import batched as launcher
    value = POISON[getattr(request, "param", "nan")]
    real_dispatch = LocalBatchedPrepareFinalize.dispatch

    def dispatch(self, prepared):
        p = real_dispatch(self, prepared)
        pad = padding_mask(p)
        _fill(p.hidden_q, pad, value)
        if p.a_scale is not None and p.a_scale.dim() >= 2:
            _fill(p.a_scale, pad, value)
        return p
    monkeypatch.setattr(LocalBatchedPrepareFinalize, "dispatch", dispatch)

    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            _fill(t, torch.ones(t.shape, dtype=torch.bool, device=t.device), value)
        return t

    class _Torch:
        def __getattr__(self, name):
            return poisoned_empty if name == "empty" else getattr(torch, name)
    monkeypatch.setattr(launcher, "torch", _Torch())
    return value


# ---- triton.batched_moe against the standard float64 reference ---------------------------------------------

# NaN padding everywhere; large finite padding where a per-tensor dynamic scale could see it.
@pytest.mark.parametrize("cell,poison", [(c, "nan") for c in BATCHED_TRITON_CELLS] +
                         [(c, "big") for c in PER_TENSOR_DYNAMIC], indirect=["poison"])
def test_batched_triton_every_cell(cell, poison):
    layer = batched_layer(cell=cell, activation=Activation.swigluoai, bias=True)
    x, ids, w = random_inputs(layer, 13, 2, device=DEVICE)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, standard_reference64(layer, x, ids, w)) < tol(cell, TRITON_DTYPE)


@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a8/tensor/tensor", "fp8_w8a8/block128/group128",
                                  "fp8_w8a16/channel"])
def test_batched_triton_swapped_tiles(cell, poison, monkeypatch):
    """SWAP_AB tiles compute the same batched layer (the group amax of GEMM1 is folded after the transpose)."""
    from moerules.kernels.triton import batched

    def swapped(**kwargs):
        cfg = batched_config(**kwargs)
        return dataclasses.replace(cfg, gemm1=dataclasses.replace(cfg.gemm1, SWAP_AB=True),
                                   gemm2=dataclasses.replace(cfg.gemm2, SWAP_AB=True))

    monkeypatch.setattr(batched, "batched_config", swapped)
    layer = batched_layer(cell=cell, activation=Activation.swigluoai, bias=True)
    x, ids, w = random_inputs(layer, 13, 2, device=DEVICE)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert rel_err(out, standard_reference64(layer, x, ids, w)) < tol(cell, TRITON_DTYPE)


@pytest.mark.parametrize("activation, I, expected", [
    (Activation.silu, 256, (1, 1)),         # gate rows and up rows (256 further) each in one 128-row block
    (Activation.silu, 160, (0, 1)),         # 160 % 64: a tile's up rows span two blocks
    (Activation.swigluoai, 160, (1, 1)),    # interleaved pairs: 128 consecutive rows
])
def test_batched_block_scales_per_accumulator(activation, I, expected, poison, monkeypatch):
    """batched._accumulator_blocks: each accumulator reads one weight scale per K step where its rows lie in one
    block (64-wide tiles here), else one per row; the layer is the reference's either way."""
    from moerules.kernels.triton import batched

    def tiles_of_64(**kwargs):
        cfg = batched_config(**kwargs)
        return dataclasses.replace(cfg, gemm1=dataclasses.replace(cfg.gemm1, BLOCK_N=64),
                                   gemm2=dataclasses.replace(cfg.gemm2, BLOCK_N=64))

    monkeypatch.setattr(batched, "batched_config", tiles_of_64)
    g1, g2 = RecordingKernel(batched.batched_gemm1_kernel), RecordingKernel(batched.batched_gemm2_kernel)
    monkeypatch.setattr(batched, "batched_gemm1_kernel", g1)
    monkeypatch.setattr(batched, "batched_gemm2_kernel", g2)
    layer = batched_layer(cell="fp8_w8a8/block128/group128", activation=activation, H=256, I=I)
    x, ids, w = random_inputs(layer, 11, 3, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), standard_reference64(layer, x, ids, w)) < 1e-2
    assert (g1.launches[0]["W_BLOCKS"], g2.launches[0]["W_BLOCKS"]) == expected


@pytest.mark.parametrize("activation", [Activation.silu, Activation.gelu, Activation.gelu_tanh,
                                        Activation.swigluoai_uninterleave])
def test_batched_triton_activations(activation, poison):
    layer = batched_layer(cell="fp8_w8a8/block128/group128", activation=activation, H=256, I=160)
    x, ids, w = random_inputs(layer, 11, 3, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), standard_reference64(layer, x, ids, w)) < 1e-2


@pytest.mark.parametrize("M,top_k,E", [
    (1, 2, 8),     # M=1: 6 of 8 experts get no row
    (1, 1, 8),     # top_k=1, one row in the whole batch
    (5, 1, 64),    # most experts empty, top_k=1
    (70, 2, 4),    # several BLOCK_M blocks per expert
])
@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a8/channel/token"])
def test_batched_triton_edge_shapes(M, top_k, E, cell, poison):
    layer = batched_layer(cell=cell, E=E, H=144, I=80)
    x, ids, w = random_inputs(layer, M, top_k, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), standard_reference64(layer, x, ids, w)) < \
        tol(cell, TRITON_DTYPE)


def test_batched_triton_repeated_expert_in_topk(poison):
    """Explicit topk_ids may list an expert twice for a token: one row, read back by both slots."""
    layer = batched_layer(cell="fp8_w8a8/tensor/tensor", E=4)
    x, _, _ = random_inputs(layer, 6, 2, device=DEVICE)
    ids = torch.tensor([[1, 1], [0, 1], [3, 3], [2, 0], [1, 1], [3, 2]], dtype=torch.int32, device=DEVICE)
    w = torch.rand(6, 2, device=DEVICE)
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), standard_reference64(layer, x, ids, w)) < 1e-2


def test_batched_triton_zero_tokens():
    layer = batched_layer()
    x, ids, w = random_inputs(layer, 0, 2, device=DEVICE)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert out.shape == (0, layer.hidden_size) and out.dtype == x.dtype


def test_batched_triton_with_padding(poison):
    layer = batched_layer(cell="fp8_w8a8/channel/token", hidden_pad=16, intermediate_pad=32)
    x, ids, w = random_inputs(layer, 9, 2, device=DEVICE)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert out.shape == x.shape
    assert rel_err(out, standard_reference64(layer, x, ids, w)) < 1e-2


@pytest.mark.parametrize("kernel_id", ["triton.batched_moe", "torch.batched_reference"])
@pytest.mark.parametrize("cell", ["fp8_w8a8/tensor/tensor", "fp8_w8a8/block128/group128"])
def test_deferred_input_quant_is_done_once_by_the_experts(kernel_id, cell, monkeypatch):
    """A deferring dispatcher ships in_dtype rows; the experts quantise them over the valid rows only
    (padding poisoned with large values), exactly as the dispatcher would have: same output."""
    from moerules.kernels import interfaces, prepare_finalize
    calls = []
    for mod, name in ((interfaces, "quantize_activation_batched"), (prepare_finalize, "quantize_activation")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda x, _real=real, _n=name, **kw: calls.append(_n) or _real(x, **kw))
    dtype = TRITON_DTYPE if kernel_id.startswith("triton") else Dtype.bf16
    outs = {}
    for defer in (False, True):
        layer = batched_layer(kernel_id, cell, dtype=dtype, defer_input_quant=defer)
        assert layer.experts.expects_unquantized_inputs is defer
        real_dispatch = layer.prepare_finalize.dispatch

        def dispatch(prepared, _real=real_dispatch):
            p = _real(prepared)
            _fill(p.hidden_q, padding_mask(p), 3.0e4 if defer else 448.0)
            return p
        layer.prepare_finalize.dispatch = dispatch
        x, ids, w = random_inputs(layer, 7, 2, device=DEVICE)
        calls.clear()
        outs[defer] = layer(x, topk_ids=ids, topk_weights=w)
        assert calls == (["quantize_activation_batched"] if defer else ["quantize_activation"])
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=0)


# ---- torch.batched_reference and local_batched -------------------------------------------------------------

@pytest.mark.parametrize("cell", list(scheme_cells()))
def test_batched_reference_is_the_standard_reference(cell):
    """Row for row the same float64 arithmetic as the standard reference, in every scheme cell."""
    layer = batched_layer("torch.batched_reference", cell, dtype=Dtype.bf16, activation=Activation.swigluoai,
                          bias=True, device="cpu")
    x, ids, w = random_inputs(layer, 9, 3)
    p = layer.prepare_finalize.prepare(x, topk_ids=ids, topk_weights=w, defer_input_quant=False,
                                       a13_scale=layer.weights.a13_scale)
    _fill(p.hidden_q, padding_mask(p), float("nan"))
    out = batched_reference(p.hidden_q, a_scale=p.a_scale, expert_num_tokens=p.expert_num_tokens,
                            weights=layer.weights, activation=Activation.swigluoai, compute_dtype=torch.float64)
    assert rel_err(from_batched(out, p.handle, w), standard_reference64(layer, x, ids, w)) < 1e-12
    # and the backend itself (fp32 math, bf16 out), through the layer
    assert rel_err(layer(x, topk_ids=ids, topk_weights=w), standard_reference64(layer, x, ids, w)) < 2e-2


@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a8/channel/token", "fp8_w8a8/block128/group128",
                                  "fp8_w8a8/tensor/tensor"])
def test_local_batched_round_trip_is_exact(cell):
    """standard -> batched -> standard, with no experts in between: rows, scales and the sum are exact."""
    scheme = scheme_cells()[cell]
    T, k, E, H = 11, 4, 6, 200
    x = torch.randn(T, H).to(torch.float16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.full((T, k), 0.25)  # dyadic: the weighted sum of k equal rows is exact
    std = LocalPrepareFinalize(scheme=scheme, hidden_pad=8).prepare(x, topk_ids=ids, topk_weights=w,
                                                                    defer_input_quant=False, a13_scale=None)
    pf = LocalBatchedPrepareFinalize(scheme=scheme, hidden_pad=8, num_local_experts=E)
    p = pf.prepare(x, topk_ids=ids, topk_weights=w, defer_input_quant=False, a13_scale=None)
    assert p.hidden_q.shape == (E, T, H + 8) and p.expert_num_tokens.dtype == torch.int32
    assert p.expert_num_tokens.tolist() == torch.bincount(ids.flatten().long(), minlength=E).tolist()
    for e in range(E):
        tokens = (ids == e).any(dim=1).nonzero().squeeze(1)  # its tokens, in token order
        n = int(p.expert_num_tokens[e])
        assert torch.equal(p.hidden_q[e, :n].view(torch.uint8), std.hidden_q[tokens].view(torch.uint8))
        if scheme.act_granularity in (Granularity.token, Granularity.group128):
            assert torch.equal(p.a_scale[e, :n], std.a_scale[tokens])
        elif scheme.act_granularity == Granularity.tensor:
            assert torch.equal(p.a_scale, std.a_scale)
    if cell == "unquantized":
        _fill(p.hidden_q, padding_mask(p), float("nan"))
        assert torch.equal(pf.finalize(p.hidden_q, prepared=p, hidden_size=H), x)


def test_plan_batches_shares_rows_of_repeated_pairs():
    ids = torch.tensor([[2, 2], [0, 2], [2, 0]])
    layout = plan_batches(ids, torch.arange(6) // 2, num_experts=3, num_source_rows=3, max_tokens=3)
    assert layout.expert_num_tokens.tolist() == [2, 0, 3]
    # expert 0 holds tokens 1, 2; expert 2 holds tokens 0, 1, 2 (rows 6, 7, 8); token 0's two slots share row 6
    assert layout.dest.tolist() == [6, 6, 0, 7, 8, 1]


# ---- build checks ------------------------------------------------------------------------------------------

def _build(kernel_id, prepare_finalize_id, activation_format, quant=QuantConfig()):
    return build_layer(kernel_id=kernel_id, prepare_finalize_id=prepare_finalize_id, quant=quant,
                       activation=Activation.silu, in_dtype=Dtype.fp16, activation_format=activation_format,
                       weights=make_random_weights(num_experts=4, hidden=64, intermediate=32, quant=QuantConfig(),
                                                   in_dtype=Dtype.fp16, has_bias=False, seed=0, device="cpu"),
                       device="cpu")


@pytest.mark.parametrize("kernel_id,pf_id,fmt,message", [
    ("triton.batched_moe", "local", "batched",
     "triton.batched_moe: prepare/finalize 'local' produces 'standard' activations, the experts take 'batched'"),
    ("triton.fused_moe", "local_batched", "standard",
     "triton.fused_moe: prepare/finalize 'local_batched' produces 'batched' activations, the experts take "
     "'standard'"),
    ("triton.batched_moe", "local_batched", "standard",
     "triton.batched_moe: activation format 'standard' requested, but these experts take 'batched'"),
    ("torch.batched_reference", "local", "batched",
     "torch.batched_reference: prepare/finalize 'local' produces 'standard' activations, the experts take "
     "'batched'"),
])
def test_format_mismatch_is_refused_at_build(kernel_id, pf_id, fmt, message):
    with pytest.raises(KernelBuildError) as info:
        _build(kernel_id, pf_id, fmt)
    assert str(info.value) == message


# What batched Triton implements (its registry cells; rules batched_triton.no_int8 / no_mx refuse the rest)
_BATCHED_CELLS = ("fp8_w8a16/block128, fp8_w8a16/channel, fp8_w8a16/tensor, fp8_w8a8/block128/group128, "
                  "fp8_w8a8/channel/tensor, fp8_w8a8/channel/tensor-static, fp8_w8a8/channel/token, "
                  "fp8_w8a8/tensor/tensor, fp8_w8a8/tensor/tensor-static, fp8_w8a8/tensor/token, unquantized")


@pytest.mark.parametrize("quant,cell", [
    (quant_of("int8_w8a8/channel/token"), "int8_w8a8/channel/token"),
    (quant_of("int8_w8a16/channel"), "int8_w8a16/channel"),
    (QuantConfig(family=QuantFamily.mxfp4_w4a16), "mxfp4_w4a16/group32"),
    (QuantConfig(family=QuantFamily.mxfp8), "mxfp8/group32/group32"),
])
def test_int8_and_mx_are_refused_at_build(quant, cell):
    """Refused by scheme, before the weights are looked at (MX weights cannot even be made here yet)."""
    with pytest.raises(KernelBuildError) as info:
        _build("triton.batched_moe", "local_batched", "batched", quant=quant)
    assert str(info.value) == f"triton.batched_moe: scheme {cell!r} is not supported; supported: {_BATCHED_CELLS}"


def test_batched_apply_is_keyword_only_and_needs_counts():
    params = list(inspect.signature(BatchedExperts.apply).parameters.values())
    assert [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD] == ["self", "hidden_q"]
    assert inspect.signature(BatchedExperts.apply).parameters["expert_num_tokens"].default is inspect.Parameter.empty
    layer = batched_layer("torch.batched_reference", dtype=Dtype.fp32, device="cpu")
    layer.prepare_finalize.dispatch = lambda p, _real=layer.prepare_finalize.dispatch: \
        dataclasses.replace(_real(p), expert_num_tokens=None)
    x, ids, w = random_inputs(layer, 3, 2)
    with pytest.raises(ValueError, match="returned no expert_num_tokens for the batched experts "
                                         "torch.batched_reference"):
        layer(x, topk_ids=ids, topk_weights=w)


def test_batched_config_heuristic():
    scheme = scheme_cells()["fp8_w8a8/block128/group128"]
    assert batched_config(num_tokens=4096, num_experts=8, top_k=2, max_tokens=4096, scheme=scheme).BLOCK_M == 128
    assert batched_config(num_tokens=4096, num_experts=8, top_k=2, max_tokens=20, scheme=scheme).BLOCK_M == 32
    assert batched_config(num_tokens=1, num_experts=256, top_k=8, max_tokens=1, scheme=scheme).BLOCK_M == 16
    cfg = batched_config(num_tokens=4096, num_experts=8, top_k=2, max_tokens=4096, scheme=scheme)
    with pytest.raises(ValueError, match="BLOCK_N=256 must divide 128"):
        check_batched_config(dataclasses.replace(cfg, gemm1=dataclasses.replace(cfg.gemm1, BLOCK_N=256)), scheme)
    with pytest.raises(ValueError, match="BLOCK_M=1: the batched kernels take BLOCK_M >= 16"):
        check_batched_config(dataclasses.replace(cfg, BLOCK_M=1), scheme)  # GEMV rows: the fused kernels only


# ---- GPU only: bf16 against the standard Triton experts, and the CUDA re-quantisation pass ----------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton needs a GPU (the interpreter's bf16 dot is off)")
@pytest.mark.parametrize("cell", ["unquantized", "fp8_w8a8/tensor/tensor", "fp8_w8a8/channel/token",
                                  "fp8_w8a8/block128/group128", "fp8_w8a16/channel"])
def test_gpu_bf16_batched_matches_fused_and_reference(cell):
    layer = batched_layer(cell=cell, dtype=Dtype.bf16, E=16, H=512, I=384, bias=True, device="cuda")
    fused = build_layer(kernel_id="triton.fused_moe", prepare_finalize_id="local", quant=quant_of(cell),
                        activation=Activation.silu, in_dtype=Dtype.bf16, activation_format="standard",
                        weights=layer.weights, device="cuda")
    x, ids, w = random_inputs(layer, 200, 4, device="cuda")
    ref = standard_reference64(layer, x, ids, w)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert rel_err(out, ref) < tol(cell, Dtype.bf16)
    assert rel_err(out, fused(x, topk_ids=ids, topk_weights=w).double()) < 2 * tol(cell, Dtype.bf16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton re-quantisation pass runs on CUDA only")
@pytest.mark.parametrize("code", [1, 2, 3])
def test_gpu_requantisation_pass_matches_torch(code):
    from moerules.kernels.triton.batched import _quantize_rows
    E, M, I = 5, 40, 300
    inter = torch.randn(E, M, I, device="cuda").to(torch.bfloat16)
    counts = torch.tensor([0, 1, 40, 17, 33], dtype=torch.int32, device="cuda")
    shape = {1: (1,), 2: (E, M), 3: (E, M, 3)}[code]
    scale = torch.rand(shape, device="cuda") / 100 + 1e-3
    q = _quantize_rows(inter, scale, counts, code, torch.float8_e4m3fn, 16)
    ref = _quantize_rows(inter.cpu(), scale.cpu(), counts.cpu(), code, torch.float8_e4m3fn, 16)
    for e, n in enumerate(counts.tolist()):
        # Triton's fp32 division may differ by one rounding step of the quotient: at most one fp8 step apart.
        diff = (q[e, :n].float().cpu() - ref[e, :n].float()).abs()
        assert (diff <= ref[e, :n].float().abs() / 8 + 1e-6).all()


@pytest.mark.parametrize("kernel_id", ["triton.batched_moe", "torch.batched_reference"])
def test_a_models_swiglu_limit_and_alpha_reach_the_batched_kernels(kernel_id, poison):
    layer = batched_layer(kernel_id, activation=Activation.swigluoai, bias=True,
                          swiglu=SwigluParams(limit=0.5, alpha=1.2))
    x, ids, w = random_inputs(layer, 13, 2, device=DEVICE)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert rel_err(out, standard_reference64(layer, x, ids, w)) < 2e-2
    layer.experts.swiglu = SwigluParams()
    assert rel_err(out, standard_reference64(layer, x, ids, w)) > 0.2
