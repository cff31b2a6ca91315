"""Static instruction counts of the fused-MoE GEMMs, compiled for sm_90 on a machine without a GPU.

    python bench/sass_count.py --models gpt-oss-120b --schemes mxfp4 --ms 16 256 4096 [--device-name "NVIDIA H200"]
    python bench/sass_count.py ... --config '{"BLOCK_M": 16, "gemm1": {...}, "gemm2": {...}}'   # a config to try
    PYTHONPATH=carry/base python bench/sass_count.py ...   # an older tree (`git archive`, as gpu_steps compare_mx)

Each point runs the real launcher (`triton.launch.fused_moe`, on empty tensors of the model's shapes, with the
config the tuned file of --device-name gives, or --config) with its two GEMM launches captured instead of run, so
the arguments and Triton's specialisations (ints equal to 1 become constants, multiples of 16 get divisibility
hints) are those a GPU run would compile; the alignment kernel is replaced by its shapes. Each launch is then
compiled for sm_90 with the ptxas of the triton wheel and disassembled. Printed per GEMM: the config, the main
loop (the longest backward branch of the SASS: the K loop), its instructions per weight per thread, registers
(occupancy), shared memory, the MMA instruction, the loop's memory instructions and what it waits on.

It times nothing: GPU time is scarce (30 minutes a session). It tells, before a device run, whether a change
cuts the instructions a decode-bound kernel issues and what it costs in registers. Session 26 found that a 20%
cut (MXFP4 GEMM1 at 16x32x64: 183 -> 146 SASS per K step) did not make the kernel faster on the H200
(bench/results/s26): read these counts next to a timing, never instead of one.
Weight-only schemes only (bf16, mxfp4): quantised activations would run the Triton quantisers here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe import EXTRA_MODELS, MODELS, TIMED_SCHEMES
from moerules.activation import Dtype, SwigluParams
from moerules.kernels.scheme import Scheme
from moerules.kernels.triton import launch
from moerules.kernels.triton.align import Alignment, max_blocks
from moerules.kernels.triton.config import MoEConfig, get_config
from moerules.kernels.weights import MoEWeights

SM90 = GPUTarget("cuda", 90, 32)
SCHEMES = ("bf16", "mxfp4")
_POINTER = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
            torch.int32: "i32", torch.int64: "i64"}
_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
_MEMORY_OPS = ("LDG", "LDS", "STS", "LDSM", "STSM", "LDL", "STL")
# What a K step waits on: barriers, wgmma completions, the fences before wgmma reads a freshly stored tile.
_SYNC_OPS = ("BAR", "WARPGROUP.DEPBAR", "MEMBAR", "FENCE")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;]*);")


@dataclass
class Launch:
    kernel: Any                 # the JITFunction
    args: tuple
    kwargs: dict


def empty_weights(model, scheme_name: str) -> MoEWeights:
    """Uninitialised weights of the model's shapes (MX scales 1, so the folded decode compiles, as for every
    real checkpoint)."""
    scheme = Scheme.from_quant(TIMED_SCHEMES[scheme_name])
    E, H, I, pack = model.E, model.H, model.I, scheme.k_pack
    storage = scheme.weight_torch_dtype or torch.bfloat16
    w = dict(w13=torch.empty(E, 2 * I, H // pack, dtype=storage), w2=torch.empty(E, H, I // pack, dtype=storage))
    if scheme.is_mx:
        w.update(w13_scale=torch.full((E, 2 * I, H // 32), 127, dtype=torch.uint8),
                 w2_scale=torch.full((E, H, I // 32), 127, dtype=torch.uint8))
    if model.bias:
        w.update(w13_bias=torch.empty(E, 2 * I, dtype=torch.bfloat16), w2_bias=torch.empty(E, H, dtype=torch.bfloat16))
    return MoEWeights(scheme=scheme, in_dtype=Dtype.bf16, **w)


def captured_launches(model, weights: MoEWeights, M: int, config: MoEConfig) -> list[Launch]:
    """The GEMM launches `fused_moe` makes for M tokens, captured (nothing runs)."""
    launches: list[Launch] = []

    class Capture:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(Launch(self.kernel, args, kwargs))

    def alignment(topk_ids, *, num_experts, block_m):
        blocks = max_blocks(topk_ids.numel(), num_experts, block_m)
        i32 = dict(dtype=torch.int32)
        return Alignment(sorted_ids=torch.empty(blocks * block_m, **i32), expert_ids=torch.empty(blocks, **i32),
                         num_post_padded=torch.empty(1, **i32), block_m=block_m)

    saved = launch.moe_align, launch.gemm1_gated_kernel, launch.gemm2_weighted_kernel
    launch.moe_align = alignment
    launch.gemm1_gated_kernel, launch.gemm2_weighted_kernel = Capture(saved[1]), Capture(saved[2])
    try:
        launch.fused_moe(torch.empty(M, model.H, dtype=torch.bfloat16), a_scale=None, weights=weights,
                         topk_ids=torch.zeros(M, model.k, dtype=torch.int32), topk_weights=torch.empty(M, model.k),
                         activation=model.activation, quantize_intermediate=lambda t: (t, None),
                         out_dtype=torch.bfloat16, config=config, swiglu=SwigluParams())
    finally:
        launch.moe_align, launch.gemm1_gated_kernel, launch.gemm2_weighted_kernel = saved
    return launches


def compile_sm90(item: Launch):
    """The launch compiled as a GPU run would compile it, for sm_90."""
    kernel, kwargs = item.kernel, dict(item.kwargs)
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages")}
    values = dict(zip(kernel.arg_names, item.args)) | kwargs
    signature, constants, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name]
        if param.is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _POINTER[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=attrs), target=SM90,
                          options=options)


def main_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop (a branch back to an earlier address) of the disassembly."""
    code = [(int(addr, 16), op, text) for addr, text, op in _INSTRUCTION.findall(sass)]
    best: list[str] = []
    for addr, op, text in code:
        target = re.search(r"BRA\S*\s+(?:`\()?(0x[0-9a-f]+)", text) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= addr]
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
            "warps": k["num_warps"], "stages": k["num_stages"], "swap_ab": k["SWAP_AB"],
            "loop_instructions": len(loop), "per_weight": round(len(loop) / weights_per_thread, 2),
            "registers": registers, "stack_bytes": stack, "shared_bytes": compiled.metadata.shared, "mma": mma,
            "loop_memory": memory, "loop_syncs": syncs}


