"""bench/tk_mxfp4.py on the CPU: the parts of the triton_kernels side-by-side that do not need a GPU.

The package is refused by a typed error (never a traceback) when absent, foreign or of another API; arguments
are validated; our MXFP4 bytes reach triton_kernels' Hopper layouts unchanged (unswizzled and dequantised by
triton_kernels' own torch code, they equal our dequantisation exactly, padding included); the routing
structures built from our ids are the expert-sorted permutation they must be (their metadata kernels run in the
interpreter); the SwiGLU triton_kernels fuses is ours on the same interleaved rows; and each matmul_ogs call gets
the arguments of its GEMM. What needs the GPU (the Hopper matmul_ogs kernels, topk's launcher) is checked by the
script itself at every point before timing.

triton_kernels is taken from carry/triton_kernels (`bash bench/get_triton_kernels.sh`); the tests that need it
skip only when it is absent.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from kernel_helpers import bench_module, needs_interpreter

from moerules.activation import Activation, Dtype, SwigluParams
from moerules.kernels import make_random_weights
from moerules.kernels.activations import apply_activation, is_interleaved
from moerules.kernels.mx import dequantize_mx, quantize_mx
from moerules.kernels.routing import fused_topk
from moerules.quant import QuantConfig
from moerules.quant import QuantFamily as F

REPO = Path(__file__).resolve().parents[2]
INTERPRETER_ONLY = needs_interpreter("triton_kernels' routing-metadata kernels run on CPU tensors in the "
                                     "Triton interpreter only")


@pytest.fixture
def tkm(monkeypatch):
    return bench_module(monkeypatch, "tk_mxfp4")


@pytest.fixture
def tk(tkm):
    try:
        return tkm.load_triton_kernels(tkm.CARRIED)
    except tkm.TritonKernelsNotFound as exc:
        pytest.skip(f"no carried triton_kernels: {exc}")


@pytest.fixture
def hopper(tk):
    """The layouts vLLM's _swizzle_mxfp4 gets on sm_90 (triton_kernels' layout.py:22-39)."""
    return (tk.HopperMXValueLayout, {"mx_axis": 1}), (tk.HopperMXScaleLayout, {"mx_axis": 1, "num_warps": 8})


@pytest.fixture
def no_triton_kernels(monkeypatch):
    """No triton_kernels module loaded during the test; afterwards the modules and sys.path it found are back, so a
    fake package never leaks into the next test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    found = {name: sys.modules.pop(name) for name in _triton_kernels_modules()}
    yield
    for name in _triton_kernels_modules():
        del sys.modules[name]
    sys.modules.update(found)


def _triton_kernels_modules() -> list[str]:
    return [name for name in sys.modules if name == "triton_kernels" or name.startswith("triton_kernels.")]


def _fake_package(root: Path, *files: str) -> Path:
    (root / "triton_kernels").mkdir(parents=True)
    for name in ("__init__.py", *files):
        (root / "triton_kernels" / name).write_text("")
    return root


# ---- the package ----------------------------------------------------------------------------------------------------
def _missing(tkm, folder: Path) -> str:
    return (f"no triton_kernels package (triton_kernels/matmul_ogs.py) in {folder}: run "
            "`bash bench/get_triton_kernels.sh` (fills carry/triton_kernels) or pass --tk-dir")


def test_missing_package_is_a_typed_error_naming_the_folder_and_the_script(tkm, tmp_path):
    with pytest.raises(tkm.TritonKernelsNotFound) as exc:
        tkm.load_triton_kernels(tmp_path)
    assert str(exc.value) == _missing(tkm, tmp_path)


