"""vLLM 0.33's Triton fused-MoE GEMMs side by side with ours: same inputs, same device, same protocol.

    bash bench/get_vllm_triton.sh                      # once: vLLM's fused_moe.py + configs/ -> carry/vllm033
    python bench/vllm_triton.py --out DIR [--vllm-dir carry/vllm033] [--models ..] [--schemes ..] [--ms ..] [--per-gemm]
        [--baseline OLD/results.json]   # also: the points whose config changed, then and now, against the drift
    TRITON_INTERPRET=1 python bench/vllm_triton.py --smoke --out DIR   # tiny fp16 shapes on the CPU
    ncu --profile-from-start off ... python bench/vllm_triton.py --profile ...   # bench/gpu_steps.sh profile_vllm

What runs on the vLLM side is vLLM's own code, read at run time from its `fused_moe.py` (never
copied here): the @triton.jit `fused_moe_kernel` (and `write_zeros_to_output`), its launcher
`invoke_fused_moe_triton_kernel` (grid, strides, constexprs, SWAP_AB, the block-scale BLOCK_K cap),
its config selection `try_get_optimal_moe_config` -> `get_moe_configs` (the tuned JSON in its
`configs/`, nearest M) or `get_default_config`, and `_prepare_expert_assignment` (the naive
one-slot-per-block path when 4*M*k <= E). The functions are taken from the file's AST and executed,
at their own file:line, in a namespace holding triton, tl, torch and the small stand-ins of
`_VllmStandIns` for the names they import from the rest of vLLM (its compiled ops never load here).
One config serves both GEMMs, as in vLLM (fused_moe.py:1745 and experts/triton_moe.py:322).

Compared, per model x scheme x M: the two GEMMs and nothing else.
  vLLM:  GEMM1 x_q . w13^T -> [M*k, 2I] (+bias), then GEMM2 inter_q . w2^T (+bias) x router weight
         (MUL_ROUTED_WEIGHT) -> [M*k, H]: two launches of `invoke_fused_moe_triton_kernel`.
  ours:  `launch.gemm1` (gemm1_gated_kernel: GEMM1 with the activation fused, -> [M*k, I]) and
         `launch.gemm2` (gemm2_weighted_kernel), with our own config (`launch.config_for`).
Not timed on either side: routing, sorting (`moe_align`), the input and intermediate quantisation, the
top-k sum, and vLLM's separate activation kernel (silu_and_mul & co., compiled CUDA ops that cannot run
here). Our GEMM1 includes the activation that vLLM pays a separate kernel for, so the ratio is
conservative for us. Both sides read the same quantised x, weights and GEMM2 input (below).
Sorting: vLLM's `moe_align_block_size` is a CUDA op; ours (align.py) has its layout (padding sentinel
M*k, one expert id per BLOCK_M block, no -1 without expert parallelism) and is re-laid into vLLM's
buffer sizes (moe_align_block_size.py:137-152), so its grid is the one vLLM launches. Where the two
BLOCK_M agree, both sides use the very same sorted ids.

Both GEMM2s read the same quantised intermediate: ours (our GEMM1's output through our quantiser).
Correctness, every point, before timing, as relative Frobenius errors within `moe.tolerance` (1e-2 bf16,
3e-2 fp8): vLLM's GEMM1 output through the torch activation (`apply_activation`) against our GEMM1's
output (before any quantisation), and vLLM's GEMM2 + a torch sum over k against our full
`launch.fused_moe`. (Re-quantising vLLM's own intermediate instead would flip FP8 roundings: two correct
FP8 pipelines differ by ~2e-2 that way, too close to the tolerance to tell a wrong launch from rounding.)
A failing point is printed FAIL, left out of the geomeans and makes the run exit 1; it is still timed.
Timing: `moe.interleaved_us` (CUDA-graph replays of both sides in turn, L2 flushed before each, medians); --smoke
prints one CPU wall time instead (interpreter, not a measurement). Ratio = vLLM µs / our µs (> 1: we
are faster). Geomeans of the ratios per scheme and overall.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import functools
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import triton
import triton.language as tl

from moe import MODELS, TIMED_SCHEMES, Bench, fastest_interleaved, profiled_once, rel_err, tolerance
from moerules.kernels.activations import apply_activation
from moerules.kernels.scheme import TORCH_DTYPE, Scheme
from moerules.kernels.triton import launch
from moerules.kernels.triton.align import Alignment, moe_align
from moerules.kernels.triton.config import GemmConfig, MoEConfig

REPO = Path(__file__).resolve().parent.parent
CARRIED = REPO / "carry" / "vllm033"
FUSED_MOE_DIR = Path("model_executor", "layers", "fused_moe")
SCHEMES = ("bf16", "fp8_tensor", "fp8_block")
BAR = 1.10  # issue 11: the geomean of vLLM / ours the grid is to reach
# vLLM's config dtype string (fused_moe/config.py:42 `_get_config_dtype_str`) and block_shape per scheme.
VLLM_QUANT = {"bf16": (None, None), "fp8_tensor": ("fp8_w8a8", None), "fp8_block": ("fp8_w8a8", [128, 128])}
# The parts of vLLM's fused_moe.py that run here, by name.
VLLM_FUNCTIONS = ("write_zeros_to_output", "fused_moe_kernel", "invoke_fused_moe_triton_kernel",
                  "get_config_file_name", "get_moe_configs", "get_default_config", "should_moe_wna16_use_cuda",
                  "try_get_optimal_moe_config", "_prepare_expert_assignment")


class VllmNotFound(RuntimeError):
    pass


def find_fused_moe(vllm_dir: Optional[str]) -> Path:
    """Folder holding vLLM's fused_moe.py and configs/: --vllm-dir, else the installed vllm package (found,
    not imported), else carry/vllm033."""
    candidates = []
    if vllm_dir:
        candidates.append(Path(vllm_dir))
    else:
        spec = importlib.util.find_spec("vllm")  # top-level lookup: reads the directory, runs no vllm code
        if spec is not None and spec.origin:
            candidates.append(Path(spec.origin).parent / FUSED_MOE_DIR)
        candidates.append(CARRIED)
    for c in candidates:
        if (c / "fused_moe.py").is_file() and (c / "configs").is_dir():
            return c
    raise VllmNotFound(f"no vLLM fused_moe.py with a configs/ folder beside it in {', '.join(map(str, candidates))}; "
                       "run `bash bench/get_vllm_triton.sh` (fills carry/vllm033) or pass --vllm-dir")


class Alignments:
    """`moe_align` of one routing, once per (BLOCK_M, TAIL_M): the two sides share it where these agree (vLLM's
    has no tail tiles)."""

    def __init__(self, topk_ids: torch.Tensor, num_experts: int):
        self.topk_ids, self.num_experts = topk_ids, num_experts
        self._by_tiles: dict[tuple[int, int], Alignment] = {}

    def __call__(self, block_m: int, tail_m: int = 0) -> Alignment:
        if (block_m, tail_m) not in self._by_tiles:
            self._by_tiles[block_m, tail_m] = moe_align(self.topk_ids, num_experts=self.num_experts, block_m=block_m,
                                                        tail_m=tail_m)
        return self._by_tiles[block_m, tail_m]


class _Quiet:
    """vLLM's logger: its messages (which config file, TD warnings) are not needed here."""

    def __getattr__(self, name):
        return lambda *a, **k: None