def point_rows(model_name: str, scheme_name: str, M: int, *, device_name: str, config: dict | None,
               workdir: Path) -> list[dict]:
    """Both GEMMs of one (model, scheme, M), with the tuned config of device_name unless `config` is given."""
    model = (MODELS | EXTRA_MODELS)[model_name]
    weights = empty_weights(model, scheme_name)
    cfg = MoEConfig.from_dict(config) if config else get_config(
        num_tokens=M, num_experts=model.E, intermediate=model.I, top_k=model.k, scheme=weights.scheme,
        in_dtype_name="bf16", device_name=device_name)
    return [{"model": model_name, "scheme": scheme_name, "M": M, "gemm": gemm} | count(item, workdir)
            for gemm, item in enumerate(captured_launches(model, weights, M, cfg), start=1)]


def line(row: dict) -> str:
    tile = f"{row['BLOCK_M']}x{row['BLOCK_N']}x{row['BLOCK_K']} w{row['warps']} s{row['stages']}"
    return (f"{row['model']:14s} {row['scheme']:6s} M={row['M']:<6d} GEMM{row['gemm']} {tile}"
            f"{' swap' if row['swap_ab'] else ''}: loop {row['loop_instructions']} ({row['per_weight']}/weight), "
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
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        for scheme_name in args.schemes:
            for M in args.ms:
                for row in point_rows(name, scheme_name, M, device_name=args.device_name, config=args.config,
                                      workdir=args.out):
                    rows.append(row)
                    print(line(row), flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
