"""Probe the current machine once into a `Platform` and vLLM's switches (rules never read the environment)."""

from __future__ import annotations

import importlib.util
import platform as _host

import os

from moerules.config import HUMMING_GEMM_VARIABLE, SWITCH_VARIABLES, Package, Platform, Switch, Switches, Vendor

# Which importable module proves a kernel package is present.
_PROBES = {
    Package.triton: "triton", Package.aiter: "aiter", Package.flashinfer: "flashinfer",
    Package.deep_gemm: "deep_gemm", Package.vllm_cutlass: "vllm", Package.marlin: "vllm",
    Package.triton_kernels: "triton_kernels", Package.deep_ep: "deep_ep", Package.mori: "mori",
    Package.nixl_ep: "nixl_ep", Package.xpu_kernels: "vllm_xpu_kernels", Package.humming: "humming",
    Package.moonep: "moonep", Package.vllm: "vllm", Package.b12x: "b12x", Package.hpc: "hpc",
    Package.zentorch: "zentorch_op", Package.vllm_cpu: "vllm._C",
}


def detect_switches(environ=os.environ) -> Switches:
    """vLLM's switches as this process's environment sets them (vllm/envs.py parses "1"/"true" as on)."""
    values = {}
    for field, variables in SWITCH_VARIABLES.items():
        given = [environ[name].strip().lower() for name in variables if name in environ]
        if given:
            values[field] = Switch.on if all(value in ("1", "true") for value in given) else Switch.off
    gemm = environ.get(HUMMING_GEMM_VARIABLE, "auto").strip().lower()
    values["humming_moe_gemm_type"] = {"auto": "unset", "grouped_contiguous": "grouped"}.get(gemm, gemm)
    return Switches(**values)


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def detect() -> Platform:
    packages = frozenset(p for p, module in _PROBES.items() if _present(module))
    try:
        import torch
    except ImportError:
        return Platform(vendor=Vendor.cpu, arch=_host.machine().lower() or "cpu", packages=packages,
                        torch_grouped_mm=False)
    grouped = hasattr(torch, "_grouped_mm")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        if getattr(torch.version, "hip", None):
            arch = props.gcnArchName.split(":")[0]
            return Platform(vendor=Vendor.rocm, arch=arch, packages=packages, torch_grouped_mm=grouped)
        return Platform(vendor=Vendor.cuda, arch=f"sm_{props.major}{props.minor}", packages=packages,
                        torch_grouped_mm=grouped)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return Platform(vendor=Vendor.xpu, arch="xe_hpc", packages=packages, torch_grouped_mm=False)
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return Platform(vendor=Vendor.cpu, arch=_host.machine().lower() or "cpu", packages=packages,
                    torch_grouped_mm=False, cpu_amx=amx)
