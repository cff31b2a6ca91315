"""Fused-MoE evidence on a GPU: ceilings, correctness of every scheme, config tuning, and timings.

    python bench/moe.py --phase all --out DIR          # on the H100 (see bench/results/README.md)
    python bench/moe.py --phase batched --out DIR      # batched vs standard Triton experts only
    python bench/moe.py --phase bench --baseline OLD/results.json --out DIR   # + each point's ratio to OLD
    TRITON_INTERPRET=1 python bench/moe.py --smoke     # tiny CPU dry run of the same code paths

Phase `batched` times `triton.batched_moe` behind `local_batched` against `triton.fused_moe` behind
`local`, same boundary and protocol (graph mode), on Mixtral and DeepSeek-V3 at BATCHED_M_LIST; the
batched layer includes its scatter into [E, M, H] (max_tokens = M) and the weighted gather back. It also
times the experts alone (Experts.apply on an input prepared outside the timed region): what a batching
dispatcher (DeepEP LL, our batched all2all) pays on top of its own communication.

Boundary for every backend (reference doc section 4): x [M, H] in in_dtype plus topk_ids /
topk_weights in, [M, H] out; routing is outside the timed region; each backend sorts, quantises
and reduces inside it. Timing: `triton.testing.do_bench` median (it flushes L2 before every
call), in CUDA-graph replay and eager. Floor (reference section 3.2):
    T_floor = max(bytes / BW, flops / P), bytes = E_hit*3*H*I*b_w + M*H*4, flops = 6*M*k*H*I,
    E_hit = E*(1 - (1 - k/E)^M), with BW and P measured in the same run.
    b_w (bytes per weight, scales included): bf16 2; fp8 1 (+ 4/128^2 for block-128 scales);
    mxfp4 0.5 + 1/32 = 0.53125 (e8m0 scale per 32); mxfp8 1 + 1/32.
    P: the bf16 MMA rate for bf16 and mxfp4 W4A16 (Hopper has no mixed-input or MX MMA: the fp4
    weights are upcast to bf16), the fp8 rate for fp8 and mxfp8 (fp8 MMA with the e8m0 scales
    applied per 32-wide K step is possible on Hopper; that is what our kernel does).
MX schemes are timed at M in MX_M_LIST by default (gpt-oss mxfp4 is memory-bound up to M~2300).
Launches: the GPU operations (kernels, memsets, copies) one eager forward enqueues, from the profiler's
device trace; 4 of them (the top-k range check's min, max and two device-to-host copies) are eager-only,
a captured graph skips them. --baseline: a results.json of an earlier run (the previous commit's, or the old code timed
in the same device session); each point gets baseline µs / this µs (> 1: faster now) and the old launches.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from moerules.activation import Activation, Dtype
from moerules.kernels import KernelBuildError, RoutingConfig, build_layer, make_random_lora, make_random_weights
from moerules.kernels.example import run_forward
from moerules.kernels.registry import EXPERTS
from moerules.kernels.routing import fused_topk
from moerules.kernels.scheme import TORCH_DTYPE, Scheme, scheme_cells
from moerules.kernels.scheme import quant_for_cell as quant_of
from moerules.kernels.triton.align import use_naive_assignment
from moerules.kernels.triton.config import (CONFIG_DIR, MAXNREG_RANGE, GemmConfig, MoEConfig, _load_file,
                                           check_config, config_file_name, default_config, dtype_key, get_config,
                                           tuned_devices)
from moerules.kernels.triton.device import device_name
from moerules.kernels.triton.launch import config_for, config_lookup, fragment_tiles, fused_moe
from moerules.quant import Granularity as G
from moerules.quant import QuantConfig
from moerules.quant import QuantFamily as F


def count_launches(fn) -> int:
    """GPU operations (kernels, memsets, copies) one call of fn enqueues, from the profiler's device trace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()  # compiles outside the trace
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == DeviceType.CUDA for e in prof.events())


def captured_graph(fn) -> "torch.cuda.CUDAGraph":
    """One call of fn captured as a CUDA graph (after a warm-up call on a side stream, as capture requires)."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    return g


def time_us(fn, *, graph: bool, rep: int = 100) -> float:
    """Median µs of fn() on the GPU (do_bench flushes L2 before every call). Graph mode captures one call and
    replays it."""
    import triton.testing
    fn()  # compile / autotune outside the timed region
    torch.cuda.synchronize()
    if graph:
        g = captured_graph(fn)
        try:
            return triton.testing.do_bench(g.replay, warmup=10, rep=rep, return_mode="median") * 1e3
        finally:
            del g
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def profiled_once(fns: list[Callable]) -> None:
    """Each of fns once between cudaProfilerStart and Stop, which is all `ncu --profile-from-start off` profiles;
    each was run once before, so compilation stays outside the profiled window. Nothing is timed."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def neighbour_entries(table: dict, M: int, *, gemv: bool) -> list[tuple[MoEConfig, str]]:
    """A tuned file's entries (`table`: M as text -> config) for the nearest M below and above M, as tuner seeds: the
    sweep moves one field at a time from where it starts, and a neighbour's tile can lie out of its reach (DeepSeek-V3
    block-128 M=1024 GEMM2 ran 1.19x faster on the M=4096 entry's 4-warp tile, 1.28x with its register cap; H200,
    bench/results/s33). GEMV entries only where the batch itself may take GEMV rows (`gemv`)."""
    entries = {int(m): MoEConfig.from_dict(c) for m, c in table.items() if int(m) != M}
    entries = {m: c for m, c in entries.items() if gemv or c.BLOCK_M != 1}
    below, above = [m for m in entries if m < M], [m for m in entries if m > M]
    return [(entries[m], f"the M={m} entry") for m in ([max(below)] if below else []) + ([min(above)] if above else [])]


