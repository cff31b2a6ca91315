"""OpenAI's triton_kernels MXFP4 MoE (what vLLM 0.33 runs for gpt-oss on Hopper) side by side with ours.

    bash bench/get_triton_kernels.sh        # once: the unmodified package -> carry/triton_kernels/triton_kernels
    python bench/tk_mxfp4.py --out DIR [--tk-dir carry/triton_kernels] [--models ..] [--ms ..] [--rounds 3]
    ncu --profile-from-start off ... python bench/tk_mxfp4.py --profile ...   # bench/gpu_steps.sh profile_mx

GPU only (sm_90): triton_kernels' Hopper MXFP4 path (inline PTX upcasts, its topk launcher) does not run in the
Triton interpreter, so there is no --smoke; the CPU-testable parts are in tests/kernels/test_tk_mxfp4_harness.py.
triton_kernels is imported at run time from --tk-dir only (its folder goes first on sys.path).

Their side: our own calls to the triton_kernels API, as vLLM 0.33 makes them (file:line below, under
vllm/model_executor/layers/): the mxfp4 TRITON backend's OAITritonExperts (fused_moe/oracle/mxfp4.py:246-253).
  weights, once per model (quantization/utils/mxfp4_utils.py:65-171, fused_moe/oracle/mxfp4.py:1444-1464):
      our packed e2m1 [E, N, K/2] and e8m0 [E, N, K/32], transposed to [E, K, N] (K contiguous), in the layouts
      `make_default_matmul_mxfp4_w_layout` / `..._w_scale_layout(mx_axis=1, num_warps=8)` pick (Hopper's value
      and scale swizzles on sm_90), scale groups zero-padded to a multiple of 4 first (vLLM's sm_90 patch, its
      :136-139; the value swizzle pads K to a multiple of 64 bytes: 2880 -> 2944 values, 92 groups); biases
      fp32; opt-flags constraint split_k 1; PrecisionConfig(weight_scale, FlexCtx(rhs_data=InFlexData())).
      gpt-oss's w13 rows interleave gate and up (2n, 2n+1), as ours (`activations.is_interleaved`) and as
      vLLM loads the checkpoint (models/gpt_oss.py:1382): no reordering.
  routing (fused_moe/experts/gpt_oss_triton_kernels_moe.py:864-977, `make_routing_data` and
      `routing_data_from_sparse_topk`): ids and bf16 weights -> SparseMatrix (bitmatrix + its metadata)
      -> ragged metadata, gate_scal in expert order, GatherIndx / ScatterIndx. The bitmatrix is packed by
      triton_kernels' own `topk` given our ids (`y_indx`, one launch, as vLLM's monolithic path at :640 packs
      it), reading the weights from a [M, E] matrix built once from ours; vLLM's modular path packs it with
      its own kernel instead (:884-933).
  GEMMs (triton_kernel_fused_experts, :703-846): matmul_ogs GEMM1 gathering x with the fused swiglu
      (FnSpecs "swiglu", reduction_n 2, alpha 1.702, limit 7.0) -> [M*k, I] in expert order; matmul_ogs
      GEMM2 with gammas = gate_scal and the ScatterIndx -> [M, H] (matmul_ogs sums the k rows itself).
Ours: the layer bench/moe.py builds and times (`Bench.layer`, `triton.fused_moe` behind `local`), and its two
GEMM launches as bench/vllm_triton.py makes them (`SideBySide.our_gemms`).

--scheme mxfp8 (issue 11: "same for MXFP8"): e4m3 weights [E, N, K] and their e8m0 scales go to matmul_ogs as they
are, transposed to [E, K, N] (K contiguous, which matmul_ogs asserts for fp8 weights below sm_100), strided (the
Hopper swizzles are MXFP4's); it dequantises them in its K loop (`tl.dot_scaled`'s upcast on sm_90) against bf16
activations. Our MXFP8 scheme also quantises the activations (x and the intermediate, MX per 32): triton_kernels'
GEMM1 reads the MX values of our quantised x (so both GEMM1s compute the same products), and, for the check only,
its GEMM2 reads our quantised intermediate (re-quantising its own would flip e4m3 roundings; as
bench/vllm_triton.py does). Timed, its forward runs on bf16 x and its own bf16 intermediate (W8A16, what it
runs for MXFP8 weights) while ours pays for both activation quantisations: the forward ratio is conservative
for us.

Same inputs on both sides: x, the top-k ids and the router weights rounded once to bf16 (the dtype vLLM hands
triton_kernels, :885), the very same MXFP4 bytes. Correctness first, every point: the final [M, H] outputs and
the GEMM1 outputs (theirs re-ordered to our slot order) as relative Frobenius errors within `moe.tolerance`
(1e-2 for W4A16). A failing point prints FAIL, stays timed, is left out of the geomeans, and the run exits 1.
Timed (`moe.interleaved_us`: CUDA-graph replays of every part of both sides in turn, L2 flushed before each,
medians), `--rounds` times, fastest kept: `forward` (theirs: routing + GEMM1 + GEMM2; ours: the layer call), `gemms`
(both GEMMs, routing and sorting done outside) and each GEMM alone. Their GEMM2 includes the sum over k, ours
does not (ours is a separate torch sum in `forward`), so the `gemms` ratio slightly favours us; `forward` is
the like-for-like number. Ratio = theirs / ours (> 1: ours faster); % of floor = `Bench.floor_us` (scheme
mxfp4) / µs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import triton

from moe import (EXTRA_MODELS, MODELS, MX_M_LIST, TIMED_SCHEMES, Bench, fastest_interleaved, profiled_once, rel_err,
                 tolerance)
from moerules.activation import SwigluParams
from moerules.kernels.scheme import Scheme
from moerules.kernels.triton.quant import dequantize_mx
from vllm_triton import Alignments, geomeans_by, our_gemms

REPO = Path(__file__).resolve().parent.parent
CARRIED = REPO / "carry" / "triton_kernels"
GET_SCRIPT = "bash bench/get_triton_kernels.sh"
SCHEMES = ("mxfp4", "mxfp8")
TK_MODELS = {"gpt-oss-120b": MODELS["gpt-oss-120b"], "gpt-oss-20b": EXTRA_MODELS["gpt-oss-20b"]}
# What a GPU run needs from the package, module by module: the "3.6" API of vLLM's get_triton_kernels_version
# (utils/import_utils.py:571-585: matmul_ogs present, tensor.SparseMatrix present).
TK_API = {"matmul_ogs": ("matmul_ogs", "PrecisionConfig", "FlexCtx", "FusedActivation", "FnSpecs", "RoutingData",
                         "GatherIndx", "ScatterIndx"),
          "matmul_ogs_details.opt_flags": ("update_opt_flags_constraints",),
          "numerics": ("InFlexData",),
          "numerics_details.mxfp": ("upcast_from_mxfp_torch",),
          "swiglu": ("swiglu_fn", "swiglu_torch"),
          "tensor": ("FP4", "SparseMatrix", "convert_layout", "wrap_torch_tensor", "make_ragged_tensor_metadata"),
          "tensor_details.layout": ("make_default_matmul_mxfp4_w_layout", "make_default_matmul_mxfp4_w_scale_layout",
                                    "HopperMXValueLayout", "HopperMXScaleLayout"),
          "topk": ("topk", "topk_torch")}
# vLLM's sm_90 patch pads the e8m0 scale groups to this multiple (quantization/utils/mxfp4_utils.py:136-139).
HOPPER_SCALE_GROUPS_MULTIPLE = 4
HOPPER_SCALE_WARPS = 8  # _swizzle_mxfp4's num_warps default (mxfp4_utils.py:65)
PARTS = ("forward", "gemms", "gemm1", "gemm2")


class TritonKernelsNotFound(RuntimeError):
    pass


# ---- the package --------------------------------------------------------------------------------------------------
def package_root(tk_dir: Path) -> Path:
    """The folder to put on sys.path: tk_dir when it holds triton_kernels/, its parent when it is the package."""
    for root in (tk_dir, tk_dir.parent):
        if (root / "triton_kernels" / "matmul_ogs.py").is_file():
            return root
    raise TritonKernelsNotFound(f"no triton_kernels package (triton_kernels/matmul_ogs.py) in {tk_dir}: run "
                                f"`{GET_SCRIPT}` (fills {CARRIED.relative_to(REPO)}) or pass --tk-dir")


def load_triton_kernels(tk_dir: Path) -> types.SimpleNamespace:
    """The names of TK_API, imported from tk_dir's package and nowhere else."""
    root = package_root(tk_dir).resolve()
    loaded = sys.modules.get("triton_kernels")
    if loaded is not None and Path(loaded.__file__).resolve().parent != root / "triton_kernels":
        raise TritonKernelsNotFound(f"triton_kernels is already imported from {Path(loaded.__file__).parent}, "
                                    f"not from {root / 'triton_kernels'}")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    names = {}
    for module, attrs in TK_API.items():
        mod = importlib.import_module(f"triton_kernels.{module}")
        missing = [a for a in attrs if not hasattr(mod, a)]
        if missing:
            raise TritonKernelsNotFound(f"{mod.__file__} has no {', '.join(missing)}: not the matmul_ogs + "
                                        f"SparseMatrix API vLLM 0.33 calls 3.6; run `{GET_SCRIPT}`")
        names |= {a: getattr(mod, a) for a in attrs}
    source = root / "SOURCE"
    names["source"] = source.read_text().strip() if source.is_file() else str(root)
    return types.SimpleNamespace(**names)