def test_main_without_the_package_exits_with_the_message(tkm, tmp_path):
    with pytest.raises(SystemExit) as exc:
        tkm.main(["--tk-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exc.value.code == "bench/tk_mxfp4.py: " + _missing(tkm, tmp_path)
    assert not (tmp_path / "out").exists()  # refused before any work


def test_main_without_an_sm90_gpu_exits_with_the_message(tkm, tk, tmp_path):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an sm_90 GPU is present")
    with pytest.raises(SystemExit) as exc:
        tkm.main(["--out", str(tmp_path)])
    assert exc.value.code == ("bench/tk_mxfp4.py: needs an sm_90 GPU (H100/H200): it models vLLM's Hopper path "
                              "of triton_kernels")


def test_the_package_is_found_from_its_folder_or_its_parent(tkm, tmp_path):
    root = _fake_package(tmp_path / "carry", "matmul_ogs.py")
    assert tkm.package_root(root) == root
    assert tkm.package_root(root / "triton_kernels") == root


def test_a_package_without_vllms_36_api_is_refused(tkm, tmp_path, no_triton_kernels):
    root = _fake_package(tmp_path, "matmul_ogs.py")
    with pytest.raises(tkm.TritonKernelsNotFound) as exc:
        tkm.load_triton_kernels(root)
    assert str(exc.value) == (f"{root / 'triton_kernels' / 'matmul_ogs.py'} has no matmul_ogs, PrecisionConfig, "
                              "FlexCtx, FusedActivation, FnSpecs, RoutingData, GatherIndx, ScatterIndx: not the "
                              "matmul_ogs + SparseMatrix API vLLM 0.33 calls 3.6; run "
                              "`bash bench/get_triton_kernels.sh`")


def test_a_triton_kernels_imported_from_elsewhere_is_refused(tkm, tmp_path, no_triton_kernels):
    root = _fake_package(tmp_path, "matmul_ogs.py")
    sys.modules["triton_kernels"] = types.SimpleNamespace(__file__="/site/triton_kernels/x.py")  # fixture removes it
    with pytest.raises(tkm.TritonKernelsNotFound) as exc:
        tkm.load_triton_kernels(root)
    assert str(exc.value) == ("triton_kernels is already imported from /site/triton_kernels, not from "
                              f"{root.resolve() / 'triton_kernels'}")


def test_the_carried_package_is_the_one_imported(tkm, tk):
    assert Path(sys.modules["triton_kernels"].__file__).parent == (tkm.CARRIED / "triton_kernels").resolve()
    assert tk.source.startswith(("wheel ", "folder "))


# ---- arguments ------------------------------------------------------------------------------------------------------
def test_defaults_are_the_two_gpt_oss_models_at_the_mx_token_counts(tkm):
    args = tkm.parse_args([])
    assert (args.models, args.ms, args.rounds, args.tk_dir, args.scheme) == (
        ["gpt-oss-120b", "gpt-oss-20b"], [1, 16, 64, 256, 1024, 2048, 4096], 3, tkm.CARRIED, "mxfp4")
    assert tkm.parse_args(["--scheme", "mxfp8"]).scheme == "mxfp8"
    oss20 = tkm.TK_MODELS["gpt-oss-20b"]
    assert (oss20.E, oss20.k, oss20.H, oss20.I, oss20.activation, oss20.bias) == \
        (32, 4, 2880, 2880, Activation.swigluoai, True)
    # bench/moe.py's default runs are unchanged; its --models gpt-oss-20b tunes the same shape.
    assert "gpt-oss-20b" not in tkm.MODELS and tkm.EXTRA_MODELS["gpt-oss-20b"] is oss20


@pytest.mark.parametrize("argv,message", [
    (["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    (["--ms", "16", "-4"], "argument --ms: must be >= 1, got -4"),
    (["--ms", "x"], "argument --ms: invalid positive_int value: 'x'"),
    (["--models", "gpt-oss-7b"], "argument --models: invalid choice: 'gpt-oss-7b'"),
    (["--scheme", "nvfp4"], "argument --scheme: invalid choice: 'nvfp4'"),
])
def test_bad_arguments_are_refused_by_name(tkm, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        tkm.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


# ---- weights --------------------------------------------------------------------------------------------------------
def _unswizzled_dequant(tk, values, scales, *, k: int, n: int) -> torch.Tensor:
    """triton_kernels' view of its own weights: [E, K, N] -> our [E, N, K], float64."""
    v = values.storage.layout.unswizzle_data(values.storage.data)
    s = scales.storage.layout.unswizzle_data(scales.storage.data)[:, :-(-k // 32), :n]
    return tk.upcast_from_mxfp_torch(v, s, torch.float32, axis=1).transpose(1, 2).double()


# (E, N, K): every axis padded by both swizzles; gpt-oss's w13 and w2 of one expert.
@pytest.mark.parametrize("E,N,K", [(2, 160, 192), (1, 5760, 2880), (1, 2880, 2880)])
def test_our_mxfp4_bytes_reach_the_hopper_layouts_unchanged(tkm, tk, hopper, E, N, K):
    packed, scale = quantize_mx(torch.randn(E, N, K, generator=torch.Generator().manual_seed(N)), fp4=True)
    values, scales = tkm.to_tk_mx(tk, packed, scale, layouts=hopper)
    groups = K // 32 + (-(K // 32) % 4)  # vLLM's sm_90 patch: scale groups padded to a multiple of 4
    assert (values.shape, values.dtype, scales.shape) == ([E, K, N], tk.FP4, [E, groups, N])
    assert (values.storage.layout.name, scales.storage.layout.name) == ("HOPPER_VALUE", "HOPPER_SCALE")
    assert values.stride(-2) == 1  # matmul_ogs asserts it for MX weights below sm_100
    assert torch.equal(_unswizzled_dequant(tk, values, scales, k=K, n=N), dequantize_mx(packed, scale))
    padded = scales.storage.layout.unswizzle_data(scales.storage.data)[:, K // 32:groups, :N]
    assert padded.numel() == E * N * (groups - K // 32) and not padded.any()  # zero groups over zero values


def test_layer_weights_convert_whole_and_in_row_order(tkm, tk, hopper):
    w = make_random_weights(num_experts=3, hidden=160, intermediate=96, quant=QuantConfig(family=F.mxfp4_w4a16),
                            in_dtype=Dtype.bf16, has_bias=True, seed=0, device="cpu")
    t = tkm.to_tk_weights(tk, w, layouts=hopper)
    assert (t.w13.shape, t.w2.shape) == ([3, 160, 192], [3, 96, 160])
    assert t.layouts() == {"value": "HOPPER_VALUE", "scale": "HOPPER_SCALE"}
    # Row n of our w13 is column n of theirs: gpt-oss's interleaved (gate, up) rows stay as they are.
    for theirs, scales, packed, scale, (K, N) in ((t.w13, t.w13_precision.weight_scale, w.w13, w.w13_scale, (160, 192)),
                                                  (t.w2, t.w2_precision.weight_scale, w.w2, w.w2_scale, (96, 160))):
        assert torch.equal(_unswizzled_dequant(tk, theirs, scales, k=K, n=N), dequantize_mx(packed, scale))
    assert t.w13_precision.flex_ctx == tk.FlexCtx(rhs_data=tk.InFlexData())
    assert t.w13_bias.dtype == t.w2_bias.dtype == torch.float32
    assert torch.equal(t.w13_bias, w.w13_bias.float()) and torch.equal(t.w2_bias, w.w2_bias.float())


def test_our_mxfp8_weights_reach_triton_kernels_unchanged(tkm, tk, hopper):
    """MXFP8: strided [E, K, N] views of our very bytes (K contiguous), which triton_kernels' own torch upcast reads
    as our dequantisation; the Hopper layouts are MXFP4's and are not used."""
    w = make_random_weights(num_experts=3, hidden=160, intermediate=96, quant=QuantConfig(family=F.mxfp8),
                            in_dtype=Dtype.bf16, has_bias=True, seed=0, device="cpu")
    t = tkm.to_tk_weights(tk, w, layouts=hopper)
    assert (t.w13.shape, t.w2.shape, t.w13.dtype) == ([3, 160, 192], [3, 96, 160], torch.float8_e4m3fn)
    for theirs, scales, values, scale in ((t.w13, t.w13_precision.weight_scale, w.w13, w.w13_scale),
                                          (t.w2, t.w2_precision.weight_scale, w.w2, w.w2_scale)):
        assert theirs.stride(-2) == 1 and theirs.storage.data.data_ptr() == values.data_ptr()
        assert scales.storage.data.data_ptr() == scale.data_ptr()
        upcast = tk.upcast_from_mxfp_torch(theirs.storage.data, scales.storage.data, torch.float32, axis=1)
        assert torch.equal(upcast.transpose(1, 2).double(), dequantize_mx(values, scale))


def test_layouts_are_triton_kernels_choice_on_sm90(tkm, tk, hopper, monkeypatch):
    layout = sys.modules["triton_kernels.tensor_details.layout"]
    monkeypatch.setattr(layout, "cuda_capability_geq", lambda major, minor=0: (major, minor) <= (9, 0))
    assert tkm.hopper_layouts(tk) == hopper


# ---- routing --------------------------------------------------------------------------------------------------------
def _routing_inputs(M: int, E: int, k: int):
    ids, w = fused_topk(torch.randn(M, E, generator=torch.Generator().manual_seed(M)), top_k=k, renormalize=True)
    return ids, w.to(torch.bfloat16)


def test_router_matrix_holds_each_weight_at_its_expert(tkm):
    ids = torch.tensor([[3, 0], [1, 7]])
    w = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    expected = torch.zeros(2, 8, dtype=torch.bfloat16)
    expected[0, 3], expected[0, 0], expected[1, 1], expected[1, 7] = 0.75, 0.25, 0.5, 0.5
    assert torch.equal(tkm.router_matrix(ids, w, 8), expected)


@pytest.mark.parametrize("ids,message", [
    ([[3, 3], [1, 7]], "a token names one expert twice in its top-k ids"),
    ([[3, 8], [1, 7]], "expert ids must lie in [0, 8), got [1, 8]"),
    ([[3, -1], [1, 7]], "expert ids must lie in [0, 8), got [-1, 7]"),
])
def test_router_matrix_refuses_ids_that_would_lose_a_weight(tkm, ids, message):
    with pytest.raises(ValueError) as exc:
        tkm.router_matrix(torch.tensor(ids), torch.ones(2, 2), 8)
    assert str(exc.value) == message


def test_router_matrix_refuses_mismatched_shapes(tkm):
    with pytest.raises(ValueError) as exc:
        tkm.router_matrix(torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 3), 8)
    assert str(exc.value) == "ids (2, 2) and weights (2, 3) must both be [M, k]"


@INTERPRETER_ONLY
@pytest.mark.parametrize("M,E,k", [(37, 32, 4), (1, 128, 4), (70, 128, 4)])
def test_routing_is_the_expert_sorted_permutation_of_our_slots(tkm, tk, M, E, k):
    ids, w = _routing_inputs(M, E, k)
    r = tkm.tk_routing(tk, tkm.router_matrix(ids, w, E), ids.to(torch.int32))
    order = torch.argsort(ids.flatten(), stable=True)  # slot (token * k + j) of each expert-ordered row
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert torch.equal(r.gather.src_indx.long(), order) and torch.equal(r.slot_of_row.long(), order)
    assert torch.equal(r.gather.dst_indx.long(), torch.argsort(order))
    assert torch.equal(r.scatter.src_indx, r.gather.dst_indx) and torch.equal(r.scatter.dst_indx, r.gather.src_indx)
    assert torch.equal(r.data.gate_scal, w.flatten()[order])
    assert (r.data.n_expts_tot, r.data.n_expts_act) == (E, k)
    assert torch.equal(r.data.expt_hist.long(), counts)
    assert torch.equal(r.data.expt_data.slice_offs.long(), torch.cat([torch.zeros(1, dtype=torch.long),
                                                                       counts.cumsum(0)]))


# ---- their calls ----------------------------------------------------------------------------------------------------
def test_the_fused_swiglu_is_ours_on_the_same_interleaved_rows(tkm, tk):
    assert is_interleaved(Activation.swigluoai)  # our w13 rows (2n, 2n+1) = (gate n, up n), as triton_kernels'
    h = 6 * torch.randn(7, 2 * 96, generator=torch.Generator().manual_seed(0))
    for p in (SwigluParams(), SwigluParams(limit=5.0, alpha=1.5)):
        theirs = tk.swiglu_torch(h, p.alpha, types.SimpleNamespace(limit=p.limit))
        assert torch.equal(theirs, apply_activation(h, Activation.swigluoai, p))
        act = tkm.swiglu_activation(tk, p)
        assert (act.specs.name, act.specs.fn, act.specs.fn_arg_names, act.specs.reduction_n) == \
            ("swiglu", tk.swiglu_fn, ("alpha", "limit"), 2)
        assert act.fn_args == (p.alpha, p.limit)  # in fn_arg_names' order


class _Recorder:
    """matmul_ogs that records its arguments and writes, in each output row, the slot GEMM1's row came from."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, w, bias, routing_data, **kwargs):
        self.calls.append((x, w, bias, routing_data, kwargs))
        y, gather = kwargs["y"], kwargs.get("gather_indx")
        y.copy_(gather.src_indx[:, None].to(y.dtype).expand_as(y) if gather is not None else torch.ones_like(y))


@INTERPRETER_ONLY
def test_each_gemm_gets_its_arguments_and_gemm1_rows_return_to_our_slots(tkm, tk):
    M, E, k, H, I = 9, 32, 4, 64, 48
    ids, w = _routing_inputs(M, E, k)
    record = _Recorder()
    weights = tkm.TkWeights(w13=types.SimpleNamespace(shape=[E, H, 2 * I]), w2=types.SimpleNamespace(shape=[E, I, H]),
                            w13_precision="p13", w2_precision="p2", w13_bias="b13", w2_bias="b2")
    ids_dtypes = []

    def topk(*args, y_indx, **kwargs):
        ids_dtypes.append(y_indx.dtype)
        return tk.topk_torch(*args, y_indx=y_indx, **kwargs)
    moe = tkm.TkMoE(types.SimpleNamespace(**(vars(tk) | {"matmul_ogs": record, "topk_torch": topk})), weights,
                    SwigluParams())
    x = torch.randn(M, H).to(torch.bfloat16)
    side = tkm.theirs(moe.tk, moe, x, ids, w.float())
    (x1, w1, b1, data1, kw1), (x2, w2, b2, data2, kw2) = record.calls
    assert (x1 is x, w1 is weights.w13, b1, set(kw1)) == (True, True, "b13",
                                                         {"gather_indx", "precision_config", "fused_activation", "y"})
    assert (kw1["precision_config"], kw1["fused_activation"], tuple(kw1["y"].shape)) == ("p13", moe.activation,
                                                                                         (M * k, I))
    assert (x2 is kw1["y"], w2 is weights.w2, b2, set(kw2)) == (True, True, "b2",
                                                               {"scatter_indx", "precision_config", "gammas", "y"})
    assert kw2["precision_config"] == "p2" and kw2["gammas"] is data2.gate_scal and tuple(kw2["y"].shape) == (M, H)
    assert data1.n_expts_act == data2.n_expts_act == k  # the fused path keeps k: matmul_ogs sums the k rows
    # topk packs `1 << (id % 32)` in the ids' dtype (_topk_forward.py:140-145): int16 would drop ids % 32 >= 16.
    assert set(ids_dtypes) == {torch.int32}
    slots = torch.arange(M * k, dtype=torch.bfloat16)[:, None].expand(M * k, I)
    assert torch.equal(side.gemm1_out, slots)  # row r of theirs compared with our slot gather.src_indx[r]


@pytest.mark.parametrize("agree", [True, False])
def test_profile_window_holds_one_call_of_each_sides_gemms_and_nothing_else(tkm, monkeypatch, agree):
    """--profile: `ncu --profile-from-start off` counts what runs between cudaProfilerStart and Stop, so the
    window holds each side's two GEMMs once, after a warm-up call (compilation) outside it; sides that disagree
    are still profiled and make the run fail."""
    events = []

    class Side:
        def __init__(self, who):
            self.who = who

        def gemms(self):
            events.append(self.who)

    side_by_side = object.__new__(tkm.TkSideBySide)
    side_by_side.ms = [256]
    side_by_side.bench = types.SimpleNamespace(log=lambda line: events.append(line.split()[0]))
    monkeypatch.setattr(side_by_side, "models", lambda: iter([("gpt-oss-120b", "layer", "moe")]))
    monkeypatch.setattr(side_by_side, "sides", lambda name, layer, moe, M: (Side("tk"), Side("ours")))
    monkeypatch.setattr(side_by_side, "check", lambda name, M, tk, ours: {"ok": agree, "rel_err": 0.0,
                                                                          "gemm1_rel_err": 0.0})
    cudart = types.SimpleNamespace(cudaProfilerStart=lambda: events.append("start"),
                                   cudaProfilerStop=lambda: events.append("stop"))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    assert side_by_side.profile() is agree
    assert events == ["tk", "ours", "sync", "start", "tk", "ours", "sync", "stop", "ok" if agree else "FAIL"]
