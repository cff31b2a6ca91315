"""Static instruction counts of the fused-MoE GEMMs, compiled for sm_90 on a machine without a GPU.

    python bench/sass_count.py --models gpt-oss-120b --schemes mxfp4 --ms 16 256 4096 [--device-name "NVIDIA H200"]
    python bench/sass_count.py ... --config '{"BLOCK_M": 16, "gemm1": {...}, "gemm2": {...}}'   # a config to try
    python bench/sass_count.py ... --tma   # the configs with TMA weight copies in both GEMMs
    PYTHONPATH=carry/base python bench/sass_count.py ...   # an older tree (`git archive`, as gpu_steps compare)
    python bench/sass_count.py ... --triton-kernels carry/triton_kernels   # also triton_kernels' MXFP4 GEMMs

Each point runs the real launcher (`triton.launch.fused_moe`, on empty tensors of the model's shapes, with the
config the tuned file of --device-name gives, or --config) with its two GEMM launches captured instead of run, so
the arguments and Triton's specialisations (ints equal to 1 become constants, multiples of 16 get divisibility
hints) are those a GPU run would compile; the alignment kernel is replaced by its shapes. Each launch is then
compiled for sm_90 with the ptxas of the triton wheel and disassembled. Printed per GEMM: the config, the main
loop (the longest backward branch of the SASS: the K loop), its instructions per weight per thread, registers
(occupancy), shared memory, the MMA instruction, the loop's memory instructions and what it waits on
(results.json also counts the loop's opcodes).
With --triton-kernels, each MXFP4 point also gets triton_kernels' two GEMMs, captured from its own launcher as
bench/tk_mxfp4.py calls it (vLLM 0.33's calls), with the device queries answered as an H200's and routing stand-ins
of the real dtypes and shapes. The counts match ncu's (gpt-oss-20b M=256: the 64x256x128 tile at 173 and 175
registers). There, per K step of 128: 3.66 instructions per weight against our 5.2-5.8, the packed weights read by
4 LDS.128 (our kernel at that tile: 32 LDS.U16), nothing stored, 2 barriers and a wgmma wait per 16 of K
(bench/results/s27).

It times nothing: GPU time is scarce (30 minutes a session). It tells, before a device run, whether a change
cuts the instructions a decode-bound kernel issues and what it costs in registers. Session 26 found that a 20%
cut (MXFP4 GEMM1 at 16x32x64: 183 -> 146 SASS per K step) did not make the kernel faster on the H200
(bench/results/s26): read these counts next to a timing, never instead of one.
Schemes: bf16, fp8_tensor, fp8_block, mxfp4 and mxfp8 (quantised GEMM inputs stand in uninitialised, as the
quantisers would hand them over).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import types
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

import tk_mxfp4
from moe import EXTRA_MODELS, MODELS, TIMED_SCHEMES
from moerules.activation import Dtype, SwigluParams
from moerules.kernels import fp4_fragments
from moerules.kernels.activations import is_interleaved
from moerules.kernels.scheme import Scheme
from moerules.kernels.triton import launch
from moerules.kernels.triton.align import Alignment, max_blocks, use_naive_assignment
from moerules.kernels.triton.config import MoEConfig, get_config
from moerules.kernels.weights import MoEWeights
from moerules.quant import Granularity as G

SM90 = GPUTarget("cuda", 90, 32)
SCHEMES = ("bf16", "fp8_tensor", "fp8_block", "mxfp4", "mxfp8")
_POINTER = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
            torch.float8_e4m3fn: "fp8e4nv",
            torch.int32: "i32", torch.int64: "i64"}
_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
_MEMORY_OPS = ("LDG", "LDS", "STS", "LDSM", "STSM", "LDL", "STL")
# What a K step waits on: barriers, wgmma completions, the fences before wgmma reads a freshly stored tile.
_SYNC_OPS = ("BAR", "WARPGROUP.DEPBAR", "MEMBAR", "FENCE")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;]*);")


@dataclass
class Launch:
    kernel: Any                 # the JITFunction
    kwargs: dict                # every argument, by name


class _Captured(Exception):
    """Raised by a stopping _Capture, so that a launcher goes no further (triton_kernels' GEMM2 would reduce next)."""


class _Capture:
    """Stands for a JITFunction: `kernel[grid](...)` records the launch in `launches` instead of running it; with
    `stop`, it then raises _Captured."""

    def __init__(self, kernel, launches: list[Launch], *, stop: bool = False):
        self.kernel, self.launches, self.stop = kernel, launches, stop

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append(Launch(self.kernel, dict(zip(self.kernel.arg_names, args)) | kwargs))
            if self.stop:
                raise _Captured

        return record


def empty_weights(model, scheme_name: str) -> MoEWeights:
    """Uninitialised weights and scales of the model's shapes (MX scales 1, so the folded decode compiles, as for
    every real checkpoint), MXFP4 flagged in the fragment order our Triton experts build (the bytes need no rewrite:
    nothing reads them)."""
    scheme = Scheme.from_quant(TIMED_SCHEMES[scheme_name])
    E, H, I, pack = model.E, model.H, model.I, scheme.k_pack
    storage = scheme.weight_torch_dtype or torch.bfloat16
    w = dict(w13=torch.empty(E, 2 * I, H // pack, dtype=storage), w2=torch.empty(E, H, I // pack, dtype=storage))
    if scheme.is_mx:
        w.update(w13_scale=torch.full((E, 2 * I, H // 32), 127, dtype=torch.uint8),
                 w2_scale=torch.full((E, H, I // 32), 127, dtype=torch.uint8))
    elif scheme.weight_granularity is not None:
        def scale(n, k):
            return {G.tensor: (E,), G.channel: (E, n), G.block128: (E, -(-n // 128), -(-k // 128))}[
                scheme.weight_granularity]
        w.update(w13_scale=torch.empty(scale(2 * I, H)), w2_scale=torch.empty(scale(H, I)))
    if model.bias:
        w.update(w13_bias=torch.empty(E, 2 * I, dtype=torch.bfloat16), w2_bias=torch.empty(E, H, dtype=torch.bfloat16))
    pairs = model.activation.gated and is_interleaved(model.activation)
    order = (fp4_fragments.PAIRS if pairs else fp4_fragments.ROWS) if scheme.k_pack == 2 else None
    return MoEWeights(scheme=scheme, in_dtype=Dtype.bf16, **w, fp4_fragment_order=order)


def _gemm_input(x: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(a GEMM input, its scale) as the scheme's quantiser would hand them over, uninitialised (nothing runs)."""
    if scheme.act_torch_dtype is None:
        return x, None
    T, K = x.shape
    granularity = scheme.act_granularity
    shape = {G.tensor: (1,), G.token: (T,), G.group128: (T, K // 128), G.group32: (T, K // 32)}[granularity]
    scale = torch.empty(shape, dtype=torch.uint8 if granularity == G.group32 else torch.float32)
    return torch.empty(x.shape, dtype=scheme.act_torch_dtype), scale


def captured_launches(model, weights: MoEWeights, M: int, config: MoEConfig) -> list[Launch]:
    """The GEMM launches `fused_moe` makes for M tokens, captured (nothing runs)."""
    launches: list[Launch] = []

    def alignment(topk_ids, *, num_experts, block_m, tail_m=0):
        if use_naive_assignment(topk_ids.numel(), num_experts):  # as moe_align: the GEMMs read the top-k ids
            return Alignment(sorted_ids=None, expert_ids=topk_ids.reshape(-1), num_post_padded=None, block_m=block_m)
        tiles = max_blocks(topk_ids.numel(), num_experts, block_m)
        rows, i32 = tail_m or block_m, dict(dtype=torch.int32)
        return Alignment(sorted_ids=torch.empty(tiles * block_m, **i32),
                         expert_ids=torch.empty(tiles * block_m // rows, **i32), num_post_padded=torch.empty(1, **i32),
                         block_m=block_m, tail_m=tail_m, tiles=torch.empty(tiles, **i32) if tail_m else None)

    saved = (launch.moe_align, launch.gemm1_gated_kernel, launch.gemm2_weighted_kernel, launch.dequantize_mx,
             launch.topk_sum)
    launch.moe_align, launch.topk_sum = alignment, lambda slots, top_k, **_: slots[::top_k]
    launch.gemm1_gated_kernel, launch.gemm2_weighted_kernel = _Capture(saved[1], launches), _Capture(saved[2], launches)
    launch.dequantize_mx = lambda q, scale, dtype: torch.empty(q.shape, dtype=dtype)
    x, a_scale = _gemm_input(torch.empty(M, model.H, dtype=torch.bfloat16), weights.scheme)
    try:
        launch.fused_moe(x, a_scale=a_scale, weights=weights, topk_ids=torch.zeros(M, model.k, dtype=torch.int32),
                         topk_weights=torch.empty(M, model.k), activation=model.activation,
                         quantize_intermediate=lambda t, _: _gemm_input(t, weights.scheme),
                         out_dtype=torch.bfloat16, config=config, swiglu=SwigluParams())
    finally:
        (launch.moe_align, launch.gemm1_gated_kernel, launch.gemm2_weighted_kernel, launch.dequantize_mx,
         launch.topk_sum) = saved
    return launches


# ---- triton_kernels' GEMMs (--triton-kernels) ---------------------------------------------------------------------
_H200 = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=232_448)


class _Sm90Driver:
    """What triton.language.target_info asks the active driver while triton_kernels' launcher runs."""

    def get_current_target(self):
        return SM90


@contextlib.contextmanager
def _as_h200():
    """triton_kernels' launcher asks the GPU for its capability, SMs and shared memory (opt_flags*.py) and Triton for
    the current target: answered as an H200 would, while the launches are captured."""
    saved = torch.cuda.get_device_properties, torch.cuda.get_device_capability
    # The driver set before, if any: `driver.active` would create the default one, which needs a GPU.
    saved_driver = driver._active
    torch.cuda.get_device_properties, torch.cuda.get_device_capability = lambda *a, **k: _H200, lambda *a, **k: (9, 0)
    driver.set_active(_Sm90Driver())
    try:
        yield
    finally:
        torch.cuda.get_device_properties, torch.cuda.get_device_capability = saved
        driver.set_active(saved_driver)


def stand_in_routing(ogs, model, M: int) -> tk_mxfp4.TkRouting:
    """Routing structures of the real dtypes and shapes, each expert given the mean rows: building real ones runs
    triton_kernels' own kernels, and only dtypes, shapes and divisibility reach the compiled GEMMs."""
    from triton_kernels.tensor_details.ragged_tensor import RaggedTensorMetadata
    rows, per_expert = M * model.k, M * model.k // model.E
    i32 = dict(dtype=torch.int32)
    ragged = RaggedTensorMetadata(
        slice_sizes=torch.full((model.E,), per_expert, **i32), slice_offs=torch.zeros(model.E + 1, **i32),
        block_offs_data=torch.zeros(len(RaggedTensorMetadata.block_sizes()), model.E + 1, **i32),
        block_schedule_data=torch.zeros(len(RaggedTensorMetadata.block_sizes()),
                                        RaggedTensorMetadata.max_n_tiles(model.E, rows), **i32))
    data = ogs.RoutingData(torch.zeros(rows), ragged.slice_sizes, model.E, model.k, ragged)
    order = torch.arange(rows, **i32)
    return tk_mxfp4.TkRouting(data=data, gather=ogs.GatherIndx(order, order), scatter=ogs.ScatterIndx(order, order))


def peer_launches(tk_dir: Path, model, M: int) -> list[Launch]:
    """triton_kernels' two matmul_ogs launches for M tokens of the model, made as bench/tk_mxfp4.py makes them (vLLM
    0.33's calls, Hopper layouts), captured: nothing runs."""
    tk = tk_mxfp4.load_triton_kernels(tk_dir)
    from triton_kernels import matmul_ogs as ogs
    launches: list[Launch] = []

    def specialized(**closures):
        kernels = real_get(**closures)
        return types.SimpleNamespace(**{name: _Capture(getattr(kernels, name), launches, stop=True)
                                        for name in ("_matmul_ogs", "_p_matmul_ogs")})

    real_get, ogs.specializations.get = ogs.specializations.get, specialized
    try:
        with _as_h200():
            weights = tk_mxfp4.to_tk_weights(tk, empty_weights(model, "mxfp4"), layouts=tk_mxfp4.hopper_layouts(tk))
            moe = tk_mxfp4.TkMoE(tk, weights, SwigluParams())
            routing = stand_in_routing(ogs, model, M)
            x = torch.empty(M, model.H, dtype=torch.bfloat16)
            inter = torch.empty(M * model.k, model.I, dtype=torch.bfloat16)
            for gemm, args in ((moe.gemm1, (x, routing, inter)), (moe.gemm2, (inter, routing, x))):
                with contextlib.suppress(_Captured):
                    gemm(*args)
    finally:
        ogs.specializations.get = real_get
    return launches


def compile_sm90(item: Launch):
    """The launch compiled as a GPU run would compile it, for sm_90."""
    kernel, kwargs = item.kernel, dict(item.kwargs)
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages", "maxnreg") if name in kwargs}
    # What the launchers turn on for a CUDA device only (pdl.pdl_kwargs, device.ptx_math), off in this CPU capture.
    kwargs.update({flag: True for flag in ("PDL", "PTX_MATH") if flag in kernel.arg_names})
    kwargs.pop("launch_pdl", None)
    signature, constants, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = kwargs.get(name, param.default)
        if param.is_constexpr or value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                   and value == 1):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, TensorDescriptor):
            signature[name] = f"tensordesc<{_POINTER[value.base.dtype]}{list(value.block_shape)}>"
        elif isinstance(value, torch.Tensor) or hasattr(value, "storage"):  # triton_kernels' Tensor: its storage
            dtype = value.dtype if isinstance(value, torch.Tensor) else value.storage.data.dtype
            signature[name] = "*" + _POINTER[dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=attrs), target=SM90,
                          options=options)


def main_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop (a branch back to an earlier address) of the disassembly. A span holding an EXIT
    is no loop: with TMA copies, ptxas places the mbarrier wait's retry after the kernel's end and branches back
    from there into the K loop."""
    code = [(int(addr, 16), op, text) for addr, text, op in _INSTRUCTION.findall(sass)]
    best: list[str] = []
    for addr, op, text in code:
        target = re.search(r"BRA\S*\s+(?:`\()?(0x[0-9a-f]+)", text) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= addr]
            if "EXIT" not in body:
                best = max(best, body, key=len)
    return best


def disassemble(compiled, workdir: Path) -> tuple[str, int, int]:
    """(SASS text, registers per thread, stack bytes per thread: spilled registers live there) of a kernel."""
    cubin = workdir / f"{compiled.name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(_CUOBJDUMP), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([str(_CUOBJDUMP), "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def count(item: Launch, workdir: Path) -> dict:
    """One GEMM launch's static counts."""
    compiled = compile_sm90(item)
    sass, registers, stack = disassemble(compiled, workdir)
    loop = main_loop(sass)
    k = item.kwargs
    rows = 2 * k["BLOCK_N"] if k.get("GATED") else k["BLOCK_N"]
    weights_per_thread = rows * k["BLOCK_K"] / (32 * k["num_warps"])
    ops = Counter(loop)
    mma = sorted({op.split(".")[0] for op in ops if "MMA" in op})
    memory = {op: n for op, n in sorted(ops.items()) if op.startswith(_MEMORY_OPS)}
    syncs = {op: n for op, n in sorted(ops.items()) if op.startswith(_SYNC_OPS)}
    return {"kernel": compiled.name, "BLOCK_M": k["BLOCK_M"], "BLOCK_N": k["BLOCK_N"], "BLOCK_K": k["BLOCK_K"],
            "warps": k["num_warps"], "stages": k["num_stages"], "swap_ab": k.get("SWAP_AB", False),
            "loop_instructions": len(loop), "per_weight": round(len(loop) / weights_per_thread, 2),
            "outside_loop": len(_INSTRUCTION.findall(sass)) - len(loop),
            "registers": registers, "stack_bytes": stack, "shared_bytes": compiled.metadata.shared, "mma": mma,
            "loop_memory": memory, "loop_syncs": syncs,
            "loop_opcodes": dict(sorted(Counter(op.split(".")[0] for op in loop).items()))}


def point_rows(model_name: str, scheme_name: str, M: int, *, device_name: str, config: dict | None,
               workdir: Path, peer: Path | None = None, tma: bool = False) -> list[dict]:
    """Both GEMMs of one (model, scheme, M), with the tuned config of device_name unless `config` is given (`tma`:
    with TMA weight copies in both GEMMs); then, given `peer` (a triton_kernels folder) and MXFP4, triton_kernels'
    two GEMMs at the same point."""
    model = (MODELS | EXTRA_MODELS)[model_name]
    weights = empty_weights(model, scheme_name)
    cfg = MoEConfig.from_dict(config) if config else get_config(
        num_tokens=M, num_experts=model.E, intermediate=model.I, top_k=model.k, scheme=weights.scheme,
        in_dtype_name="bf16", device_name=device_name)
    if tma:
        cfg = replace(cfg, gemm1=replace(cfg.gemm1, TMA=True), gemm2=replace(cfg.gemm2, TMA=True))
    sides = [("moerules", captured_launches(model, weights, M, cfg))]
    if peer and scheme_name == "mxfp4":
        sides.append(("triton_kernels", peer_launches(peer, model, M)))
    return [{"side": side, "model": model_name, "scheme": scheme_name, "M": M, "gemm": gemm} | count(item, workdir)
            for side, items in sides for gemm, item in enumerate(items, start=1)]


def line(row: dict) -> str:
    tile = f"{row['BLOCK_M']}x{row['BLOCK_N']}x{row['BLOCK_K']} w{row['warps']} s{row['stages']}"
    side = "" if row["side"] == "moerules" else f"{row['side']} "
    return (f"{row['model']:14s} {row['scheme']:6s} M={row['M']:<6d} {side}GEMM{row['gemm']} {tile}"
            f"{' swap' if row['swap_ab'] else ''}: loop {row['loop_instructions']} ({row['per_weight']}/weight), "
            f"{row['outside_loop']} outside it, "
            f"{row['registers']} regs, {row['stack_bytes']} B stack, {row['shared_bytes']} B smem, "
            f"{'/'.join(row['mma']) or 'no MMA'}, {row['loop_memory']}, waits {row['loop_syncs']}")


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("sass_count.py: compiles for sm_90 and cannot under TRITON_INTERPRET=1; run it without", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt-oss-120b"], choices=list(MODELS | EXTRA_MODELS))
    p.add_argument("--schemes", nargs="+", default=["mxfp4"], choices=SCHEMES)
    p.add_argument("--ms", nargs="+", type=int, default=[16, 256, 4096], help="token counts (default %(default)s)")
    p.add_argument("--device-name", default="NVIDIA H200", help="whose tuned files give the configs")
    p.add_argument("--config", type=json.loads, help="a MoEConfig as JSON, instead of the tuned file's")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/sass_count")),
                   help="cubins and results.json")
    p.add_argument("--triton-kernels", type=Path, metavar="DIR",
                   help="also count triton_kernels' MXFP4 GEMMs at each MXFP4 point, the package in DIR "
                        "(bench/get_triton_kernels.sh fills carry/triton_kernels)")
    p.add_argument("--tma", action="store_true", help="the configs with TMA weight copies in both GEMMs")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.triton_kernels:
        try:
            tk_mxfp4.package_root(args.triton_kernels)
        except tk_mxfp4.TritonKernelsNotFound as exc:
            print(f"sass_count.py: {exc}", file=sys.stderr)
            return 2
    rows = []
    for name in args.models:
        for scheme_name in args.schemes:
            for M in args.ms:
                for row in point_rows(name, scheme_name, M, device_name=args.device_name, config=args.config,
                                      workdir=args.out, peer=args.triton_kernels, tma=args.tma):
                    rows.append(row)
                    print(line(row), flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