# ---- weights ------------------------------------------------------------------------------------------------------
@dataclass
class TkWeights:
    """One layer's weights as triton_kernels takes them."""
    w13: Any            # triton_kernels Tensor, logical [E, H, 2I]
    w2: Any             # [E, I, H]
    w13_precision: Any  # matmul_ogs PrecisionConfig holding the swizzled scales
    w2_precision: Any
    w13_bias: torch.Tensor | None  # fp32 [E, 2I]: vLLM asserts it before matmul_ogs (:776)
    w2_bias: torch.Tensor | None

    def layouts(self) -> dict:
        return {"value": self.w13.storage.layout.name, "scale": self.w13_precision.weight_scale.storage.layout.name}


def hopper_layouts(tk) -> tuple[tuple, tuple]:
    """(value layout, scale layout), each (class, kwargs), as vLLM picks them (mxfp4_utils.py:120-125); on sm_90
    these are HopperMXValueLayout(mx_axis=1) and HopperMXScaleLayout(mx_axis=1, num_warps=8)."""
    return (tk.make_default_matmul_mxfp4_w_layout(mx_axis=1),
            tk.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=HOPPER_SCALE_WARPS))


def to_tk_mx(tk, packed: torch.Tensor, scale: torch.Tensor, *, layouts: tuple[tuple, tuple]) -> tuple[Any, Any]:
    """Our packed e2m1 [E, N, K/2] and e8m0 [E, N, K/32] -> triton_kernels Tensors of logical shape [E, K, N] (K is
    the reduction axis, contiguous: matmul_ogs asserts w.stride(-2) == 1 for MX weights below sm_100)."""
    (value_cls, value_opts), (scale_cls, scale_opts) = layouts
    groups_pad = -scale.shape[-1] % HOPPER_SCALE_GROUPS_MULTIPLE
    scale = torch.nn.functional.pad(scale, (0, groups_pad))  # zero groups: their values are the layout's zero pad
    values = tk.convert_layout(tk.wrap_torch_tensor(packed.transpose(-2, -1), dtype=tk.FP4), value_cls, **value_opts)
    scales = tk.convert_layout(tk.wrap_torch_tensor(scale.transpose(-2, -1)), scale_cls, **scale_opts)
    return values, scales


