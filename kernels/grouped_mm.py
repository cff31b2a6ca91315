"""`torch.grouped_mm`: an all-torch MoE on `torch._grouped_mm` / `torch._scaled_grouped_mm`.

Pipeline: sort slots by expert (argsort), gather token rows, grouped GEMM1, bias,
activation, (per-token FP8 re-quantisation), grouped GEMM2, bias, router weight, fp32
scatter-add over top-k. This is the baseline the Triton backend has to beat.

Cells: bf16/fp16/fp32 unquantised through `_grouped_mm` (CUDA: bf16 only on the CUTLASS
path of sm90/sm100; CPU: torch's loop fallback, where this torch has one), and FP8 W8A8
per-token activations x per-channel weights through `_scaled_grouped_mm` (CUDA sm90+,
row-wise scales, bf16 output, K and N multiples of 16).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .activations import apply_activation
from .interfaces import Experts
from .scheme import TORCH_DTYPE
from .weights import MoEWeights


class GroupedMMExperts(Experts):

    def apply(self, hidden_q: torch.Tensor, *, weights: MoEWeights, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, a_scale: Optional[torch.Tensor]) -> torch.Tensor:
        x, a_scale = self.gemm1_input(hidden_q, a_scale=a_scale, weights=weights)
        out_dtype = TORCH_DTYPE[weights.in_dtype]
        T, k = topk_ids.shape
        E, H = weights.num_experts, weights.hidden
        if T == 0:
            return torch.empty(0, H, dtype=out_dtype, device=x.device)
        flat = topk_ids.reshape(-1)
        # Under EP, id -1 (expert on another rank) becomes E: those rows sort after every group, the
        # grouped GEMMs leave them unwritten, and `valid` zeroes them before they can reach a scale or the sum.
        remote = self.prepare_finalize.remote_expert_ids
        if remote:
            flat = torch.where(flat >= 0, flat, E)
        order = torch.argsort(flat, stable=True)
        # scatter_add, not bincount: bincount reads the max back to the host, which breaks graph capture.
        counts = torch.zeros(E + remote, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
        offs = torch.cumsum(counts[:E], 0, dtype=torch.int32)
        tokens = order // k
        expert_of_row = flat[order].long()
        valid = (expert_of_row < E)[:, None] if remote else None
        expert_of_row = expert_of_row.clamp(max=E - 1) if remote else expert_of_row
        h = self._gemm(x[tokens], None if a_scale is None else a_scale[tokens], weights.w13, weights.w13_scale,
                       offs, out_dtype)
        if weights.has_bias:
            h = h + weights.w13_bias[expert_of_row]
        if remote:
            h = torch.where(valid, h, 0)
        inter, s2 = self.quantize_gemm_input(apply_activation(h, self.activation, self.swiglu),
                                             static_scale=weights.a2_scale)
        y = self._gemm(inter, s2, weights.w2, weights.w2_scale, offs, out_dtype)
        if weights.has_bias:
            y = y + weights.w2_bias[expert_of_row]
        y = y.float() * topk_weights.reshape(-1)[order, None]
        if remote:
            y = torch.where(valid, y, 0)
        return torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add_(0, tokens, y).to(out_dtype)

    def _gemm(self, a: torch.Tensor, a_scale: Optional[torch.Tensor], w: torch.Tensor,
              w_scale: Optional[torch.Tensor], offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        # w is [E, N, K] with K contiguous, so its transpose is the column-major [E, K, N] both ops want.
        if w_scale is None:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
        return torch._scaled_grouped_mm(a, w.transpose(1, 2), a_scale.float(), w_scale.float(), offs=offs,
                                        out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def probe(device_type: str, dtype: torch.dtype, scaled: bool) -> Optional[str]:
    """None if the grouped GEMM op runs on this device and dtype, else why not (with a fix)."""
    op = "_scaled_grouped_mm" if scaled else "_grouped_mm"
    if not hasattr(torch, op):
        return f"torch {torch.__version__} has no torch.{op}; install torch>=2.8 (>=2.9 for {op} on CPU, if at all)"
    if device_type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device is available"
    dev = torch.device(device_type)
    a = torch.ones(32, 32, device=dev)
    b = torch.ones(2, 32, 32, device=dev).transpose(1, 2)
    offs = torch.tensor([16, 32], dtype=torch.int32, device=dev)
    try:
        if scaled:
            f8 = torch.float8_e4m3fn
            torch._scaled_grouped_mm(a.to(f8), b.to(f8), torch.ones(32, device=dev), torch.ones(2, 32, device=dev),
                                     offs=offs, out_dtype=torch.bfloat16)
        else:
            torch._grouped_mm(a.to(dtype), b.to(dtype), offs=offs)
    except (RuntimeError, NotImplementedError) as exc:
        cap = torch.cuda.get_device_capability() if device_type == "cuda" else None
        return (f"torch.{op} does not run on {device_type}{f' sm{cap[0]}{cap[1]}' if cap else ''} for {dtype} with "
                f"torch {torch.__version__} ({str(exc).splitlines()[0][:160]}); "
                f"use torch.reference or triton.fused_moe here, or a CUDA sm90+ GPU")
    return None