def report_row(rows: list[dict], row: dict, path: Path) -> None:
    """A probe's row: appended, printed as one JSON line, and every row so far rewritten to path (a run cut short by
    the device's time limit keeps what it measured)."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    path.write_text(json.dumps(rows, indent=1))


def interleaved_us(fns: dict[str, Callable], *, rep: int = 100) -> dict[str, float]:
    """Median µs of each of fns on the GPU: one CUDA graph per fn, replayed in turn within one loop, each replay after
    an L2 flush (as do_bench); the fn that goes first rotates from turn to turn. About `rep` ms of replays per fn.

    The clock follows the power draw and drifts within a run. Timed one after the other, vLLM's two GEMMs at
    Mixtral-8x7B FP8 M=4096 read 2332 us in one H200 run and 2652 us in the next (bench/results/s33), and at M >= 4096
    on the H100 one side read up to 15% apart from itself timed later. Taken in turn, every fn meets the same drift."""
    import statistics

    import triton
    for fn in fns.values():
        fn()  # compile outside the timed region
    torch.cuda.synchronize()
    graphs = {name: captured_graph(fn) for name, fn in fns.items()}
    driver = triton.runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    names = list(graphs)

    def turns(n: int) -> dict[str, list[float]]:
        events: dict[str, list] = {name: [] for name in names}
        for i in range(n):
            for name in turn_order(names, i):
                driver.clear_cache(cache)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs[name].replay()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize()
        return {name: [s.elapsed_time(e) for s, e in pairs] for name, pairs in events.items()}

    try:
        mean_ms = statistics.fmean(statistics.median(t) for t in turns(3).values())
        n = max(5, int(rep / mean_ms))
        turns(max(1, n // 10))  # warm-up
        return {name: statistics.median(t) * 1e3 for name, t in turns(n).items()}
    finally:
        del graphs


def turn_order(names: list[str], turn: int) -> list[str]:
    """The order of `interleaved_us`'s turn number `turn`: names rotated by it, so each goes first as often."""
    return names[turn % len(names):] + names[:turn % len(names)]


def fastest_interleaved(interleaved: Callable, rounds: int, sides: dict[str, dict[str, Callable]]) -> dict[str, float]:
    """`{side}{part}_us`: the fastest of `rounds` medians of each side's parts, all parts of all sides timed in turn
    (`interleaved`: `Bench.interleaved_us`)."""
    fns = {f"{who}{part}": fn for who, parts in sides.items() for part, fn in parts.items()}
    times = [interleaved(fns) for _ in range(rounds)]
    return {f"{key}_us": min(t[key] for t in times) for key in fns}


@dataclass(frozen=True)
class Model:
    E: int
    k: int
    H: int
    I: int
    activation: Activation
    bias: bool


MODELS = {
    "mixtral-8x7b": Model(8, 2, 4096, 14336, Activation.silu, False),
    "qwen3-30b-a3b": Model(128, 8, 2048, 768, Activation.silu, False),
    "deepseek-v3": Model(256, 8, 7168, 2048, Activation.silu, False),
    "gpt-oss-120b": Model(128, 4, 2880, 2880, Activation.swigluoai, True),
}
# Named on request only (--models gpt-oss-20b), never in a default run: it is tuned for MXFP4 and measured against
# triton_kernels (bench/tk_mxfp4.py); the four above are the grid of the side-by-side with vLLM.
EXTRA_MODELS = {"gpt-oss-20b": Model(32, 4, 2880, 2880, Activation.swigluoai, True)}
SMOKE_MODELS = {"tiny": Model(8, 2, 256, 128, Activation.silu, False),
                "tiny-oss": Model(16, 4, 160, 96, Activation.swigluoai, True)}
TIMED_SCHEMES = {"bf16": QuantConfig(),
                 # vLLM's online FP8 (--quantization fp8): per-tensor weights, dynamic per-tensor activations.
                 "fp8_tensor": QuantConfig(family=F.fp8_w8a8, weight_granularity=G.tensor,
                                           activation_granularity=G.tensor),
                 "fp8_rowwise": QuantConfig(family=F.fp8_w8a8, weight_granularity=G.channel,
                                            activation_granularity=G.token),
                 "fp8_block": QuantConfig(family=F.fp8_w8a8, weight_granularity=G.block128),
                 "mxfp4": QuantConfig(family=F.mxfp4_w4a16),
                 "mxfp8": QuantConfig(family=F.mxfp8)}
# Bytes per weight element, scales included (docstring), and which MMA rate bounds the scheme.
WEIGHT_BYTES = {"bf16": 2.0, "fp8_tensor": 1.0, "fp8_rowwise": 1.0, "fp8_block": 1.0 + 4 / 128 ** 2, "mxfp4": 0.5 + 1 / 32,
                "mxfp8": 1.0 + 1 / 32}
BF16_RATE = {"bf16", "mxfp4"}
M_LIST = [1, 16, 64, 256, 1024, 4096, 16384]
REGISTERS_PER_SM = 65536  # sm_90's register file, per SM
# Correctness only (not timed): LoRA adapters (rank 16) and the non-gated relu2, on one model.
FEATURE_CASES = [("lora", "unquantized"), ("lora", "fp8_w8a16/channel"), ("relu2_no_mul", "unquantized"),
                 ("relu2_no_mul", "fp8_w8a8/block128/group128")]
FEATURE_LORA_RANK = 16
# local_batched allocates E x M rows per batch (DeepSeek-V3 at M=1024: 3.7 GB for the bf16 output alone).
BATCHED_M_LIST = [1, 16, 64, 256, 1024]
BATCHED_MODELS = ("mixtral-8x7b", "deepseek-v3", "tiny")
MX_M_LIST = [1, 16, 64, 256, 1024, 2048, 4096]
# Weight-only schemes (W4A16 included) compare like bf16; MXFP8 re-quantises its intermediate like W8A8.
TOL = {"unquantized": 1e-2, "w8a16": 1e-2, "w4a16": 1e-2, "w8a8": 3e-2, "mxfp8": 3e-2}


def tolerance(cell: str) -> float:
    return TOL[next((k for k in ("w8a16", "w4a16", "mxfp8") if k in cell), "unquantized" if cell == "unquantized"
                    else "w8a8")]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((a.float() - ref).norm() / ref.norm()).item()


def _operand_bytes(scheme: Scheme) -> tuple[float, int]:
    """Bytes per element of the weight and activation tiles the GEMMs stage in shared memory."""
    wbytes = 2.0 if scheme.weight_dtype is None else 1.0 / scheme.k_pack
    return wbytes, (1 if scheme.act_dtype is not None else 2)