def to_tk_mx8(tk, values: torch.Tensor, scale: torch.Tensor) -> tuple[Any, Any]:
    """Our e4m3 [E, N, K] and e8m0 [E, N, K/32] -> strided triton_kernels Tensors of logical shape [E, K, N] (K
    contiguous: matmul_ogs asserts it for fp8 weights below sm_100)."""
    return tk.wrap_torch_tensor(values.transpose(-2, -1)), tk.wrap_torch_tensor(scale.transpose(-2, -1))


def to_tk_weights(tk, w, *, layouts: tuple[tuple, tuple]) -> TkWeights:
    """Our MoEWeights (mxfp4_w4a16: in `layouts`; mxfp8: strided) -> TkWeights, done once per model, outside the
    timed region."""
    def precision(scales):
        return tk.PrecisionConfig(weight_scale=scales, flex_ctx=tk.FlexCtx(rhs_data=tk.InFlexData()))

    def fp32(bias):
        return None if bias is None else bias.float()

    def convert(name):
        values, scale = w.in_checkpoint_order(name), w.in_checkpoint_order(f"{name}_scale")
        return to_tk_mx(tk, values, scale, layouts=layouts) if w.scheme.k_pack == 2 else to_tk_mx8(tk, values, scale)
    (w13, s13), (w2, s2) = convert("w13"), convert("w2")
    return TkWeights(w13=w13, w2=w2, w13_precision=precision(s13), w2_precision=precision(s2),
                     w13_bias=fp32(w.w13_bias), w2_bias=fp32(w.w2_bias))


