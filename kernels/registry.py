"""Kernels by string id, with the cells each one supports.

Ids, never import paths, name kernels everywhere (rules, decisions, CLI). An entry says
which scheme cells (`Scheme.cell`), activations and in_dtypes it implements, whether it
takes biases and applies LoRA adapters, its activation format, and how to probe the platform
for its packages; so a mismatched request fails with a message instead of running something else.
The rules (rules/10-components.yaml and the constraints) are the source of what a backend can do;
tests/test_one_declaration.py fails when an entry here drifts from them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moerules.activation import Activation, Dtype
from moerules.config import PACKAGE_DECLARATIONS, Package
from moerules.quant import QuantConfig, QuantFamily

from .activations import ACTIVATIONS, GATED_ACTIVATIONS
from .interfaces import BATCHED, STANDARD, Experts, PrepareFinalize
from .scheme import Scheme, UnsupportedScheme, scheme_cells
from .weights import MoEWeights

ALL_CELLS = frozenset(scheme_cells())
ROWWISE_FP8 = "fp8_w8a8/channel/token"


@dataclass(frozen=True)
class ExpertsSpec:
    kernel_id: str
    factory: str                      # "module:Class", imported only when built (keeps triton optional)
    activation_format: str
    cells: frozenset[str]
    activations: frozenset[Activation]
    in_dtypes: frozenset[Dtype]
    supports_bias: bool
    # None if runnable here, else the reason and the fix. Called with (scheme, in_dtype, device, weights).
    probe: Callable[[Scheme, Dtype, torch.device, MoEWeights], Optional[str]]
    notes: str = ""
    supports_lora: bool = False       # applies `weights.lora` (on unquantised activations only)
    # MX: hidden and intermediate (after padding) must be whole 32-element groups.
    needs_full_mx_groups: bool = False
    # Adapters only: the external package they run (its probe and install line: rules/05-packages.yaml).
    package: Optional[Package] = None


@dataclass(frozen=True)
class PrepareFinalizeSpec:
    pf_id: str
    factory: str
    activation_format: str
    notes: str = ""


def load_factory(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module, __package__), name)


def _probe_reference(scheme, in_dtype, device, weights) -> Optional[str]:
    return None


def _probe_triton(scheme, in_dtype, device, weights) -> Optional[str]:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"package 'triton' is not importable ({exc}); {PACKAGE_DECLARATIONS['triton']['install']}"
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return ("Triton kernels need a GPU; on CPU they run only under the interpreter: set TRITON_INTERPRET=1 "
                    "before importing triton (slow; meant for tests), or use torch.reference")
        if in_dtype == Dtype.bf16:
            return ("the Triton interpreter computes tl.dot wrongly for bf16 operands; use fp16 on CPU, "
                    "or a GPU for bf16")
        return None
    if device.type != "cuda":
        return f"no Triton backend for device type {device.type!r} here"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    major, minor = torch.cuda.get_device_capability(device)
    if scheme.weight_dtype is not None and scheme.weight_dtype.value == "fp8_e4m3" and (major, minor) < (8, 9):
        return f"FP8 needs compute capability >= 8.9, this GPU is sm{major}{minor}"
    if scheme.k_pack > 1 and major < 8:
        return (f"MXFP4 decodes into bf16/fp16 MMA with sm80 instructions, this GPU is sm{major}{minor}; "
                "use an sm80+ GPU or torch.reference")
    return None


def _probe_grouped_mm(scheme, in_dtype, device, weights) -> Optional[str]:
    from .grouped_mm import probe
    from .scheme import TORCH_DTYPE
    scaled = scheme.weight_dtype is not None
    if scaled:
        if in_dtype != Dtype.bf16:
            return f"torch._scaled_grouped_mm writes bf16 only; in_dtype {in_dtype.value} is not supported"
        if weights.hidden % 16 or weights.intermediate % 16:
            return (f"torch._scaled_grouped_mm needs hidden ({weights.hidden}) and intermediate "
                    f"({weights.intermediate}) to be multiples of 16 (pad them)")
    return probe(device.type, TORCH_DTYPE[in_dtype], scaled)


_GATED = frozenset(GATED_ACTIVATIONS)
_BATCHED_TRITON_CELLS = frozenset(cell for cell, s in scheme_cells().items()
                                  if s.family in (QuantFamily.unquantized, QuantFamily.fp8_w8a8, QuantFamily.fp8_w8a16))
EXPERTS: dict[str, ExpertsSpec] = {s.kernel_id: s for s in [
    ExpertsSpec("triton.fused_moe", ".triton.experts:TritonExperts", STANDARD, ALL_CELLS, ACTIVATIONS,
                frozenset({Dtype.bf16, Dtype.fp16}), True, _probe_triton,
                "CUDA GPU (fp8 and MXFP8 need sm89+, MXFP4 sm80+; MX needs hidden and intermediate multiples of 32 "
                "after padding); CPU only under TRITON_INTERPRET=1 and fp16", needs_full_mx_groups=True,
                supports_lora=True),
    ExpertsSpec("torch.grouped_mm", ".grouped_mm:GroupedMMExperts", STANDARD,
                frozenset({"unquantized", ROWWISE_FP8}), ACTIVATIONS, frozenset({Dtype.bf16, Dtype.fp16, Dtype.fp32}),
                True, _probe_grouped_mm,
                "unquantized via torch._grouped_mm (CUDA: bf16 only, sm90/sm100 fast path; CPU where torch has the "
                "fallback); fp8_w8a8/channel/token via torch._scaled_grouped_mm (CUDA sm90+, bf16 output, "
                "hidden and intermediate multiples of 16)"),
    ExpertsSpec("torch.reference", ".reference:TorchReferenceExperts", STANDARD, ALL_CELLS, ACTIVATIONS,
                frozenset({Dtype.bf16, Dtype.fp16, Dtype.fp32}), True, _probe_reference,
                "any device; fp32 dequantise-then-matmul, one expert at a time", supports_lora=True),
    ExpertsSpec("triton.batched_moe", ".triton.batched_experts:BatchedTritonExperts", BATCHED,
                _BATCHED_TRITON_CELLS, _GATED, frozenset({Dtype.bf16, Dtype.fp16}), True, _probe_triton,
                "batched format; CUDA GPU (fp8 needs sm89+); CPU only under TRITON_INTERPRET=1 and fp16"),
    ExpertsSpec("torch.batched_reference", ".batched:BatchedReferenceExperts", BATCHED, ALL_CELLS, _GATED,
                frozenset({Dtype.bf16, Dtype.fp16, Dtype.fp32}), True, _probe_reference,
                "batched format, any device; torch.reference over the valid rows (tests and CPUs)"),
]}


def _probe_triton_kernels(scheme, in_dtype, device, weights) -> Optional[str]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"OpenAI triton_kernels runs on CUDA GPUs only, not on {device.type!r}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"the adapter lays MXFP4 weights out and sets triton_kernels' options for Hopper (sm90) only, as "
                f"vLLM does there; this GPU is sm{major}{minor}")
    return None


# External kernels run through an adapter (kernels/external): a backend declared `external:` in the rules
# names one by id (`adapter:`). The package is imported only when the layer is built.
ADAPTERS: dict[str, ExpertsSpec] = {s.kernel_id: s for s in [
    ExpertsSpec("oai.triton_kernels", ".external.oai_triton:OaiTritonExperts", STANDARD,
                frozenset({"mxfp4_w4a16/group32"}), frozenset({Activation.swigluoai}), frozenset({Dtype.bf16}), True,
                _probe_triton_kernels,
                "OpenAI triton_kernels matmul_ogs MXFP4 x bf16 MoE (gpt-oss), CUDA sm90; weights converted once at "
                "build into its Hopper layout", needs_full_mx_groups=True, package=Package.triton_kernels),
]}


def package_refusal(adapter_id: str) -> Optional[str]:
    """None if the adapter's package can be imported here, else what is missing and how to install it."""
    declared = PACKAGE_DECLARATIONS[ADAPTERS[adapter_id].package.value]
    if importlib.util.find_spec(declared["probe"]) is None:
        return f"package {declared['probe']!r} is not installed; {declared['install']}"
    return None


