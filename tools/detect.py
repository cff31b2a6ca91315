"""Probe the current machine once into a `Platform` and vLLM's switches (rules never read the environment)."""

from __future__ import annotations

import importlib.util
import platform as _host

import os

from moerules.config import (HUMMING_GEMM_VARIABLE, PACKAGE_DECLARATIONS, SWITCH_VARIABLES, Package, Platform, Switch,
                             Switches, Vendor)


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
    # each package's probe module is data, beside the package, in rules/05-packages.yaml
    packages = frozenset(Package(name) for name, entry in PACKAGE_DECLARATIONS.items() if _present(entry["probe"]))
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