# ---- routing ------------------------------------------------------------------------------------------------------
def router_matrix(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[M, E] bf16: each token's weight at its top-k experts, 0 elsewhere; triton_kernels' topk, given the ids,
    reads the weights from it. Distinct in-range ids per token, else a weight would be lost or misplaced."""
    if ids.shape != weights.shape or ids.dim() != 2:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [M, k]")
    if ids.numel() and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}), got [{ids.min().item()}, {ids.max().item()}]")
    if ids.numel() and (ids.sort(dim=1).values.diff(dim=1) == 0).any():
        raise ValueError("a token names one expert twice in its top-k ids")
    dense = torch.zeros(ids.shape[0], num_experts, dtype=torch.bfloat16, device=ids.device)
    return dense.scatter_(1, ids.long(), weights.to(torch.bfloat16))


@dataclass
class TkRouting:
    data: Any     # matmul_ogs RoutingData
    gather: Any   # GatherIndx: row r of GEMM1 reads token gather.src_indx[r] // k
    scatter: Any  # ScatterIndx: row r of GEMM2 goes to slot scatter.dst_indx[r] (= token * k + j)

    @property
    def slot_of_row(self) -> torch.Tensor:
        """Expert-ordered row -> flat slot (token * k + j)."""
        return self.gather.src_indx


def tk_routing(tk, router: torch.Tensor, ids: torch.Tensor) -> TkRouting:
    """vLLM's make_routing_data + routing_data_from_sparse_topk (gpt_oss_triton_kernels_moe.py:933-977) on our
    ids. On CPU tensors (tests) the bitmatrix comes from topk's torch reference: the interpreter cannot launch
    topk's kernel (its launcher hands the kernel a triton_kernels Tensor)."""
    num_experts, k = router.shape[1], ids.shape[1]
    topk = tk.topk if router.is_cuda else tk.topk_torch
    sparse = topk(router, k, apply_softmax=False, y_indx=ids)
    meta = sparse.mask_metadata
    ragged = tk.make_ragged_tensor_metadata(meta.col_sum, meta.row_sorted_indx.shape[0])
    gate_scal = sparse.vals.flatten()[meta.col_sorted_indx]
    # expt_hist: the per-expert counts (vLLM passes `ragged.block_sizes`, :971; matmul_ogs only tests it for None).
    data = tk.RoutingData(gate_scal, meta.col_sum, num_experts, k, ragged)
    return TkRouting(data=data, gather=tk.GatherIndx(meta.col_sorted_indx, meta.row_sorted_indx),
                     scatter=tk.ScatterIndx(meta.row_sorted_indx, meta.col_sorted_indx))


# ---- their MoE ----------------------------------------------------------------------------------------------------
def swiglu_activation(tk, swiglu: SwigluParams):
    """gpt-oss's clamped SwiGLU fused into GEMM1 (gpt_oss_triton_kernels_moe.py:804-813): halves N."""
    specs = tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2)
    return tk.FusedActivation(specs, (swiglu.alpha, swiglu.limit))


class TkMoE:
    """triton_kernel_fused_experts (gpt_oss_triton_kernels_moe.py:703-846) with our calls: two matmul_ogs."""

    def __init__(self, tk, weights: TkWeights, swiglu: SwigluParams):
        self.tk, self.w = tk, weights
        self.activation = swiglu_activation(tk, swiglu)

    def gemm1(self, x: torch.Tensor, routing: TkRouting, out: torch.Tensor):
        """x [M, H] -> out [M*k, I], rows in expert order."""
        self.tk.matmul_ogs(x, self.w.w13, self.w.w13_bias, routing.data, gather_indx=routing.gather,
                           precision_config=self.w.w13_precision, fused_activation=self.activation, y=out)

    def gemm2(self, inter: torch.Tensor, routing: TkRouting, out: torch.Tensor):
        """inter [M*k, I] -> out [M, H]: each row times its router weight, summed over the token's k rows."""
        self.tk.matmul_ogs(inter, self.w.w2, self.w.w2_bias, routing.data, scatter_indx=routing.scatter,
                           precision_config=self.w.w2_precision, gammas=routing.data.gate_scal, y=out)