class _VllmStandIns:
    """What vLLM's functions reference from the rest of vLLM, as this harness provides it.

    `capability` is the GPU's (sm_90 on an H100); the smoke run passes (9, 0) so that vLLM's SWAP_AB
    path, which the H100 takes for FP8 at BLOCK_SIZE_M < 64, also runs in the interpreter.
    """

    def __init__(self, capability: tuple[int, int], device_file_name: str):
        self.capability, self.device_file_name = capability, device_file_name
        self.alignments: Optional[Alignments] = None  # the current point's; set by the harness

    def namespace(self, fused_moe_py: Path) -> dict:
        envs = types.SimpleNamespace(VLLM_BATCH_INVARIANT=False, VLLM_TUNED_CONFIG_FOLDER=None,
                                     VLLM_TRITON_USE_TD=None)
        platform = types.SimpleNamespace(is_rocm=lambda: False, is_cuda=torch.cuda.is_available)
        return {"__name__": "vllm_fused_moe", "__file__": str(fused_moe_py), "__builtins__": self._builtins(),
                "triton": triton, "tl": tl, "torch": torch, "os": os, "json": json, "functools": functools,
                "Any": Any, "envs": envs, "logger": _Quiet(), "current_platform": platform,
                "get_device_name_as_file_name": lambda device_id=0: self.device_file_name,
                "next_power_of_2": triton.next_power_of_2, "enable_swap_ab": self.enable_swap_ab,
                # utils.py:736: VLLM_TRITON_USE_TD unset -> the tensor-descriptor path only on XPU.
                "resolve_moe_use_td": lambda: False, "warn_if_moe_use_td_ineffective": lambda *a, **k: None,
                "set_triton_allocator": self._unsupported, "moe_align_block_size": self.moe_align_block_size}

    def enable_swap_ab(self, block_m: int, block_n: int) -> bool:
        # utils.py:706: sm_90 and BLOCK_SIZE_M < 64 and BLOCK_SIZE_N >= 64.
        return self.capability == (9, 0) and block_m < 64 and block_n >= 64

    def moe_align_block_size(self, topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False,
                             ignore_invalid_experts=False, return_scatter_idx=False):
        """vLLM's CUDA op, from ours: same layout, in buffers of vLLM's sizes (moe_align_block_size.py:137-152)."""
        if expert_map is not None or pad_sorted_ids or return_scatter_idx:
            self._unsupported("moe_align_block_size with expert_map / pad_sorted_ids / scatter_idx")
        if self.alignments is None or self.alignments.topk_ids is not topk_ids:
            raise RuntimeError("moe_align_block_size stand-in called for a routing the harness did not set")
        ours, n = self.alignments(block_size), topk_ids.numel()
        size = n + num_experts * (block_size - 1)
        if n < num_experts:
            size = min(n * block_size, size)
        sorted_ids = torch.full((size,), n, dtype=torch.int32, device=topk_ids.device)
        expert_ids = torch.zeros(triton.cdiv(size, block_size), dtype=torch.int32, device=topk_ids.device)
        # Rows past num_tokens_post_padded (<= size) are never read; our buffer may be a block longer.
        rows, blocks = min(size, ours.sorted_ids.numel()), min(expert_ids.numel(), ours.num_blocks)
        sorted_ids[:rows] = ours.sorted_ids[:rows]
        expert_ids[:blocks] = ours.expert_ids[:blocks]
        return sorted_ids, expert_ids, ours.num_post_padded

    @staticmethod
    def _unsupported(*what):
        raise NotImplementedError(f"bench/vllm_triton.py has no stand-in for {what or 'this vLLM path'}")

    @staticmethod
    def _builtins() -> dict:
        """Builtins whose __import__ answers the one import inside vLLM's functions (try_get_optimal_moe_config's
        override config: none here) and refuses any other vllm import, so no vllm module ever loads."""
        real = builtins.__import__

        def guarded(name, globals=None, locals=None, fromlist=(), level=0):
            if name == "vllm.model_executor.layers.fused_moe" and fromlist == ("get_config",):
                return types.SimpleNamespace(get_config=lambda: None)
            if name.split(".")[0] == "vllm":
                raise ImportError(f"bench/vllm_triton.py does not load vllm modules ({name})")
            return real(name, globals, locals, fromlist, level)
        return dict(vars(builtins), __import__=guarded)