def adapter_refusal(adapter_id: str, quant: QuantConfig) -> Optional[str]:
    """None if the adapter's package is installed and it runs weights of `quant`, else why not.

    Checked before any weights exist: vLLM also runs W4A4/W4A8 requests on OAI triton_kernels (with bf16
    activations), but moerules has no weights of those schemes to convert."""
    missing = package_refusal(adapter_id)
    if missing:
        return missing
    try:
        cell = Scheme.from_quant(quant).cell
    except UnsupportedScheme as exc:
        return str(exc)
    cells = ADAPTERS[adapter_id].cells
    return None if cell in cells else f"it runs {', '.join(sorted(cells))}, not {cell}"


PREPARE_FINALIZE: dict[str, PrepareFinalizeSpec] = {s.pf_id: s for s in [
    PrepareFinalizeSpec("local", ".prepare_finalize:LocalPrepareFinalize", STANDARD,
                        "no token exchange; with a process group (same tokens on every rank) all-reduces the "
                        "ranks' partial outputs"),
    PrepareFinalizeSpec("allgather_reducescatter", ".ep.allgather:AllGatherReduceScatter", STANDARD,
                        "all-gather tokens over the group, reduce-scatter the partial outputs"),
    PrepareFinalizeSpec("all2all", ".ep.all2all:All2AllPrepareFinalize", STANDARD,
                        "all_to_all_single to the ranks owning each token's experts and back"),
    PrepareFinalizeSpec("all2all_batched", ".ep.all2all_batched:BatchedAll2AllPrepareFinalize", BATCHED,
                        "the all2all exchange delivering [E_local, max_tokens, H] per-expert batches"),
    PrepareFinalizeSpec("local_batched", ".batched:LocalBatchedPrepareFinalize", BATCHED,
                        "single rank, no communication; scatters top-k slots into [E, T, H] per-expert batches"),
]}


def supported_cells() -> dict[str, dict]:
    """A plain-data summary of every experts entry (for rules authors and `moerules` docs)."""
    return {s.kernel_id: {"activation_format": s.activation_format, "cells": sorted(s.cells),
                          "activations": sorted(a.value for a in s.activations),
                          "in_dtypes": sorted(d.value for d in s.in_dtypes), "supports_bias": s.supports_bias,
                          "supports_lora": s.supports_lora,
                          "platform": s.notes}
            for s in EXPERTS.values()}


def experts_spec(kernel_id: str) -> Optional[ExpertsSpec]:
    """Our kernel or an adapter of an external one, by id (None if neither)."""
    return EXPERTS.get(kernel_id) or ADAPTERS.get(kernel_id)


def experts_class(kernel_id: str) -> type[Experts]:
    return load_factory(experts_spec(kernel_id).factory)


def prepare_finalize_class(pf_id: str) -> type[PrepareFinalize]:
    return load_factory(PREPARE_FINALIZE[pf_id].factory)