@dataclass
class Contender:
    """One side at one point: what is timed, and the outputs checked before timing."""
    forward: Callable[[], Any]
    gemm1: Callable[[], Any]
    gemm2: Callable[[], Any]
    out: torch.Tensor        # [M, H]
    gemm1_out: torch.Tensor  # [M*k, I] in slot order (token * k + j)

    def gemms(self):
        self.gemm1()
        self.gemm2()


def theirs(tk, moe: TkMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
           checked_gemm2_input: torch.Tensor | None = None) -> Contender:
    """checked_gemm2_input: [M*k, I] in our slot order, what their GEMM2 reads for the output checked (default: their
    own GEMM1's output, as timed)."""
    M, k = ids.shape
    # int32 ids, not vLLM's int16 (:884, for its own packing kernel, which shifts in uint32): topk packs the bitmatrix
    # with `1 << (id % 32)` in the ids' dtype (topk_details/_topk_forward.py:140-145), and int16 loses id % 32 >= 16.
    router, ids32 = router_matrix(ids, weights, moe.w.w13.shape[0]), ids.to(torch.int32)
    inter = torch.empty(M * k, moe.w.w2.shape[1], dtype=x.dtype, device=x.device)
    out = torch.empty(M, moe.w.w2.shape[2], dtype=x.dtype, device=x.device)
    routing = tk_routing(tk, router, ids32)  # the GEMMs alone reuse this one

    def forward():
        fresh = tk_routing(tk, router, ids32)
        moe.gemm1(x, fresh, inter)
        moe.gemm2(inter, fresh, out)
    forward()
    gemm1_out = torch.empty_like(inter)
    gemm1_out[routing.slot_of_row.long()] = inter
    checked = out.clone()
    if checked_gemm2_input is not None:
        moe.gemm2(checked_gemm2_input[routing.slot_of_row.long()], routing, checked)
    return Contender(forward=forward, gemm1=lambda: moe.gemm1(x, routing, inter),
                     gemm2=lambda: moe.gemm2(inter, routing, out), out=checked, gemm1_out=gemm1_out)