class Bench:
    def __init__(self, args):
        self.args = args
        self.smoke = args.smoke
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.in_dtype = Dtype.fp16 if self.smoke else Dtype.bf16  # interpreter: bf16 tl.dot is wrong
        self.models = SMOKE_MODELS if self.smoke else {m: {**MODELS, **EXTRA_MODELS}[m] for m in args.models}
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict = {"device": self.device_name(), "torch": torch.__version__}
        self._weights_cache: dict = {}
        self.peers = None
        if getattr(args, "peer_configs", None):
            from vllm_triton import PeerConfigs  # bench/ is on sys.path: this script's own folder
            self.peers = PeerConfigs(args.peer_configs, smoke=self.smoke)

    def log(self, *a):
        print(*a, flush=True)

    def device_name(self) -> str:
        return device_name(self.device)  # "cpu" for the smoke run, as the kernels' config lookup names it

    def time_us(self, fn, *, graph: bool, rep: int = 100) -> float:
        if self.smoke:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        return time_us(fn, graph=graph, rep=rep)

    def interleaved_us(self, fns: dict[str, Callable]) -> dict[str, float]:
        if self.smoke:
            return {name: self.time_us(fn, graph=False) for name, fn in fns.items()}
        return interleaved_us(fns)

    # ---- ceilings -------------------------------------------------------------------------
    def ceilings(self):
        if self.smoke:
            self.results["ceilings"] = {"copy_TBps": 3.0, "bf16_TFLOPs": 798.0, "fp8_TFLOPs": 1350.0}
            return
        n = 1 << 30  # 2 GiB of bf16 per buffer
        a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = torch.empty_like(a)
        t = self.time_us(lambda: b.copy_(a), graph=False) * 1e-6
        copy = 2 * a.numel() * 2 / t / 1e12
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        t = self.time_us(lambda: x @ y, graph=False) * 1e-6
        bf16 = 2 * 8192 ** 3 / t / 1e12
        xf, yf = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        t = self.time_us(lambda: torch._scaled_mm(xf, yf, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                  use_fast_accum=True), graph=False) * 1e-6
        fp8 = 2 * 8192 ** 3 / t / 1e12
        self.results["ceilings"] = {"copy_TBps": copy, "bf16_TFLOPs": bf16, "fp8_TFLOPs": fp8}
        self.log(f"ceilings: copy {copy:.2f} TB/s, bf16 {bf16:.0f} TFLOP/s, fp8 {fp8:.0f} TFLOP/s")

    # ---- layers ------------------------------------------------------------------------------
    def weights(self, name: str, cell: str):
        key = (name, cell)
        if key not in self._weights_cache:
            self._weights_cache.clear()
            gc.collect()
            if not self.smoke:
                torch.cuda.empty_cache()
            m = self.models[name]
            self._weights_cache[key] = make_random_weights(
                num_experts=m.E, hidden=m.H, intermediate=m.I, quant=quant_of(cell), in_dtype=self.in_dtype,
                has_bias=m.bias, seed=0, device=self.device)
        return self._weights_cache[key]

    def layer(self, name: str, cell: str, kernel_id: str):
        """kernel_id behind `local`, or behind `local_batched` when its experts take the batched format."""
        m = self.models[name]
        fmt = EXPERTS[kernel_id].activation_format
        quant = quant_of(cell)
        return build_layer(kernel_id=kernel_id, prepare_finalize_id="local_batched" if fmt == "batched" else "local",
                           quant=quant, activation=m.activation, in_dtype=self.in_dtype, activation_format=fmt,
                           weight_block=Scheme.from_quant(quant).weight_k_block,  # as the rules set it
                           weights=self.weights(name, cell), device=self.device, routing=RoutingConfig(top_k=m.k))

    def ms(self, sname: str) -> list[int]:
        if self.smoke:
            return [1, 5, 40]
        return self.args.ms or (MX_M_LIST if sname.startswith("mx") else M_LIST)

    def inputs(self, name: str, M: int, seed: int = 1):
        m = self.models[name]
        gen = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn(M, m.H, generator=gen, device=self.device).to(TORCH_DTYPE[self.in_dtype])
        ids, w = fused_topk(torch.randn(M, m.E, generator=gen, device=self.device), top_k=m.k, renormalize=True)
        return x, ids, w

    # ---- correctness ---------------------------------------------------------------------------
    def correctness(self):
        rows = []
        cells = list(scheme_cells())
        for name in self.models:
            # Every cell on one real model (compiles dominate the cost); the timed schemes on all.
            model_cells = cells if name in ("qwen3-30b-a3b", "tiny", "tiny-oss") else \
                ["unquantized", "fp8_w8a8/channel/token", "fp8_w8a8/block128/group128"] + \
                (["mxfp4_w4a16/group32", "mxfp8/group32/group32"] if name == "gpt-oss-120b" else [])
            model_cells = [c for c in model_cells if not self.args.cells or c in self.args.cells]
            for cell in model_cells:
                for kernel_id in ("triton.fused_moe", "triton.batched_moe", "torch.grouped_mm"):
                    if kernel_id == "triton.batched_moe" and cell not in EXPERTS[kernel_id].cells:
                        continue  # INT8 / MX: refused at build by design (tests/kernels/test_batched.py)
                    try:
                        layer = self.layer(name, cell, kernel_id)
                    except KernelBuildError as exc:
                        if kernel_id.startswith("triton."):
                            rows.append({"model": name, "cell": cell, "kernel": kernel_id, "error": str(exc)})
                            self.log(f"BUILD FAIL {name} {cell} {exc}")
                        continue
                    self.check(rows, layer, name, cell)
        name = "qwen3-30b-a3b" if "qwen3-30b-a3b" in self.models else next(iter(self.models))
        for feature, cell in FEATURE_CASES:
            self.check(rows, self.feature_layer(name, cell, feature), name, cell, feature)
        self.results["correctness"] = rows
        self.save()

    def check(self, rows: list, layer, name: str, cell: str, feature: str = ""):
        """One layer at two batch sizes against the fp32 reference on the same weights (adapters included)."""
        for M in ([1, 37] if self.smoke else [1, 333]):
            self.poison()
            r = run_forward(layer, num_tokens=M, seed=M, device=self.device)
            ok = r["all_finite"] and r["rel_err_vs_reference"] <= tolerance(cell)
            rows.append({"model": name, "cell": cell, "kernel": layer.kernel_id, "feature": feature, "M": M,
                         "rel_err": r["rel_err_vs_reference"], "tol": tolerance(cell), "ok": ok})
            self.log(f"{'ok  ' if ok else 'FAIL'} {name:14s} {cell:30s} {layer.kernel_id:17s} {feature:12s} "
                     f"M={M:5d} rel_err={r['rel_err_vs_reference']:.2e} (tol {tolerance(cell):.0e})")

    def feature_layer(self, name: str, cell: str, feature: str):
        """triton.fused_moe with LoRA adapters ("lora") or with the non-gated relu2 ("relu2_no_mul")."""
        m = self.models[name]
        activation = Activation.relu2_no_mul if feature == "relu2_no_mul" else m.activation
        self._weights_cache.clear()  # these weights are not reused; free the cached ones first
        weights = make_random_weights(num_experts=m.E, hidden=m.H, intermediate=m.I, quant=quant_of(cell),
                                      in_dtype=self.in_dtype, has_bias=m.bias, seed=0, device=self.device,
                                      gated=activation.gated)
        if feature == "lora":
            weights.lora = make_random_lora(num_experts=m.E, hidden=m.H, intermediate=m.I, rank=FEATURE_LORA_RANK,
                                            in_dtype=self.in_dtype, gated=activation.gated, seed=1,
                                            device=self.device)
        return build_layer(kernel_id="triton.fused_moe", prepare_finalize_id="local", quant=quant_of(cell),
                           activation=activation, in_dtype=self.in_dtype, activation_format="standard",
                           weights=weights, device=self.device, routing=RoutingConfig(top_k=m.k))

    def poison(self):
        """Fill the allocator's free blocks with NaN, so an unwritten output element shows up."""
        if self.smoke:
            return
        free = torch.cuda.mem_get_info()[0]
        junk = torch.empty(min(free // 4, 8 << 30) // 2, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))
        del junk

    # ---- tuning --------------------------------------------------------------------------------
    # The space (docstring of `tune`): every field one step either way from the best so far, plus the values the
    # peers' best configs use (vLLM's tuned H100 files: BLOCK_N 256 over 2I, i.e. 128 per half here; GROUP_M
    # 16-64; BLOCK_M 64 at 4 warps), plus the swapped tiles for decode.
    # HALF_MMA moves only where check_config takes it (block-scaled weights), PERSISTENT only without tail tiles or
    # GEMM2 row tiles: `valid`
    FIELDS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SWAP_AB", "TMA", "MAXNREG", "HALF_MMA",
              "PERSISTENT")
    PERSISTENT = (0, 1, 2)  # programs per SM (GemmConfig.PERSISTENT)
    # swept after both GEMMs' fields (`chain_moves`, `tail_moves`, `sorted_moves`, `gemm2_rows_moves`)
    MOE_FIELDS = ("CHAIN", "TAIL_M", "SORTED_INTER", "GEMM2_BLOCK_M")
    GROUP_MS = (1, 8, 16, 32, 64)
    WARPS = (4, 8)
    STAGES = (2, 3, 4, 5)
    # One-row blocks (BLOCK_M 1, the GEMV path) are seeded where the mean rows per expert is at most one: each
    # slot then reads its expert's weights alone, which an MMA block would read once for all its rows. A GEMV
    # program holds no MMA tile, so its space reaches narrower N tiles, deeper K steps and no pipelining.
    GEMV_SEEDS = ((16, 256), (32, 128))  # (BLOCK_N, BLOCK_K) per 2-byte weight; 8-bit and fp4 weights double K
    GEMV_BLOCK_N_MIN, GEMV_BLOCK_K_MAX = 8, 1024
    # triton_kernels' MXFP4 tile on Hopper (opt_flags_nvidia.py, sglang-kernel 0.4.5): 2 * num_warps * 2 * 8 weight rows
    # on wgmma's M side (SWAP_AB; gated GEMM1: half gate, half up), the dequantised weights fed from registers,
    # 128-deep K steps; with it triton_kernels' MoE ran 1.2-1.7x faster than our tuned mma.sync tiles at M = 16-4096
    # on the H200 (bench/results/s26). With 4 warps, the same tile at half the rows. In our kernel both ran 1.03-1.80x
    # slower than the tuned tiles at every gpt-oss point (H200, bench/results/s27): each K step stores its split
    # activations for wgmma, fences and waits twice (bench/sass_count.py). Seeded all the same: the space holds the
    # peer's tile, at a few seconds per point.
    TK_MXFP4_TILES = ({"weight_rows": 256, "num_warps": 8}, {"weight_rows": 128, "num_warps": 4})
    CONFIRM_ROUNDS = 3  # the winner against the config in use, timed in turn (`tune`)
    SMEM_BYTES = 220_000  # H100/H200: 227 KB of shared memory per block, less what Triton keeps for itself

    def tune(self):
        """Per (model, scheme, M): seed with the config in use, the heuristic, BLOCK_M x{1/2, 2}, GEMV tiles (at most
        one row per expert) and, for MXFP4, triton_kernels' tiles (each seed's time is logged); then one coordinate
        sweep per GEMM over BLOCK_N, BLOCK_K (x{1/2, 2}), GROUP_M, num_warps, num_stages, SWAP_AB and TMA, keeping each
        field's best before the next, then CHAIN, TAIL_M, SORTED_INTER and GEMM2_BLOCK_M (`chain_moves`, `tail_moves`,
        `sorted_moves`, `gemm2_rows_moves`; --fields: only those, from the config in use; --seeds-only: none).
        --point-seconds ends the sweep that long after the point began (its seeds are all timed), keeping the best
        found: a device call's time cap would otherwise lose the point. A
        config replaces the one in use only if its output matches the one in use within the scheme's tolerance and it
        stays faster when the two are timed again, in turn, CONFIRM_ROUNDS times (`fastest_interleaved`): single
        timings drift at large M."""
        for name, model in self.models.items():
            for sname in self.timed_schemes(name):
                cell = Scheme.from_quant(TIMED_SCHEMES[sname]).cell
                layer = self.layer(name, cell, "triton.fused_moe")
                w = layer.weights
                table = self.existing_table(model, w.scheme)
                for M in self.ms(sname):
                    if M > 4096 and not self.smoke and not self.args.ms:
                        continue  # unless asked for: nearest-M lookup reuses the 4096 entry; saves device time
                    x, ids, tw = self.inputs(name, M)
                    prep = layer.prepare_finalize.prepare(x, topk_ids=ids, topk_weights=tw, defer_input_quant=False,
                                                          a13_scale=w.a13_scale)

                    def run(cfg):
                        return fused_moe(prep.hidden_q, a_scale=prep.a_scale, weights=w, topk_ids=ids,
                                         topk_weights=tw, activation=model.activation,
                                         quantize_intermediate=layer.experts.quantize_intermediate(w),
                                         out_dtype=TORCH_DTYPE[self.in_dtype], config=cfg)
                    t0 = time.time()
                    self.sweep_until = t0 + (math.inf if self.args.point_seconds is None else self.args.point_seconds)
                    self.untimed = 0  # the sweep's configs left when its time was up
                    seeds = self.seeds(M, model, w, sname, only_in_use=bool(self.args.fields))
                    seed_us: dict = {}
                    start = self.pick(run, list(seeds), seed_us)
                    if start is None:
                        self.log(f"not tuned {name} {sname} M={M}: no seed config ran (see the skips above)")
                        continue
                    self.log(f"  seeds {name} {sname} M={M}: " +
                             "; ".join(f"{seeds[c]} {t:.1f} us" for c, t in seed_us.items()))
                    best = start if self.args.seeds_only else self.sweep(run, start, M, model, w.scheme)
                    if self.untimed:
                        self.log(f"  the sweep's time was up (--point-seconds): {self.untimed} configs not timed")
                    in_use = config_for(w, num_tokens=M, top_k=model.k, device=self.device)
                    rejected = self.rejection(run, best, in_use, cell) if best[1] != in_use else None
                    if rejected:
                        # Pinned at its M: an entry tuned later for another M would otherwise take over here.
                        table[str(M)] = in_use.to_dict()
                        self.log(f"kept the config in use {name} {sname} M={M}: {best[1]} {rejected}")
                    else:
                        table[str(M)] = best[1].to_dict()
                        self.log(f"tuned {name} {sname} M={M}: {start[0]:.1f} us (seed: {seeds[start[1]]}) -> "
                                 f"{best[0]:.1f} us {best[1]} ({time.time() - t0:.0f} s)")
                    self.write_config(model, w.scheme, table)

    def rejection(self, run, best, in_use: MoEConfig, cell: str) -> Optional[str]:
        """Why the sweep's winner `best` (µs, config) must not replace the config in use, or None: its output
        differs beyond the scheme's tolerance, or timed again against it, in turn, it is not faster."""
        err = rel_err(run(best[1]), run(in_use))
        if not err <= tolerance(cell):  # not NaN either
            return f"gives rel err {err:.1e} against the config in use (tol {tolerance(cell):.0e})"
        sides = {"new": {"": lambda: run(best[1])}, "in_use": {"": lambda: run(in_use)}}
        again = fastest_interleaved(self.interleaved_us, self.CONFIRM_ROUNDS, sides)
        if not again["new_us"] < again["in_use_us"]:
            return (f"ran {best[0]:.1f} us in the sweep, but {again['new_us']:.1f} us against {again['in_use_us']:.1f} "
                    "us for the config in use timed in turn")
        return None

    def seeds(self, M: int, model: Model, w, sname: str, *, only_in_use: bool) -> dict:
        """{config: what it is}: the config in use, the heuristic, BLOCK_M x{1/2, 2} of the one in use, GEMV
        seeds, MXFP4's triton_kernels tiles (at their BLOCK_M and the one in use), the tuned file's entries for the
        nearest smaller and larger M (`neighbour_entries`), the entries every GPU's file gives here
        (`device_entries`) and (--peer-configs) vLLM's; a config that is several of these keeps its first name."""
        scheme = w.scheme
        cur = config_for(w, num_tokens=M, top_k=model.k, device=self.device)
        if only_in_use:
            return {cur: "in use"}
        named = [(cur, "in use"), (default_config(num_tokens=M, num_experts=model.E, top_k=model.k, scheme=scheme),
                                   "heuristic")]
        named += [(MoEConfig(bm, cur.gemm1, cur.gemm2), f"BLOCK_M {bm}") for bm in (cur.BLOCK_M // 2, cur.BLOCK_M * 2)
                  if 16 <= bm <= 128]
        if M * model.k <= model.E:
            named += [(self.gemv_config(bn, bk, scheme), f"GEMV N{bn} K{bk}") for bn, bk in self.GEMV_SEEDS]
        if scheme.is_mx and scheme.k_pack > 1:
            for tile in self.TK_MXFP4_TILES:
                tk = self.tk_mxfp4_config(M * model.k / model.E, gated=model.activation.gated, **tile)
                name = f"triton_kernels' tile, {tile['num_warps']} warps"
                named.append((tk, name))
                if cur.BLOCK_M >= 16:
                    named.append((replace(tk, BLOCK_M=cur.BLOCK_M), f"{name}, at BLOCK_M {cur.BLOCK_M}"))
        named += neighbour_entries(self.existing_table(model, scheme), M, gemv=M * model.k <= model.E)
        named += self.device_entries(w, M, model)
        peer = self.peers.at(w, sname, M, model.k) if self.peers else None
        if peer:
            named.append((peer, "vLLM's"))
        named = [(fragment_tiles(c, scheme), name) for c, name in named]
        valid = self.valid([c for c, _ in named], scheme)
        return {c: name for c, name in reversed(named) if c in valid}  # reversed: the first name wins

    def device_entries(self, w, M: int, model: Model) -> list[tuple[MoEConfig, str]]:
        """The configs every GPU's tuned file for the shape gives at this point, as seeds (this GPU's is the config in
        use, which keeps that name): the H200's entry beat the H100's at 21 of the 63 grid points on the H100, by up
        to 1.28x (bench/results/s43 b.)."""
        lookup = config_lookup(w, num_tokens=M, top_k=model.k, device=self.device)
        devices = tuned_devices(num_experts=w.num_experts, intermediate=w.intermediate,
                                dtype=dtype_key(w.scheme, w.in_dtype.value))
        return [(get_config(**lookup | {"device_name": d}), f"{d}'s entry") for d in devices]

    def tk_mxfp4_config(self, rows_per_expert: float, *, gated: bool, weight_rows: int, num_warps: int) -> MoEConfig:
        """triton_kernels' Hopper MXFP4 tile (TK_MXFP4_TILES) at its BLOCK_M for these rows per expert (opt_flags.py:
        the power of two holding twice the mean rows, 16 to 64, while they are at most 64; else the mean, up to 128)."""
        rows = 2 * rows_per_expert if rows_per_expert <= 64 else rows_per_expert
        block_m = min(max(16, 1 << (math.ceil(rows) - 1).bit_length()), 64 if rows_per_expert <= 64 else 128)
        tile = dict(BLOCK_K=128, GROUP_M=1, num_warps=num_warps, num_stages=3, SWAP_AB=True)
        return MoEConfig(BLOCK_M=block_m, gemm1=GemmConfig(BLOCK_N=weight_rows // 2 if gated else weight_rows, **tile),
                         gemm2=GemmConfig(BLOCK_N=weight_rows, **tile))

    def gemv_config(self, block_n: int, block_k: int, scheme: Scheme) -> MoEConfig:
        block_k *= 2 if _operand_bytes(scheme)[0] < 2 else 1
        if scheme.weight_granularity == G.block128:
            block_k = min(block_k, 128)  # one scale block per K step (check_config)
        g = GemmConfig(BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1, num_warps=4, num_stages=2)
        return MoEConfig(BLOCK_M=1, gemm1=g, gemm2=g)

    def sweep(self, run, best, M: int, model: Model, scheme: Scheme):
        """One pass over the fields of gemm1, then of gemm2, then CHAIN, TAIL_M, SORTED_INTER and GEMM2_BLOCK_M; `best`
        is (µs, MoEConfig)."""
        m_blocks = min(model.E, M * model.k) + M * model.k // best[1].BLOCK_M  # upper bound of the row blocks
        fields = self.args.fields or self.FIELDS + self.MOE_FIELDS
        for which in ("gemm1", "gemm2"):
            for field in (f for f in fields if f in self.FIELDS):
                moves = self.moves(getattr(best[1], which), field, m_blocks, gemv=best[1].BLOCK_M == 1)
                best = self.faster(run, best, [replace(best[1], **{which: g}) for g in moves], scheme)
        if "CHAIN" in fields:
            best = self.faster(run, best, self.chain_moves(best[1], M, model, scheme), scheme)
        if "TAIL_M" in fields:
            best = self.faster(run, best, self.tail_moves(best[1], M, model), scheme)
        if "SORTED_INTER" in fields:
            best = self.faster(run, best, self.sorted_moves(best[1], M, model), scheme)
        if "GEMM2_BLOCK_M" in fields:
            best = self.faster(run, best, self.gemm2_rows_moves(best[1], M, model), scheme)
        return best

    @staticmethod
    def gemm2_rows_moves(cfg: MoEConfig, M: int, model: Model) -> list[MoEConfig]:
        """cfg with GEMM2 on each other row tile (MoEConfig.GEMM2_BLOCK_M: BLOCK_M, or a half or a quarter of it, at
        least 16 rows), without tail tiles longer than those (check_config), where the batch is sorted into runs and
        unchained."""
        if cfg.CHAIN or cfg.BLOCK_M < 32 or use_naive_assignment(M * model.k, model.E):
            return []
        rows = [r for r in (0, cfg.BLOCK_M // 2, cfg.BLOCK_M // 4) if r == 0 or r >= 16]
        return [replace(cfg, GEMM2_BLOCK_M=r, TAIL_M=cfg.TAIL_M if cfg.TAIL_M <= r or not r else 0)
                for r in rows if r != cfg.GEMM2_BLOCK_M]

    @staticmethod
    def sorted_moves(cfg: MoEConfig, M: int, model: Model) -> list[MoEConfig]:
        """cfg with the intermediate's layout flipped (MoEConfig.SORTED_INTER), a sorted one with GEMM2's A tiles
        read by address and by TMA, where the batch is sorted into runs (not the naive assignment); `valid` drops
        what the scheme or the tiles refuse (GEMV rows, chaining, intermediates scaled per row)."""
        if use_naive_assignment(M * model.k, model.E):
            return []
        if cfg.SORTED_INTER:
            return [replace(cfg, SORTED_INTER=False)]
        return [replace(cfg, SORTED_INTER=True, gemm2=replace(cfg.gemm2, TMA=tma)) for tma in (False, True)]

    @staticmethod
    def tail_moves(cfg: MoEConfig, M: int, model: Model) -> list[MoEConfig]:
        """cfg with each other tail tile (MoEConfig.TAIL_M: none, or 16 to 64 rows below BLOCK_M) where the batch is
        sorted into runs (not the naive assignment, not chained). On the H200, 32-row tails ran the GEMMs 1.03-1.08x
        faster at M=4096 for DeepSeek-V3 and gpt-oss-120b (bench/results/s41)."""
        if cfg.CHAIN or cfg.BLOCK_M < 32 or use_naive_assignment(M * model.k, model.E):
            return []
        return [replace(cfg, TAIL_M=t) for t in (0, 16, 32, 64) if t != cfg.TAIL_M and t < cfg.BLOCK_M]

    def faster(self, run, best, cfgs, scheme: Scheme):
        """The fastest of `best` (µs, config) and the valid cfgs timed before the sweep's time is up."""
        found = self.pick(run, self.valid(cfgs, scheme), until=self.sweep_until)
        return found if found and found[0] < best[0] else best

    def chain_moves(self, cfg: MoEConfig, M: int, model: Model, scheme: Scheme) -> list[MoEConfig]:
        """A chained cfg unchained; else cfg chained (MoEConfig.CHAIN) as one launch runs it (gemm2 on gemm1's warps
        and register cap, both GEMMs loading by address), with gemm2 as wide, half and twice as wide: where the batch
        takes the naive assignment and GEMM2 reads the intermediate unquantised. On the H200 chaining lost at every
        M=1 point and won 1.11x at Qwen3-30B-A3B bf16 M=4 with gemm2 twice as wide (bench/results/s39)."""
        if cfg.CHAIN:
            return [replace(cfg, CHAIN=False)]
        if not use_naive_assignment(M * model.k, model.E) or scheme.quantizes_activations:
            return []
        g1 = replace(cfg.gemm1, TMA=False)
        g2 = replace(cfg.gemm2, TMA=False, num_warps=g1.num_warps, MAXNREG=g1.MAXNREG)
        narrowest = self.GEMV_BLOCK_N_MIN if cfg.BLOCK_M == 1 else 16
        widths = [g2.BLOCK_N] + [n for n in (g2.BLOCK_N // 2, g2.BLOCK_N * 2) if narrowest <= n <= 256]
        return [replace(cfg, gemm1=g1, gemm2=replace(g2, BLOCK_N=n), CHAIN=True) for n in widths]

    def moves(self, g: GemmConfig, field: str, m_blocks: int, *, gemv: bool) -> list[GemmConfig]:
        """g with `field` moved to each of its values; a BLOCK_N move also comes with num_warps moved in step (the
        columns per warp kept), since one field at a time cannot reach it: a wider tile at the same warps holds a
        wider accumulator per thread (gpt-oss-20b M=256, MXFP4 GEMM1 at 32x128x32: 144 registers at 4 warps, 113 at
        8; bench/results/s26)."""
        values = (self.register_caps(g) if field == "MAXNREG"
                  else self.field_values(field, getattr(g, field), m_blocks, gemv=gemv))
        moved = [replace(g, **{field: v}) for v in values]
        if field == "BLOCK_N" and not gemv:
            moved += [replace(m, num_warps=g.num_warps * m.BLOCK_N // g.BLOCK_N) for m in moved
                      if g.num_warps * m.BLOCK_N // g.BLOCK_N in self.WARPS]
        return moved

    @staticmethod
    def register_caps(g: GemmConfig) -> list:
        """MAXNREG values other than g's: none, or the most registers per thread at which 2, 3 or 4 programs of g's
        warps fit an SM's 65536 (DeepSeek-V3 block-128 M=4096: 212 registers, two 4-warp programs; capped at 168,
        three, and the GEMMs 1.05-1.07x faster on the H200, bench/results/s33)."""
        per_program = [REGISTERS_PER_SM // (32 * g.num_warps * programs) // 8 * 8 for programs in (2, 3, 4)]
        caps = [None] + [c for c in per_program if MAXNREG_RANGE[0] <= c <= MAXNREG_RANGE[1]]
        return [c for c in caps if c != g.MAXNREG]

    def field_values(self, field: str, cur, m_blocks: int, *, gemv: bool) -> list:
        if field == "BLOCK_N":
            return [v for v in (cur // 2, cur * 2) if (self.GEMV_BLOCK_N_MIN if gemv else 16) <= v <= 256]
        if field == "BLOCK_K":
            return [v for v in (cur // 2, cur * 2) if 16 <= v <= (self.GEMV_BLOCK_K_MAX if gemv else 256)]
        if field == "GROUP_M":  # only matters with several row blocks per column sweep
            return [v for v in self.GROUP_MS if v != cur and v < m_blocks]
        if field == "num_warps":
            return [v for v in self.WARPS if v != cur]
        if field == "num_stages":
            return [v for v in ((1,) if gemv else ()) + self.STAGES if v != cur]
        if field == "PERSISTENT":
            return [v for v in self.PERSISTENT if v != cur]
        return [not cur]  # SWAP_AB, TMA, HALF_MMA

    def valid(self, cfgs, scheme: Scheme) -> list:
        """Configs the kernels accept (check_config) whose pipelined tiles fit in shared memory, each as the GEMMs
        run it (`fragment_tiles`): what is timed is what is recorded, and two configs that run alike are one."""
        wbytes, abytes = _operand_bytes(scheme)
        ok = []
        for c in (fragment_tiles(c, scheme) for c in cfgs):
            try:
                check_config(c, scheme)
            except ValueError:
                continue
            fits = all(g.num_stages * g.BLOCK_K * (c.BLOCK_M * abytes + n_b * g.BLOCK_N * wbytes) <= self.SMEM_BYTES
                       for g, n_b in ((c.gemm1, 2), (c.gemm2, 1)))  # GEMM1 stages the gate and the up tile
            if fits and c not in ok:
                ok.append(c)
        return ok[:1] if self.smoke else ok

    def existing_table(self, model: Model, scheme: Scheme) -> dict:
        key = config_file_name(num_experts=model.E, intermediate=model.I, device_name=self.device_name(),
                               dtype=dtype_key(scheme, self.in_dtype.value))
        path = CONFIG_DIR / key
        return json.loads(path.read_text()) if path.is_file() else {}

    def write_config(self, model: Model, scheme: Scheme, table: dict):
        """After every M, so a run cut short keeps what it tuned; also into the package when --install-configs."""
        key = config_file_name(num_experts=model.E, intermediate=model.I, device_name=self.device_name(),
                               dtype=dtype_key(scheme, self.in_dtype.value))
        self.results.setdefault("tuned_files", {})[key] = table
        self.save()
        if self.args.install_configs:
            CONFIG_DIR.mkdir(exist_ok=True)
            (CONFIG_DIR / key).write_text(json.dumps(table, indent=1) + "\n")
            _load_file.cache_clear()

    def pick(self, run, cfgs, times: Optional[dict] = None, until: float = math.inf):
        """The fastest (µs, config) of cfgs, or None if none ran; `times` collects every config's µs. Configs left
        when time.time() passes `until` are not timed."""
        best = None
        for i, cfg in enumerate(cfgs):
            if time.time() > until:
                self.untimed += len(cfgs) - i
                break
            try:
                t = self.time_us(lambda: run(cfg), graph=True, rep=20)
            except Exception as exc:  # out of shared memory etc.: a config the GPU cannot run
                self.log(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            if times is not None:
                times[cfg] = t
            if best is None or t < best[0]:
                best = (t, cfg)
        return best

    def timed_schemes(self, name: str):
        names = ["bf16", "fp8_tensor", "fp8_rowwise"] + (["fp8_block"] if name in ("deepseek-v3", "tiny") else []) + \
            (["mxfp4", "mxfp8"] if self.models[name].activation is Activation.swigluoai else [])  # the gpt-oss family
        return [n for n in names if not self.args.schemes or n in self.args.schemes]

    # ---- timing --------------------------------------------------------------------------------
    def floor_us(self, model: Model, M: int, sname: str) -> tuple[float, float, float]:
        c = self.results["ceilings"]
        b_w = WEIGHT_BYTES[sname]
        e_hit = model.E * (1 - (1 - model.k / model.E) ** M)
        nbytes = e_hit * 3 * model.H * model.I * b_w + M * model.H * 4
        flops = 6 * M * model.k * model.H * model.I
        peak = c["bf16_TFLOPs"] if sname in BF16_RATE else c["fp8_TFLOPs"]
        return max(nbytes / (c["copy_TBps"] * 1e12), flops / (peak * 1e12)) * 1e6, nbytes, flops

    def baseline(self) -> dict:
        """(model, scheme, M) -> the row of --baseline's results.json (empty without one)."""
        if not self.args.baseline:
            return {}
        rows = json.loads(Path(self.args.baseline).read_text())["bench"]
        return {(r["model"], r["scheme"], r["M"]): r for r in rows}

    def bench(self):
        rows = []
        baseline = self.baseline()
        for name, model in self.models.items():
            for sname in self.timed_schemes(name):
                cell = Scheme.from_quant(TIMED_SCHEMES[sname]).cell
                layers = {"triton": self.layer(name, cell, "triton.fused_moe")}
                try:
                    layers["grouped_mm"] = self.layer(name, cell, "torch.grouped_mm")
                except KernelBuildError as exc:
                    self.log(f"no grouped_mm baseline for {name} {sname}: {exc.reason}")
                for M in self.ms(sname):
                    x, ids, tw = self.inputs(name, M)
                    floor, nbytes, flops = self.floor_us(model, M, sname)
                    row = {"model": name, "scheme": sname, "M": M, "floor_us": floor}
                    for lname, layer in layers.items():
                        fn = lambda: layer(x, topk_ids=ids, topk_weights=tw)  # noqa: E731
                        for mode in ("graph", "eager"):
                            if mode == "eager" and M < 1024 and self.args.fast:
                                continue
                            try:
                                t = self.time_us(fn, graph=mode == "graph")
                            except torch.OutOfMemoryError:
                                self.log(f"OOM {name} {sname} {lname} M={M} {mode}")
                                continue
                            row[f"{lname}_{mode}_us"] = t
                        if not self.smoke:
                            row[f"{lname}_launches"] = count_launches(fn)
                        gc.collect()
                        if not self.smoke:
                            torch.cuda.empty_cache()
                    t = row.get("triton_graph_us")
                    if t:
                        row.update(triton_pct_floor=100 * floor / t, triton_TBps=nbytes / t / 1e6,
                                   triton_TFLOPs=flops / t / 1e6)
                    if t and row.get("grouped_mm_graph_us"):
                        row["speedup_vs_grouped_mm"] = row["grouped_mm_graph_us"] / t
                        row["grouped_mm_pct_floor"] = 100 * floor / row["grouped_mm_graph_us"]
                    old = baseline.get((name, sname, M), {})
                    if t and old.get("triton_graph_us"):
                        row["vs_baseline"] = old["triton_graph_us"] / t
                    if "triton_launches" in old:
                        row["baseline_launches"] = old["triton_launches"]
                    rows.append(row)
                    self.log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
                    self.results["bench"] = rows
                    self.save()
        self.write_tables(rows)

    def batched(self):
        """triton.batched_moe (behind local_batched) vs triton.fused_moe (behind local): graph-mode µs and ratio."""
        rows = []
        ms = self.ms if self.smoke else [m for m in self.args.ms if m in BATCHED_M_LIST] or BATCHED_M_LIST
        for name in [n for n in self.models if n in BATCHED_MODELS]:
            for sname in self.timed_schemes(name):
                cell = Scheme.from_quant(TIMED_SCHEMES[sname]).cell
                layers = {k: self.layer(name, cell, f"triton.{k}_moe") for k in ("fused", "batched")}
                for M in ms:
                    x, ids, tw = self.inputs(name, M)
                    row = {"model": name, "scheme": sname, "M": M}
                    for lname, layer in layers.items():
                        try:
                            row[f"{lname}_graph_us"] = self.time_us(
                                lambda: layer(x, topk_ids=ids, topk_weights=tw), graph=True)
                            row[f"{lname}_experts_us"] = self.time_us(self.experts_call(layer, x, ids, tw), graph=True)
                        except torch.OutOfMemoryError:
                            self.log(f"OOM {name} {sname} {lname} M={M}")
                        gc.collect()
                        if not self.smoke:
                            torch.cuda.empty_cache()
                    for what in ("graph", "experts"):
                        if f"fused_{what}_us" in row and f"batched_{what}_us" in row:
                            row[f"{what}_ratio"] = row[f"batched_{what}_us"] / row[f"fused_{what}_us"]
                    rows.append(row)
                    self.log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
                    self.results["batched"] = rows
                    self.save()
        cols = ("fused_graph_us", "batched_graph_us", "graph_ratio", "fused_experts_us", "batched_experts_us",
                "experts_ratio")
        lines = ["| model | scheme | M | layer: fused µs | batched µs | batched / fused | experts only: fused µs "
                 "| batched µs | batched / fused |", "|" + "---|" * 9]
        for r in rows:
            cells = [format(r.get(c, float("nan")), ".2f" if "ratio" in c else ".1f") for c in cols]
            lines.append(f"| {r['model']} | {r['scheme']} | {r['M']} | " + " | ".join(cells) + " |")
        (self.out / "batched.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)

    @staticmethod
    def experts_call(layer, x, ids, tw):
        """The experts of `layer` alone, on an input prepared once outside the timed region."""
        p = layer.prepare_finalize.prepare(x, topk_ids=ids, topk_weights=tw, defer_input_quant=False,
                                           a13_scale=layer.weights.a13_scale)
        counts = {} if p.expert_num_tokens is None else {"expert_num_tokens": p.expert_num_tokens}
        return lambda: layer.experts.apply(p.hidden_q, weights=layer.weights, topk_ids=p.topk_ids,
                                           topk_weights=p.topk_weights, a_scale=p.a_scale, **counts)

    def write_tables(self, rows):
        keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("model", "scheme", "M"), k))
        with open(self.out / "bench.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        lines = ["| model | scheme | M | floor µs | triton graph µs | % floor | launches | vs baseline | TB/s | TFLOP/s "
                 "| triton eager µs | grouped_mm graph µs | gmm % floor | triton speedup |", "|" + "---|" * 14]

        def f(r, k, fmt):
            return format(r[k], fmt) if k in r else "–"

        def launches(r):
            """This run's launches, and the baseline's where it counted them and they differ."""
            now, old = r.get("triton_launches", "–"), r.get("baseline_launches", "–")
            return f"{now} (was {old})" if old not in ("–", now) else str(now)
        for r in rows:
            lines.append(f"| {r['model']} | {r['scheme']} | {r['M']} | {r['floor_us']:.1f} | "
                         f"{f(r, 'triton_graph_us', '.1f')} | {f(r, 'triton_pct_floor', '.0f')} | "
                         f"{launches(r)} | {f(r, 'vs_baseline', '.2f')} | {f(r, 'triton_TBps', '.2f')} | {f(r, 'triton_TFLOPs', '.0f')} | "
                         f"{f(r, 'triton_eager_us', '.1f')} | {f(r, 'grouped_mm_graph_us', '.1f')} | "
                         f"{f(r, 'grouped_mm_pct_floor', '.0f')} | {f(r, 'speedup_vs_grouped_mm', '.2f')} |")
        (self.out / "bench.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)

    def save(self):
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", default="all", choices=["all", "correctness", "tune", "bench", "batched"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS) + list(EXTRA_MODELS))
    p.add_argument("--ms", nargs="+", type=int,
                   help=f"token counts (default {M_LIST}; MX schemes {MX_M_LIST})")
    p.add_argument("--cells", nargs="+", help="correctness: only these scheme cells (e.g. mxfp4_w4a16/group32)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--fast", action="store_true", help="eager timings only for M >= 1024")
    p.add_argument("--install-configs", action="store_true", help="tune: also write into kernels/configs/")
    p.add_argument("--schemes", nargs="+", choices=list(TIMED_SCHEMES), help="tune/bench only these schemes")
    p.add_argument("--peer-configs", metavar="VLLM_DIR",
                   help="tune: also seed with vLLM 0.33's config at each point (its fused_moe.py + configs/, as "
                        "bench/get_vllm_triton.sh puts them in carry/vllm033), translated to our tiles")
    p.add_argument("--fields", nargs="+", choices=Bench.FIELDS + Bench.MOE_FIELDS,
                   help="tune: sweep only these GemmConfig fields (and CHAIN), from the config in use (no other "
                        "seeds)")
    p.add_argument("--point-seconds", type=float,
                   help="tune: end each point's sweep this many seconds after the point began, keeping the best so far")
    p.add_argument("--seeds-only", action="store_true",
                   help="tune: keep the fastest seed (checked and confirmed as any winner), without the sweep")
    p.add_argument("--baseline", help="bench: an earlier results.json; adds each point's time ratio to it")
    args = p.parse_args(argv)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment")
    b = Bench(args)
    b.ceilings()
    if args.phase in ("all", "correctness"):
        b.correctness()
    if args.phase in ("all", "tune"):
        b.tune()
    if args.phase in ("all", "bench"):
        b.bench()
    if args.phase in ("all", "batched"):
        b.batched()
    b.save()


if __name__ == "__main__":
    main()