def _free_names(fn: ast.FunctionDef) -> set[str]:
    """Global names a function reads: loaded names that are neither bound in it nor builtins."""
    bound = {a.arg for a in ast.walk(fn) if isinstance(a, ast.arg)}
    bound |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {(a.asname or a.name).split(".")[0] for n in ast.walk(fn) if isinstance(n, ast.ImportFrom | ast.Import)
              for a in n.names}
    loads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loads - bound - set(vars(builtins))


def load_vllm(folder: Path, stand_ins: _VllmStandIns) -> types.SimpleNamespace:
    """VLLM_FUNCTIONS of folder/fused_moe.py, compiled at their own file and lines, in the stand-ins' namespace."""
    path = folder / "fused_moe.py"
    source = path.read_text()
    defs = {n.name: n for n in ast.parse(source, filename=str(path)).body if isinstance(n, ast.FunctionDef)}
    missing = [name for name in VLLM_FUNCTIONS if name not in defs]
    if missing:
        raise VllmNotFound(f"{path} has no {', '.join(missing)}: not vLLM 0.33's fused_moe.py?")
    ns = stand_ins.namespace(path)
    unknown = set().union(*(_free_names(defs[n]) for n in VLLM_FUNCTIONS)) - set(ns) - set(VLLM_FUNCTIONS)
    if unknown:
        raise VllmNotFound(f"{path} references {sorted(unknown)}, which bench/vllm_triton.py has no stand-in for")
    module = ast.Module(body=[defs[n] for n in VLLM_FUNCTIONS], type_ignores=[])
    exec(compile(module, str(path), "exec"), ns)  # noqa: S102 - vLLM's own code, at its own lines
    return types.SimpleNamespace(**{n: ns[n] for n in VLLM_FUNCTIONS}, path=path,
                                 sha256=hashlib.sha256(source.encode()).hexdigest())


def load_vllm_for_device(vllm_dir: Optional[str], *, smoke: bool) -> tuple[types.SimpleNamespace, _VllmStandIns]:
    """vLLM's functions with stand-ins for this GPU (the smoke run stands in an sm_90 named "cpu")."""
    capability = (9, 0) if smoke else torch.cuda.get_device_capability()
    # vLLM's device part of config file names (utils/platform_utils.py:69).
    file_name = "cpu" if smoke else re.sub(r"[\s/]+", "_", torch.cuda.get_device_name())
    stand_ins = _VllmStandIns(capability, file_name)
    return load_vllm(find_fused_moe(vllm_dir), stand_ins), stand_ins


def vllm_config(v: types.SimpleNamespace, stand_ins: _VllmStandIns, w, sname: str, M: int, top_k: int
                ) -> tuple[dict, dict]:
    """(vLLM's config at this point, the same as vLLM launches it: SWAP_AB and the block-scale BLOCK_K cap)."""
    dtype, block_shape = VLLM_QUANT[sname]
    config = v.try_get_optimal_moe_config(w.w13.size(), w.w2.size(), top_k, dtype, M, block_shape=block_shape)
    launched = dict(config, SWAP_AB=dtype == "fp8_w8a8" and stand_ins.enable_swap_ab(config["BLOCK_SIZE_M"],
                                                                                      config["BLOCK_SIZE_N"]))
    if block_shape:
        launched["BLOCK_SIZE_K"] = min(config["BLOCK_SIZE_K"], *block_shape)
    return config, launched