def ours(layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[Contender, tuple]:
    """The layer call bench/moe.py times, and its GEMMs as bench/vllm_triton.py launches them (`our_gemms`); with
    the values our GEMM1 and GEMM2 read ([M, H] and [M*k, I] in x's dtype: quantised activations dequantised)."""
    prep = layer.prepare_finalize.prepare(x, topk_ids=ids, topk_weights=weights, defer_input_quant=False,
                                          a13_scale=layer.weights.a13_scale)
    x_q, a_scale = layer.experts.gemm1_input(prep.hidden_q, a_scale=prep.a_scale, weights=layer.weights)
    side = our_gemms(layer, x_q, a_scale, ids, weights, alignments=Alignments(ids, layer.weights.num_experts))

    def forward():
        return layer(x, topk_ids=ids, topk_weights=weights)

    def values(q, scale):
        return q if scale is None else dequantize_mx(q, scale, x.dtype)
    contender = Contender(forward=forward, gemm1=side.gemm1, gemm2=side.gemm2, out=forward(),
                          gemm1_out=side.gemm1_out)
    return contender, (values(x_q, a_scale), values(*side.gemm2_input))


# ---- the run ------------------------------------------------------------------------------------------------------
class TkSideBySide:
    """Every model x M: both sides checked, then timed; rows, tables and results.json under --out."""

    def __init__(self, args, tk):
        self.tk, self.rounds, self.ms, self.scheme = tk, args.rounds, args.ms, args.scheme
        self.bench = Bench(argparse.Namespace(smoke=False, models=[], out=args.out, ms=args.ms, schemes=[args.scheme]))
        self.bench.models = {name: TK_MODELS[name] for name in args.models}
        self.cell = Scheme.from_quant(TIMED_SCHEMES[args.scheme]).cell
        # vLLM constrains matmul_ogs on sm_90 once, at weight load (mxfp4_utils.py:129-133).
        tk.update_opt_flags_constraints({"split_k": 1})
        self.bench.ceilings()  # the floor of each point (bench/moe.py), from copy and MMA rates measured now
        self.rows: list[dict] = []
        self.layouts: dict = {}
        self.bench.log(f"triton_kernels: {tk.source}")

    def models(self):
        """(name, our layer, their MoE) per model, each built once (a model's weights take a few GB at most)."""
        for name in self.bench.models:
            layer = self.bench.layer(name, self.cell, "triton.fused_moe")
            tk_weights = to_tk_weights(self.tk, layer.weights, layouts=hopper_layouts(self.tk))
            self.layouts = tk_weights.layouts()
            yield name, layer, TkMoE(self.tk, tk_weights, layer.experts.swiglu)

    def run(self) -> bool:
        for name, layer, moe in self.models():
            for M in self.ms:
                self.rows.append(self.point(name, layer, moe, M))
                self.bench.log(row_line(self.rows[-1]))
                self.save()
        print(self.table(), flush=True)
        return all(r["ok"] for r in self.rows)

    def profile(self) -> bool:
        """--profile: per model and M, both sides checked and warmed up, then each side's two GEMMs once between
        cudaProfilerStart and Stop, which is all that `ncu --profile-from-start off` profiles (gpu_steps.sh
        profile_mx). Nothing is timed."""
        ok = True
        for name, layer, moe in self.models():
            for M in self.ms:
                tk_side, our_side = self.sides(name, layer, moe, M)
                row = self.check(name, M, tk_side, our_side)
                ok &= row["ok"]
                profiled_once([tk_side.gemms, our_side.gemms])
                self.bench.log(f"{'ok  ' if row['ok'] else 'FAIL'} {name} M={M}: profiled triton_kernels' GEMMs, then "
                               f"ours (rel err out {row['rel_err']:.1e}, GEMM1 {row['gemm1_rel_err']:.1e})")
        return ok

    def sides(self, name: str, layer, moe: TkMoE, M: int) -> tuple[Contender, Contender]:
        """Both sides at one point, on the same inputs (MXFP8: their GEMMs read ours', doc)."""
        x, ids, weights = self.bench.inputs(name, M)
        weights = weights.to(torch.bfloat16).float()  # the same values on both sides (doc)
        our_side, (x_values, inter_values) = ours(layer, x, ids, weights)
        if self.scheme == "mxfp4":
            return theirs(self.tk, moe, x, ids, weights), our_side
        return theirs(self.tk, moe, x_values, ids, weights, checked_gemm2_input=inter_values), our_side

    def point(self, name: str, layer, moe: TkMoE, M: int) -> dict:
        try:
            tk_side, our_side = self.sides(name, layer, moe, M)
            row = self.check(name, M, tk_side, our_side)
            row.update(self.timings(tk_side, our_side))
        except torch.OutOfMemoryError:
            return {"model": name, "M": M, "ok": False, "error": "out of memory"}
        finally:
            torch.cuda.empty_cache()
        floor = self.bench.floor_us(self.bench.models[name], M, self.scheme)[0]
        return row | {"ratio": row["tk_forward_us"] / row["ours_forward_us"],
                      "gemms_ratio": row["tk_gemms_us"] / row["ours_gemms_us"], "floor_us": floor,
                      "tk_pct_floor": 100 * floor / row["tk_forward_us"],
                      "ours_pct_floor": 100 * floor / row["ours_forward_us"]}

    def check(self, name: str, M: int, tk_side: Contender, our_side: Contender) -> dict:
        tol = tolerance(self.cell)
        out_err, gemm1_err = rel_err(tk_side.out, our_side.out), rel_err(tk_side.gemm1_out, our_side.gemm1_out)
        return {"model": name, "M": M, "rel_err": out_err, "gemm1_rel_err": gemm1_err, "tol": tol,
                "ok": out_err <= tol and gemm1_err <= tol}  # False on NaN

    def timings(self, tk_side: Contender, our_side: Contender) -> dict:
        """Each part of each side, `fastest_interleaved` over --rounds (bench/moe.py)."""
        sides = {who: {f"_{part}": getattr(side, part) for part in PARTS}
                 for who, side in (("tk", tk_side), ("ours", our_side))}
        return fastest_interleaved(self.bench.interleaved_us, self.rounds, sides) | {"rounds": self.rounds}

    def geomeans(self, column: str) -> dict:
        """Per model and overall, over the points that agree."""
        return geomeans_by(self.rows, "model", self.bench.models, column)

    def table(self) -> str:
        lines = ["| model | M | triton_kernels µs | ours µs | tk / ours | GEMMs: tk µs | ours µs | tk / ours "
                 "| % floor tk | % floor ours | rel. err out / GEMM1 (tol) |", "|" + "---|" * 11]
        for r in self.rows:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['M']} | {r['error']} |" + " – |" * 8)
                continue
            lines.append(f"| {r['model']} | {r['M']} | {r['tk_forward_us']:.1f} | {r['ours_forward_us']:.1f} | "
                         f"{r['ratio']:.2f}{'' if r['ok'] else ' FAIL'} | {r['tk_gemms_us']:.1f} | "
                         f"{r['ours_gemms_us']:.1f} | {r['gemms_ratio']:.2f} | {r['tk_pct_floor']:.0f} | "
                         f"{r['ours_pct_floor']:.0f} | {r['rel_err']:.1e} / {r['gemm1_rel_err']:.1e} "
                         f"({r['tol']:.0e}) |")
        gemms = self.geomeans("gemms_ratio")
        lines += ["", "| geomean | tk / ours (forward) | tk / ours (GEMMs) |", "|---|---|---|"]
        lines += [f"| {key} | {g:.3f} | {gemms[key]:.3f} |" for key, g in self.geomeans("ratio").items()]
        return "\n".join(lines) + "\n"

    def save(self):
        results = {"scheme": self.scheme, "device": self.bench.device_name(), "torch": torch.__version__,
                   "triton": triton.__version__,
                   "triton_kernels": self.tk.source, "tk_layouts": self.layouts,
                   "ceilings": self.bench.results["ceilings"],
                   "timed": "forward: routing + both GEMMs (ours: the layer call); gemms, gemm1, gemm2: alone "
                            "(see bench/tk_mxfp4.py)",
                   "rows": self.rows, "geomean_tk_over_ours": self.geomeans("ratio"),
                   "geomean_tk_over_ours_gemms": self.geomeans("gemms_ratio")}
        (self.bench.out / "results.json").write_text(json.dumps(results, indent=1))
        (self.bench.out / f"tk_{self.scheme}.md").write_text(self.table())


