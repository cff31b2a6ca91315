"""Probe: what GEMM2 gains when its A operand is a plain box, i.e. when GEMM1 stores the intermediate in sorted-row
order instead of by slot.

Today GEMM2 gathers each tile's A rows by slot (`sorted_ids`), so A is loaded by address; with the intermediate in
sorted order (row r of the buffer = aligned row r) A becomes a [BLOCK_M, BLOCK_K] box of a 2-d tensor, which the
TMA engine can copy, and the kernel can be persistent (one program per SM looping over tiles, the K loop flattened
across tiles so the next tile's loads overlap this tile's epilogue) and warp-specialised (Triton 3.6's `tl.range(...,
warp_specialize=True)`: producer warps issue the copies, consumer warps the MMAs).

Per point: the intermediate ours would hand GEMM2, re-laid in sorted order outside the timing; GEMM2 as launched
today against `_sorted_gemm2_kernel` variants (persistent or one program per tile, warp-specialised or not, tile
shapes), each checked against today's output, all timed in turn (CUDA graphs, L2 flushed). bf16 and FP8 per tensor
(A and W scales per tensor / per expert); no bias, no LoRA, no tail tiles — enough to measure, not a kernel to ship.

    python bench/sorted_gemm2_probe.py --out DIR --points qwen3-30b-a3b:fp8_tensor:4096 ... [--variants persist]
        [--warp-specialized]

Each variant's first launch (compile and run) is logged with its seconds as it ends, so a run the device's time limit
cuts short still says which variant it was in. The warp-specialised variants run only with --warp-specialized: on the
H100 (Triton 3.6) their first launch never returned. Sessions 45 and 46 ran them for 100 s and 440 s, and a lone
n256k64s4_persist_ws for 45 s after set-up, with no line printed. The other six variants compile for sm_90 and
complete their first launch in under a second each (bench/results/s46).
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import TIMED_SCHEMES, Bench, fastest_interleaved, report_row  # noqa: E402
from vllm_triton import Alignments, gemm_inputs, our_gemms  # noqa: E402


@triton.jit
def _sorted_gemm2_kernel(a_desc, w_desc, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, topk_weights_ptr,
                         a_scale_ptr, w_scale_ptr, num_slots, N, K, stride_om,
                         SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, PERSISTENT: tl.constexpr, WS: tl.constexpr):
    """out[slot] = topk_weight[slot] * (a_sorted[row] . w[e]^T) for each aligned row whose slot is real."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    m_blocks = tl.cdiv(tl.load(num_post_ptr), BLOCK_M)
    num_tiles = m_blocks * n_tiles
    step = PROGRAMS if PERSISTENT else num_tiles  # one program per tile: the loop runs once
    for tile in tl.range(tl.program_id(0), num_tiles, step, flatten=PERSISTENT and not WS, warp_specialize=WS):
        group = GROUP_M * n_tiles
        first_m = (tile // group) * GROUP_M
        rows_in_group = tl.minimum(m_blocks - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % rows_in_group
        pid_n = (tile % group) // rows_in_group
        e = tl.load(expert_ids_ptr + pid_m)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w_desc.load([e * N + pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(a, w.T, acc)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(sorted_ids_ptr + rows)
        row_ok = slot < num_slots
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if SCALED:
            acc = acc * (tl.load(a_scale_ptr) * tl.load(w_scale_ptr + e))
        acc = acc * tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0)[:, None]
        tl.store(out_ptr + slot[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < N)[None, :])


def sorted_rows(inter_q: torch.Tensor, sorted_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The intermediate in aligned-row order: row r is slot sorted_ids[r]'s row, zero where r is padding."""
    bits = {1: torch.uint8, 2: torch.int16}[inter_q.element_size()]  # fp8 has no where / index_put
    real = (sorted_ids < num_slots)[:, None]
    rows = inter_q.view(bits)[sorted_ids.clamp(max=num_slots - 1).long()]
    return torch.where(real, rows, torch.zeros((), dtype=bits, device=rows.device)).view(inter_q.dtype)


def variants(block_m: int, warp_specialized: bool = False) -> dict[str, dict]:
    """name -> launch fields: one program per tile, then persistent; with warp_specialized also persistent and
    warp-specialised, last (the module docstring says why they are opt-in). Each at the tiles GEMM2 is tuned around
    (BLOCK_N 128 / 256, BLOCK_K 64 / 128)."""
    out = {}
    modes = ((False, False), (True, False)) + (((True, True),) if warp_specialized else ())
    for (persistent, ws), (bn, bk, stages) in itertools.product(modes, ((128, 128, 3), (256, 64, 4), (128, 64, 4))):
        name = f"n{bn}k{bk}s{stages}{'_persist' if persistent else ''}{'_ws' if ws else ''}"
        out[name] = dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, PERSISTENT=persistent, WS=ws, num_stages=stages,
                         num_warps=8 if not ws else 4)
    return out


def launcher(a_sorted, weights, align, topk_weights, a_scale, out, fields: dict):
    from triton.tools.tensor_descriptor import TensorDescriptor
    E, N, K = weights.w2.shape
    bm, bn, bk = fields["BLOCK_M"], fields["BLOCK_N"], fields["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(a_sorted, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(weights.w2.view(E * N, K), [bn, bk])
    sms = torch.cuda.get_device_properties(out.device).multi_processor_count
    tiles = triton.cdiv(a_sorted.shape[0], bm) * triton.cdiv(N, bn)
    programs = min(sms, tiles) if fields["PERSISTENT"] else tiles
    scaled = a_scale is not None
    dummy = topk_weights

    def run():
        _sorted_gemm2_kernel[(programs,)](
            a_desc, w_desc, out, align.sorted_ids, align.expert_ids, align.num_post_padded, topk_weights,
            a_scale if scaled else dummy, weights.w2_scale if scaled else dummy, out.shape[0], N, K, out.stride(0),
            SCALED=scaled, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PROGRAMS=programs,
            PERSISTENT=fields["PERSISTENT"], WS=fields["WS"], num_warps=fields["num_warps"],
            num_stages=fields["num_stages"])
    return run


def probe_point(b: Bench, name: str, sname: str, M: int, rounds: int, only: str = "",
                warp_specialized: bool = False) -> dict:
    layer, ids, tw, x_q, a_scale = gemm_inputs(b, name, sname, M)
    w = layer.weights
    alignments = Alignments(ids, w.num_experts)
    ours = our_gemms(layer, x_q, a_scale, ids, tw, alignments=alignments)
    inter_q, inter_scale = ours.gemm2_input
    row = {"point": f"{name}:{sname}:{M}", "config": ours.config}
    ours.gemm1()
    ours.gemm2()  # today's GEMM2 output, the reference (written into its out2 by slot)
    tw_flat = tw.reshape(-1).contiguous()
    fns = {"today": ours.gemm2}
    for vname, fields in variants(ours.config["BLOCK_M"], warp_specialized).items():
        if not re.search(only, vname):
            continue
        align = alignments(fields["BLOCK_M"])
        if align.naive:
            row[vname] = "naive assignment: no sorted order"
            continue
        a_sorted = sorted_rows(inter_q, align.sorted_ids, ids.numel())
        out = torch.zeros(ids.numel(), w.hidden, dtype=ours.out.dtype, device=ids.device)
        fn = launcher(a_sorted, w, align, tw_flat, inter_scale, out, fields)
        start = time.monotonic()
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a variant Triton cannot compile is recorded, not fatal
            row[vname] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        finally:
            print(f"{row['point']} {vname}: first launch {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        ref = reference_gemm2(inter_q, inter_scale, w, align, tw_flat, ids.numel())
        row[f"{vname}_rel_err"] = float((out.float() - ref).norm() / ref.norm())
        fns[vname] = fn
    times = fastest_interleaved(b.interleaved_us, rounds, {k: {"": f} for k, f in fns.items()})
    for key, us in times.items():
        row[key] = round(us, 1)
    row["best"] = min((k for k in fns if k != "today"), key=lambda k: times[f"{k}_us"], default=None)
    if row["best"]:
        row["today/best"] = round(times["today_us"] / times[f"{row['best']}_us"], 3)
    return row


def reference_gemm2(inter_q, inter_scale, w, align, tw_flat, num_slots) -> torch.Tensor:
    """fp32 topk_weight * (inter . w2[e]^T) per slot, from the alignment's expert per row block."""
    expert_of_slot = torch.empty(num_slots, dtype=torch.long, device=inter_q.device)
    rows = align.sorted_ids[: int(align.num_post_padded.item())].long()
    blocks = torch.arange(rows.numel(), device=rows.device) // align.block_m
    real = rows < num_slots
    expert_of_slot[rows[real]] = align.expert_ids[blocks[real]].long()
    a = inter_q.float() * (inter_scale.float() if inter_scale is not None else 1.0)
    w2 = w.w2.float()
    if w.w2_scale is not None:
        w2 = w2 * w.w2_scale.float().reshape(-1, 1, 1)
    out = torch.empty(num_slots, w.hidden, device=a.device)
    for e in expert_of_slot.unique().tolist():
        sel = expert_of_slot == e
        out[sel] = a[sel] @ w2[e].T
    return out * tw_flat[:, None]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--points", nargs="+", required=True, help="model:scheme:M")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default="", help="a regex: only the variants whose name it matches (default all)")
    p.add_argument("--warp-specialized", action="store_true",
                   help="also the warp-specialised variants, whose first launch never returned on the H100")
    args = p.parse_args(argv)
    models = sorted({pt.split(":")[0] for pt in args.points})
    b = Bench(argparse.Namespace(smoke=False, models=models, out=args.out, ms=None, schemes=list(TIMED_SCHEMES)))
    rows = []
    for point in args.points:
        name, sname, m = point.split(":")
        row = probe_point(b, name, sname, int(m), args.rounds, args.variants, args.warp_specialized)
        report_row(rows, row, Path(args.out, "sorted_gemm2.json"))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