def as_our_config(launched: dict) -> MoEConfig:
    """vLLM's tiles as ours, at the same work per program: vLLM's GEMM1 tile of BLOCK_SIZE_N rows of w13 is our
    BLOCK_N / 2 gate rows plus as many up rows; GEMM2 tiles are alike."""
    def gemm(block_n: int) -> GemmConfig:
        return GemmConfig(BLOCK_N=block_n, BLOCK_K=launched["BLOCK_SIZE_K"], GROUP_M=launched["GROUP_SIZE_M"],
                          num_warps=launched["num_warps"], num_stages=launched["num_stages"],
                          SWAP_AB=launched["SWAP_AB"])
    return MoEConfig(BLOCK_M=launched["BLOCK_SIZE_M"], gemm1=gemm(max(16, launched["BLOCK_SIZE_N"] // 2)),
                     gemm2=gemm(launched["BLOCK_SIZE_N"]))


class PeerConfigs:
    """The tuner's peer seed (bench/moe.py --peer-configs): vLLM's config at a point, as ours."""

    def __init__(self, vllm_dir: str, *, smoke: bool):
        self.vllm, self.stand_ins = load_vllm_for_device(vllm_dir, smoke=smoke)

    def at(self, w, sname: str, M: int, top_k: int) -> Optional[MoEConfig]:
        if sname not in VLLM_QUANT:
            return None  # MX: vLLM runs OAI's triton_kernels, not this kernel
        return as_our_config(vllm_config(self.vllm, self.stand_ins, w, sname, M, top_k)[1])


@dataclass
class Side:
    """One side at one point: its two GEMM launches, its [M, H] output and activated GEMM1 output to check, the
    config it launched; ours also hands its quantised intermediate to vLLM's GEMM2."""
    gemm1: Callable[[], Any]
    gemm2: Callable[[], Any]
    out: torch.Tensor
    gemm1_out: torch.Tensor
    config: dict
    gemm2_input: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None

    def launches(self):
        self.gemm1()
        self.gemm2()


def our_gemms(layer, x_q, a_scale, ids, tw, *, alignments: Alignments) -> Side:
    """Our GEMM1 and GEMM2 launches as launch.fused_moe makes them, with fused_moe's own output to check;
    `alignments` gives the sorting for our BLOCK_M."""
    w, (M, k) = layer.weights, ids.shape
    act, swiglu = layer.experts.activation, layer.experts.swiglu
    cfg = launch.config_for(w, num_tokens=M, top_k=k, device=x_q.device)
    align = alignments(cfg.BLOCK_M, cfg.TAIL_M)
    cfg = launch.sorted_intermediate_in_use(cfg, align, w)
    out_dtype = TORCH_DTYPE[w.in_dtype]
    inter = launch.intermediate_buffer(w, align, cfg, num_slots=M * k, dtype=out_dtype)
    out2 = torch.empty(M * k, w.hidden, dtype=out_dtype, device=x_q.device)

    quantize = layer.experts.quantize_intermediate(w)

    def gemm1():  # -> the intermediate's partial amaxes when GEMM1 computes them (launch.gemm1)
        return launch.gemm1(x_q, a_scale, weights=w, align=align, cfg=cfg, activation=act, out=inter, top_k=k,
                            swiglu=swiglu)
    inter_q, inter_scale = quantize(inter, gemm1())
    # GEMM2 reads a buffer GEMM1 does not write, as vLLM's GEMM2 here: both start from a flushed L2.
    inter_q = inter_q.clone() if inter_q is inter else inter_q

    def gemm2():
        launch.gemm2(inter_q, inter_scale, weights=w, topk_weights=tw, align=align, cfg=cfg, out=out2)
    full = launch.fused_moe(x_q, a_scale=a_scale, weights=w, topk_ids=ids, topk_weights=tw, activation=act,
                            quantize_intermediate=quantize, out_dtype=out_dtype, swiglu=swiglu)
    by_slot = (lambda t: in_slot_order(t, align, M * k)) if cfg.SORTED_INTER else (lambda t: t)
    return Side(gemm1=gemm1, gemm2=gemm2, out=full, gemm1_out=by_slot(inter), config=cfg.to_dict(),
                gemm2_input=(by_slot(inter_q), inter_scale))


def gemm_inputs(b: Bench, name: str, sname: str, M: int):
    """(the Triton layer, topk ids, topk weights, GEMM1's input and its scale) at one point, as the layer prepares
    them."""
    layer = b.layer(name, Scheme.from_quant(TIMED_SCHEMES[sname]).cell, "triton.fused_moe")
    w = layer.weights
    x, ids, tw = b.inputs(name, M)
    prep = layer.prepare_finalize.prepare(x, topk_ids=ids, topk_weights=tw, defer_input_quant=False,
                                          a13_scale=w.a13_scale)
    x_q, a_scale = layer.experts.gemm1_input(prep.hidden_q, a_scale=prep.a_scale, weights=w)
    return layer, ids, tw, x_q, a_scale


def in_slot_order(rows: torch.Tensor, align, num_slots: int) -> torch.Tensor:
    """An intermediate laid out by aligned row (MoEConfig.SORTED_INTER) as vLLM's kernels write and read it: a row
    per slot."""
    n = int(align.num_post_padded.item())
    slots = align.sorted_ids[:n].long()
    real = slots < num_slots
    row_of_slot = torch.empty(num_slots, dtype=torch.long, device=rows.device)
    row_of_slot[slots[real]] = torch.arange(n, device=rows.device)[real]
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[rows.element_size()]  # fp8 rows cannot be indexed
    return rows.view(bits)[row_of_slot].view(rows.dtype)


def geomeans_by(rows: list[dict], group: str, groups, column: str) -> dict[str, float]:
    """The geomean of `column` per value of `group` (in the order of `groups`) and overall, over the rows that
    agree (`ok`)."""
    values: dict[str, list[float]] = {g: [] for g in groups}
    for r in rows:
        if r["ok"]:
            values[r[group]].append(r[column])
    values["overall"] = [x for v in values.values() for x in v]
    return {g: math.exp(sum(map(math.log, v)) / len(v)) for g, v in values.items() if v}


def headroom(rows: list[dict], bar: float = BAR) -> Optional[dict]:
    """Where the geomean of vLLM / ours has to come from to reach `bar`, over the points that agree: those whose cap
    (vLLM / floor, the most any kernel could reach there) is below `bar`, and the geomean the others would need
    with the capped ones as they are. None where every point is capped."""
    ok = [r for r in rows if r["ok"]]
    capped = [r for r in ok if r["vllm_over_floor"] < bar]
    free = [r for r in ok if r["vllm_over_floor"] >= bar]
    if not free:
        return None
    logs = sum(math.log(r["ratio"]) for r in capped)
    return {"bar": bar, "capped": len(capped), "uncapped": len(free),
            "capped_geomean": geomeans_by(capped, "scheme", SCHEMES, "ratio").get("overall"),
            "uncapped_geomean": geomeans_by(free, "scheme", SCHEMES, "ratio")["overall"],
            "uncapped_needed": math.exp((len(ok) * math.log(bar) - logs) / len(free))}


def against_baseline(rows: list[dict], baseline_rows: list[dict]) -> Optional[dict]:
    """This run's points against an earlier run's (--baseline), over the points that agree in both: the geomean of
    vLLM / ours then and now, split by whether our config at the point changed. The unchanged points show the drift
    between the two runs (machines, clocks), which a change has to clear (bench/results/s44: the 16 points whose
    config changed went 1.135 -> 1.139 while the 47 others drifted 1.053 -> 1.062). None where no point is in both."""
    def key(r: dict) -> tuple:
        return r["model"], r["scheme"], r["M"]
    before = {key(r): r for r in baseline_rows if r.get("ok")}
    pairs = [(before[key(r)], r) for r in rows if r.get("ok") and key(r) in before]
    if not pairs:
        return None

    def split(changed: bool) -> dict:
        group = [(b, r) for b, r in pairs
                 if (MoEConfig.from_dict(b["ours_config"]) != MoEConfig.from_dict(r["ours_config"])) == changed]
        then, now = (geomeans_by([p[i] for p in group], "scheme", SCHEMES, "ratio").get("overall") for i in (0, 1))
        return {"points": len(group), "before": then, "after": now,
                "each": [{"point": f"{r['model']} {r['scheme']} M={r['M']}", "before": b["ratio"],
                          "after": r["ratio"]} for b, r in group]}
    return {"changed": split(True), "unchanged": split(False)}


class SideBySide:
    """The run: every model x scheme x M of bench/moe.py's grid (through its Bench: weights, layers, inputs, timing)."""

    def __init__(self, args):
        self.bench = Bench(argparse.Namespace(smoke=args.smoke, models=args.models, out=args.out, ms=args.ms,
                                              schemes=args.schemes))
        self.smoke, self.per_gemm = args.smoke, getattr(args, "per_gemm", False)
        self.rounds = getattr(args, "rounds", 1)
        self.vllm, self.stand_ins = load_vllm_for_device(args.vllm_dir, smoke=args.smoke)
        # vLLM's compute_type is the unquantised activation dtype: bf16 here (fused_moe.py:1767-1772; for fp8
        # inputs experts/triton_moe.py:336-342 also takes bf16), fp16 in the interpreter.
        self.compute_type = tl.float16 if self.smoke else tl.bfloat16
        self.bench.ceilings()  # the floor of each point (bench/moe.py), from copy and MMA rates measured now
        self.rows: list[dict] = []
        self.baseline: Optional[tuple[str, list[dict]]] = getattr(args, "baseline", None)  # (path, its rows)
        self.bench.log(f"vLLM fused_moe.py: {self.vllm.path} (sha256 {self.vllm.sha256[:16]})")

    def run(self) -> bool:
        for name in self.bench.models:
            for sname in [s for s in self.bench.timed_schemes(name) if s in SCHEMES]:
                for M in self.bench.ms(sname):
                    self.rows.append(self.point(name, sname, M))
                    self.bench.log(_row_line(self.rows[-1]))
                    self.save()
        self.save()
        print(self.table(), flush=True)
        return all(r["ok"] for r in self.rows)

    def profile(self) -> bool:
        """--profile: per point, both sides checked, then vLLM's two GEMMs and ours once inside cudaProfilerStart/Stop
        (`profiled_once`; bench/gpu_steps.sh profile_vllm). Nothing is timed."""
        ok = True
        for name in self.bench.models:
            for sname in [s for s in self.bench.timed_schemes(name) if s in SCHEMES]:
                for M in self.bench.ms(sname):
                    row, vllm, ours = self.compare(name, sname, M)
                    profiled_once([vllm.launches, ours.launches])
                    self.stand_ins.alignments = None
                    ok &= row["ok"]
                    self.bench.log(f"{'ok  ' if row['ok'] else 'FAIL'} {name} {sname} M={M}: profiled vLLM's GEMM1, "
                                   f"GEMM2, then ours (rel err GEMM1 {row['gemm1_rel_err']:.1e}, out "
                                   f"{row['rel_err']:.1e}); vLLM {_vllm_tiles(row['vllm_config']['launched'])}, "
                                   f"ours {_our_tiles(row['ours_config'])}")
        return ok

    def point(self, name: str, sname: str, M: int) -> dict:
        """Checked, then timed: vLLM's two GEMMs and ours (--per-gemm: also each GEMM alone)."""
        try:
            row, vllm, ours = self.compare(name, sname, M)
            row.update(self.timings(vllm, ours))
            row["ratio"] = row["vllm_us"] / row["ours_us"]
            row["floor_us"] = self.bench.floor_us(self.bench.models[name], M, sname)[0]
            row["vllm_over_floor"] = row["vllm_us"] / row["floor_us"]  # the largest ratio any kernel could reach
        except torch.OutOfMemoryError:
            row = {"model": name, "scheme": sname, "M": M, "ok": False, "error": "out of memory"}
        finally:
            self.stand_ins.alignments = None
            if not self.smoke:
                torch.cuda.empty_cache()
        return row

    def timings(self, vllm: Side, ours: Side) -> dict:
        """Both GEMMs (--per-gemm: also each alone) of each side, `fastest_interleaved` over --rounds."""
        def parts(side: Side) -> dict:
            return {"": side.launches} | ({"_gemm1": side.gemm1, "_gemm2": side.gemm2} if self.per_gemm else {})
        times = fastest_interleaved(self.bench.interleaved_us, self.rounds, {"vllm": parts(vllm), "ours": parts(ours)})
        return times | ({"rounds": self.rounds} if self.rounds > 1 else {})

    def compare(self, name: str, sname: str, M: int):
        """(row with both checks, vLLM's side, ours) at one point."""
        layer, ids, tw, x_q, a_scale = gemm_inputs(self.bench, name, sname, M)
        w = layer.weights
        self.stand_ins.alignments = Alignments(ids, w.num_experts)
        ours = our_gemms(layer, x_q, a_scale, ids, tw, alignments=self.stand_ins.alignments)
        vllm = self.vllm_gemms(layer, sname, x_q, a_scale, ids, tw, gemm2_input=ours.gemm2_input)
        tol = tolerance(w.scheme.cell)
        gemm1_err, out_err = rel_err(vllm.gemm1_out, ours.gemm1_out), rel_err(vllm.out, ours.out)
        row = {"model": name, "scheme": sname, "M": M, "gemm1_rel_err": gemm1_err, "rel_err": out_err, "tol": tol,
               "ok": gemm1_err <= tol and out_err <= tol,  # False on NaN
               "vllm_config": vllm.config, "ours_config": ours.config}
        return row, vllm, ours

    def vllm_gemms(self, layer, sname: str, x_q, a_scale, ids, tw, *, gemm2_input) -> Side:
        """vLLM's GEMM1 and GEMM2 launches as fused_experts_impl makes them (fused_moe.py:1745-1861): one config,
        one expert assignment, GEMM2 with MUL_ROUTED_WEIGHT and top_k 1, reading `gemm2_input` (ours)."""
        v, w, (M, k) = self.vllm, layer.weights, ids.shape
        dtype, block_shape = VLLM_QUANT[sname]
        config, launched = vllm_config(v, self.stand_ins, w, sname, M, k)
        sorted_ids, expert_ids, num_post = v._prepare_expert_assignment(ids, config, M, k, w.num_experts, None,
                                                                        block_shape=block_shape,
                                                                        ignore_invalid_experts=True)
        flags = dict(compute_type=self.compute_type, use_fp8_w8a8=dtype == "fp8_w8a8", use_int8_w8a8=False,
                     use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False, block_shape=block_shape)
        out_dtype = TORCH_DTYPE[w.in_dtype]
        out1 = torch.empty(M, k, w.w13.shape[1], dtype=out_dtype, device=x_q.device)
        out2 = torch.empty(M, k, w.hidden, dtype=out_dtype, device=x_q.device)
        inter_q, inter_scale = gemm2_input

        def gemm1():
            v.invoke_fused_moe_triton_kernel(x_q, w.w13, out1, a_scale, w.w13_scale, None, sorted_ids, expert_ids,
                                             num_post, False, k, config, B_bias=w.w13_bias, **flags)

        def gemm2():
            v.invoke_fused_moe_triton_kernel(inter_q, w.w2, out2, inter_scale, w.w2_scale, tw, sorted_ids, expert_ids,
                                             num_post, True, 1, config, B_bias=w.w2_bias, **flags)
        gemm1()
        gemm2()
        return Side(gemm1=gemm1, gemm2=gemm2, out=out2.sum(dim=1),
                    gemm1_out=apply_activation(out1.view(M * k, -1), layer.experts.activation, layer.experts.swiglu),
                    config=self.describe_vllm(launched, w, dtype, block_shape, naive=sorted_ids is None))

    def describe_vllm(self, launched: dict, w, dtype: Optional[str], block_shape: Optional[list[int]], *,
                      naive: bool) -> dict:
        """The config as vLLM launches it, and where it came from."""
        v, E, N = self.vllm, w.num_experts, w.w2.shape[2]
        bn, bk = block_shape or (0, 0)
        found = v.get_moe_configs(E, N, dtype, bn, bk) is not None
        return {"launched": dict(launched, naive_block_assignment=naive),
                "source": v.get_config_file_name(E, N, dtype, block_shape) if found else "get_default_config"}


    def geomeans(self, column: str = "ratio") -> dict:
        """Per scheme and overall, over the points that agree; of vLLM / ours, or of another column."""
        return geomeans_by(self.rows, "scheme", SCHEMES, column)

    def table(self) -> str:
        lines = ["| model | scheme | M | vLLM µs | ours µs | vLLM / ours | vLLM / floor "
                 "| rel. error GEMM1 / out (tol) | vLLM config (source) | our config |", "|" + "---|" * 10]
        for r in self.rows:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['scheme']} | {r['M']} | – | – | {r['error']} |" + " – |" * 4)
                continue
            t = (f"{r['vllm_us']:.1f} | {r['ours_us']:.1f} | {r['ratio']:.2f}{'' if r['ok'] else ' FAIL'} | "
                 f"{r['vllm_over_floor']:.2f}")
            v = r["vllm_config"]
            lines.append(f"| {r['model']} | {r['scheme']} | {r['M']} | {t} | {r['gemm1_rel_err']:.1e} / "
                         f"{r['rel_err']:.1e} ({r['tol']:.0e}) | "
                         f"{_vllm_tiles(v['launched'])} ({v['source']}) | {_our_tiles(r['ours_config'])} |")
        if self.smoke:
            lines.append("\n--smoke: fp16 (the bf16 rows too); µs are one CPU wall time under the Triton "
                         "interpreter, not a measurement.")
        ceiling = self.geomeans("vllm_over_floor")
        lines += ["", "vLLM / floor is the largest vLLM / ours any kernel could reach at the point (bench/moe.py's "
                  "floor: weight bytes at the measured copy rate, or FLOPs at the measured MMA rate).", "",
                  "| geomean | vLLM / ours | vLLM / floor |", "|---|---|---|"]
        lines += [f"| {s} | {g:.3f} | {ceiling[s]:.3f} |" for s, g in self.geomeans().items()]
        need = headroom(self.rows)
        if need:
            capped = (f"{need['capped']} points cap below {need['bar']:.2f} (ours {need['capped_geomean']:.3f} there); "
                      if need["capped"] else "")
            lines += ["", f"To reach {need['bar']:.2f}: {capped}the other {need['uncapped']} would need "
                          f"{need['uncapped_needed']:.3f} (now {need['uncapped_geomean']:.3f})."]
        return "\n".join(lines + self.baseline_lines()) + "\n"

    def baseline_lines(self) -> list[str]:
        """--baseline: the geomeans then and now of the points whose config changed and of the others, and each
        changed point."""
        compared = self.against_baseline()
        if compared is None:
            return []
        changed, same = compared["changed"], compared["unchanged"]

        def then_now(group: dict) -> str:
            return f"{group['before']:.3f} -> {group['after']:.3f}" if group["points"] else "-"
        lines = ["", f"Against {self.baseline[0]}: the {changed['points']} points whose config changed went "
                     f"{then_now(changed)}; the {same['points']} others {then_now(same)} (the drift between the runs)."]
        if changed["points"]:
            lines += ["", "| changed point | vLLM / ours then | now |", "|---|---|---|"]
            lines += [f"| {m['point']} | {m['before']:.3f} | {m['after']:.3f} |" for m in changed["each"]]
        return lines

    def against_baseline(self) -> Optional[dict]:
        return against_baseline(self.rows, self.baseline[1]) if self.baseline else None

    def save(self):
        out = self.bench.out
        results = {"device": self.bench.device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "vllm_fused_moe": str(self.vllm.path), "vllm_fused_moe_sha256": self.vllm.sha256,
                   "timed": "GEMM1 + GEMM2 launches only (see bench/vllm_triton.py)",
                   "rows": self.rows, "geomean_vllm_over_ours": self.geomeans(),
                   "geomean_vllm_over_floor": self.geomeans("vllm_over_floor"), "headroom": headroom(self.rows),
                   "baseline": self.baseline[0] if self.baseline else None, "against_baseline": self.against_baseline()}
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "vllm_triton.md").write_text(self.table())