def row_line(r: dict) -> str:
    if "error" in r:
        return f"ERR  {r['model']:14s} M={r['M']:<6d} {r['error']}"
    times = "; ".join(f"{p} {r[f'tk_{p}_us']:.1f} / {r[f'ours_{p}_us']:.1f} us" for p in PARTS)
    line = (f"{'ok  ' if r['ok'] else 'FAIL'} {r['model']:14s} M={r['M']:<6d} rel_err out {r['rel_err']:.1e} "
            f"GEMM1 {r['gemm1_rel_err']:.1e}; tk / ours: {times}; forward tk/ours {r['ratio']:.3f}")
    return line if r["ok"] else line + f" (> tol {r['tol']:.0e}: the sides disagree; not in the geomeans)"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tk-dir", type=Path, default=CARRIED,
                   help="folder holding the triton_kernels package, or the package folder (default: %(default)s, "
                        f"filled by `{GET_SCRIPT}`)")
    p.add_argument("--models", nargs="+", default=list(TK_MODELS), choices=list(TK_MODELS))
    p.add_argument("--scheme", default="mxfp4", choices=SCHEMES, help="the weights' MX format (default %(default)s)")
    p.add_argument("--ms", nargs="+", type=positive_int, default=MX_M_LIST, help="token counts (default %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="time both sides in turn this many times; keep each side's fastest")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results/tk_mxfp4"))
    p.add_argument("--profile", action="store_true",
                   help="time nothing: run each side's GEMMs once inside cudaProfilerStart/Stop, for ncu "
                        "--profile-from-start off (bench/gpu_steps.sh profile_mx)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tk = load_triton_kernels(args.tk_dir)
    except TritonKernelsNotFound as exc:
        sys.exit(f"bench/tk_mxfp4.py: {exc}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench/tk_mxfp4.py: needs an sm_90 GPU (H100/H200): it models vLLM's Hopper path of triton_kernels")
    side_by_side = TkSideBySide(args, tk)
    ok = side_by_side.profile() if args.profile else side_by_side.run()
    if not ok:
        print("FAIL: at the points marked FAIL (the two sides disagree) or ERR above", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