def _vllm_tiles(c: dict) -> str:
    flags = "".join(f" {f}" for f, on in (("swapAB", c["SWAP_AB"]), ("naive", c["naive_block_assignment"])) if on)
    return (f"M{c['BLOCK_SIZE_M']} N{c['BLOCK_SIZE_N']} K{c['BLOCK_SIZE_K']} G{c['GROUP_SIZE_M']} "
            f"w{c['num_warps']} s{c['num_stages']}{flags}")


def _our_tiles(c: dict) -> str:
    """A data-file entry (MoEConfig.to_dict) in the table's short form: every field that is set."""
    def gemm(g):
        flags = "".join(f" {f}" for f, on in (("swap", g.get("SWAP_AB")), ("tma", g.get("TMA")),
                                               ("half", g.get("HALF_MMA"))) if on)
        flags += f" maxnreg {g['MAXNREG']}" if g.get("MAXNREG") else ""
        flags += f" persistent {g['PERSISTENT']}" if g.get("PERSISTENT") else ""
        return f"N{g['BLOCK_N']} K{g['BLOCK_K']} G{g['GROUP_M']} w{g['num_warps']} s{g['num_stages']}{flags}"
    rows = "".join(f" {name} {c[field]}" for name, field in (("tail", "TAIL_M"), ("gemm2 rows", "GEMM2_BLOCK_M"))
                   if c.get(field))
    rows += "".join(f" {name}" for name, field in (("sorted", "SORTED_INTER"), ("chain", "CHAIN")) if c.get(field))
    return f"M{c['BLOCK_M']}{rows}; 1: {gemm(c['gemm1'])}; 2: {gemm(c['gemm2'])}"


def _row_line(r: dict) -> str:
    if "error" in r:
        return f"ERR  {r['model']:14s} {r['scheme']:10s} M={r['M']:<6d} {r['error']}"
    head = (f"{'ok  ' if r['ok'] else 'FAIL'} {r['model']:14s} {r['scheme']:10s} M={r['M']:<6d} "
            f"rel_err GEMM1 {r['gemm1_rel_err']:.1e} out {r['rel_err']:.1e}")
    times = (f" vLLM {r['vllm_us']:.1f} us, ours {r['ours_us']:.1f} us, vLLM/ours {r['ratio']:.3f}, "
             f"vLLM/floor {r['vllm_over_floor']:.2f}")
    if "ours_gemm1_us" in r:
        times += "".join(f"; GEMM{g} {r[f'vllm_gemm{g}_us']:.1f} / {r[f'ours_gemm{g}_us']:.1f} us" for g in (1, 2))
    if not r["ok"]:
        return head + f" > tol {r['tol']:.0e}: vLLM's GEMMs and ours disagree;{times} (not in the geomeans)"
    return head + times


def baseline_rows(path: str) -> tuple[str, list[dict]]:
    """--baseline's (path, rows) of an earlier side-by-side's results.json; argparse reports what is wrong."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise argparse.ArgumentTypeError(f"{path} is not a results.json of bench/vllm_triton.py (no \"rows\")") \
            from None
    needed = ("model", "scheme", "M", "ratio", "ours_config")
    for i, row in enumerate(rows):
        missing = [k for k in needed if row.get("ok") and k not in row]
        if missing:
            raise argparse.ArgumentTypeError(f"{path}: row {i} has no {', '.join(missing)}; a side-by-side's rows "
                                             f"hold {', '.join(needed)}")
    return path, rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-dir", help="folder with vLLM 0.33's fused_moe.py and configs/ (default: the installed "
                                      "vllm package, else carry/vllm033)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--schemes", nargs="+", choices=SCHEMES,
                   help="default: bf16 and fp8_tensor on every model, fp8_block on deepseek-v3 (as bench/moe.py)")
    p.add_argument("--ms", nargs="+", type=int, help="token counts (default: bench/moe.py's M_LIST)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results/vllm_triton"))
    p.add_argument("--smoke", action="store_true", help="tiny fp16 shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--rounds", type=int, default=1,
                   help="time both sides in turn this many times and keep each side's fastest")
    p.add_argument("--per-gemm", action="store_true",
                   help="also time each side's GEMM1 and GEMM2 alone (columns in results.json; about doubles the run)")
    p.add_argument("--baseline", type=baseline_rows, metavar="RESULTS_JSON",
                   help="an earlier run's results.json: adds the geomeans then and now of the points whose config "
                        "changed and of the others (their drift)")
    p.add_argument("--profile", action="store_true",
                   help="time nothing: run each side's GEMMs once inside cudaProfilerStart/Stop, for ncu "
                        "--profile-from-start off (bench/gpu_steps.sh profile_vllm)")
    args = p.parse_args(argv)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment")
    if args.profile and (args.smoke or not torch.cuda.is_available()):
        sys.exit("--profile needs a CUDA GPU (it is for ncu), not --smoke")
    try:
        side_by_side = SideBySide(args)
        ok = side_by_side.profile() if args.profile else side_by_side.run()
    except VllmNotFound as exc:
        sys.exit(f"bench/vllm_triton.py: {exc}")
    if not ok:
        print("FAIL: at the points marked FAIL (vLLM's GEMMs and ours disagree) or ERR above", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
