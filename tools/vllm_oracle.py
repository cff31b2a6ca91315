"""vLLM 0.33's own backend selection, run on a `MoEConfig` (the optional `moerules[vllm]` extra).

vLLM's `select_*_moe_backend` functions run unchanged. Only what they ask of the machine is
stood in, from the config: the platform object (`current_platform`, ROCm's `on_gfx*` arch
probes), the kernel-package probes (`has_flashinfer_*`, `has_deep_gemm`, `IS_AITER_FOUND` ...)
and the `VLLM_*` environment switches. vLLM's compiled extensions are never loaded: their module
names are filled with empty modules before the platform modules import, so that importing a
platform class cannot reach a GPU driver.

Every config is translated field by field (`_moe_config`); a config whose input vLLM cannot
express (one of our own dispatchers, a dtype it has no scheme for) is `Inexpressible`, never
silently approximated.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import types
from dataclasses import dataclass
from typing import Callable, Optional

from moerules.config import HUMMING_GEMM_VARIABLE, SWITCH_VARIABLES, MoEConfig, Package, Vendor
from moerules.errors import MoeRulesError

VLLM_VERSION = "0.33.0"
INSTALL_HINT = (f"pip install 'vllm=={VLLM_VERSION}' --no-deps, then the light packages its oracle imports: "
                "pip install 'moerules[vllm]' (see README, 'Conformance with vLLM')")
# Compiled extensions the platform modules import at module level; never loaded here.
_COMPILED = ("vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C", "vllm_xpu_kernels", "vllm_xpu_kernels._C",
             "vllm_xpu_kernels._moe_C", "vllm_xpu_kernels._xpu_C")


class VllmUnavailableError(MoeRulesError):
    """vLLM (the pinned version) cannot be imported here."""


class Inexpressible(Exception):
    """The config has an input vLLM's selection cannot be given; `str(self)` says which."""


@dataclass(frozen=True)
class OracleAnswer:
    """What vLLM selected: its backend enum name and experts class, or the error it raised."""

    family: str                      # the select function's family, e.g. "fp8"
    backend: Optional[str] = None    # e.g. "FLASHINFER_CUTLASS"
    experts: Optional[str] = None    # experts class name, e.g. "FlashInferExperts"
    error: Optional[str] = None      # e.g. "NotImplementedError: No FP8 MoE backend supports ..."

    @property
    def selected(self) -> bool:
        return self.experts is not None


def _import_vllm():
    # vLLM logs each backend choice and fallback once per process: noise in a sweep of thousands.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for name in _COMPILED:
        sys.modules.setdefault(name, types.ModuleType(name))
    _stand_in_humming()
    try:
        import vllm
    except ImportError as error:
        raise VllmUnavailableError(f"vLLM is not importable ({error}); {INSTALL_HINT}") from None
    logging.getLogger("vllm").setLevel(logging.ERROR)
    if vllm.__version__ != VLLM_VERSION:
        raise VllmUnavailableError(f"conformance is pinned to vLLM {VLLM_VERSION}, found {vllm.__version__}; "
                                   f"{INSTALL_HINT}")
    return vllm


def _stand_in_humming() -> None:
    """Humming's experts read the humming package's GemmType enum inside `is_supported_config`
    (experts/fused_humming_moe.py:649,686-689,899-901 via utils/humming.py:66), so selection crashes with
    ModuleNotFoundError where humming is not installed although `has_humming()` is stood in: that enum
    (and only it) stands in, with humming's own values (get_humming_moe_gemm_type, fused_humming_moe.py:112)."""
    import enum
    import importlib.util

    if "humming" in sys.modules or importlib.util.find_spec("humming") is not None:
        return
    config = types.ModuleType("humming.config")
    config.GemmType = enum.Enum("GemmType", {"INDEXED": "indexed", "GROUPED_CONTIGUOUS": "grouped_contiguous",
                                             "GROUPED_MASKED": "grouped_masked"})
    package = types.ModuleType("humming")
    package.__path__ = []
    package.config = config
    sys.modules["humming"], sys.modules["humming.config"] = package, config


# -- the machine, stood in -------------------------------------------------------------------

# vLLM's package probes, each answered by one package of the config (`platform.packages`).
_PACKAGE_PROBES: dict[str, Package] = {
    **{name: Package.flashinfer for name in (
        "has_flashinfer", "has_flashinfer_moe", "has_flashinfer_trtllm_fused_moe", "has_flashinfer_cutlass_fused_moe",
        "has_flashinfer_cutedsl", "has_flashinfer_cutedsl_grouped_gemm_nt_masked", "has_flashinfer_cutedsl_moe_nvfp4",
        "has_flashinfer_b12x_moe", "has_flashinfer_b12x_gemm", "has_flashinfer_nvlink_two_sided",
        "has_flashinfer_nvlink_one_sided", "has_flashinfer_comm", "has_flashinfer_situ_activation",
        "is_flashinfer_mxint4_moe_available")},
    "has_deep_gemm": Package.deep_gemm,
    "has_triton_kernels": Package.triton_kernels,
    "has_deep_ep": Package.deep_ep,
    "has_deep_ep_v2": Package.deep_ep,
    "has_nixl_ep": Package.nixl_ep,
    "has_mori": Package.mori,
    "has_aiter": Package.aiter,
    "has_humming": Package.humming,
    "has_hpc": Package.hpc,
    "has_moonep": Package.moonep,
    "has_b12x": Package.b12x,
    "has_hpc": Package.hpc,
}
# Probes of vLLM's own compiled extension (`_custom_ops`): present with the vllm_cutlass package,
# answering for the architectures a full build compiles (csrc/quantization/cutlass_w8a8/scaled_mm_entry.cu).
_COMPILED_PROBES: dict[str, Callable[[int], bool]] = {
    "cutlass_group_gemm_supported": lambda cc: 90 <= cc < 110,
    "cutlass_scaled_mm_supports_fp8": lambda cc: cc >= 89,
    "cutlass_scaled_mm_supports_block_fp8": lambda cc: cc >= 90,
    "cutlass_scaled_mm_supports_fp4": lambda cc: cc >= 100,
    "mxfp4_experts_quant_supported": lambda cc: cc >= 100,
}


class _Machine:
    """The stood-in machine: one config's platform, packages and switches at a time."""

    def __init__(self):
        _import_vllm()
        _import_selection_modules()
        self.packages: frozenset[Package] = frozenset()
        self._platform_key = None
        self._install_probes()

    def _install_probes(self):
        import vllm._aiter_ops as aiter_ops
        import vllm._custom_ops as custom_ops

        def probe(package: Package):
            return lambda *args, **kwargs: package in self.packages

        for module in self._vllm_modules():
            for name, package in _PACKAGE_PROBES.items():
                if callable(vars(module).get(name)):
                    setattr(module, name, probe(package))
            if callable(vars(module).get("has_zentorch_op")):
                # zentorch is a CPU build of torch ops: its ops exist only on a CPU platform, although
                # vLLM's zentorch experts ask only for the ops (experts/zentorch_moe.py:66, cpu_moe.py:1530).
                module.has_zentorch_op = lambda *args, **kwargs: (Package.zentorch in self.packages
                                                                  and self._platform_key[0] == Vendor.cpu)
            if callable(vars(module).get("get_b12x_fused_moe")):
                # b12x's experts ask the package's fused-MoE module whether it runs here
                # (fused_moe/b12x.py:499-508): present with the b12x package, it answers yes.
                module.get_b12x_fused_moe = lambda: (types.SimpleNamespace(is_supported=lambda: True)
                                                     if Package.b12x in self.packages else None)
        for name, supported in _COMPILED_PROBES.items():
            setattr(custom_ops, name, lambda cc, supported=supported: Package.vllm_cutlass in self.packages
                    and supported(cc))
        # AITER's gate_mode probe imports aiter.fused_moe (_aiter_ops.py:2848-2860): the stood-in aiter is
        # taken to be >= 0.1.14, the first release AiterMxfp8Experts can call.
        aiter_ops.rocm_aiter_ops.fused_moe_supports_gate_mode = classmethod(
            lambda cls: Package.aiter in self.packages)
        self._aiter_ops = aiter_ops
        # The RDNA3 WNA16 kernel is a compiled op of vLLM's ROCm build (torch.ops._rocm_C.moe_gptq_gemm_rdna3),
        # present wherever vLLM itself is; only its arch gate is asked (experts/rdna3_moe.py:41-52).
        import vllm.model_executor.layers.fused_moe.experts.rdna3_moe as rdna3_moe

        def rdna3_available() -> bool:
            from vllm.platforms import current_platform

            return current_platform.is_rocm() and self._platform_key == (Vendor.rocm, "gfx1100")

        rdna3_moe.rdna3_moe_kernel_available = rdna3_available

    @staticmethod
    def _vllm_modules():
        return [module for name, module in list(sys.modules.items())
                if module is not None and (name == "vllm" or name.startswith("vllm."))]

    @contextlib.contextmanager
    def standing_in(self, config: MoEConfig, switches: dict[str, Optional[str]]):
        """The machine of `config`, with `switches` as the VLLM_* environment (None: unset), for one selection."""
        self.packages = config.platform.packages
        self._aiter_ops.IS_AITER_FOUND = Package.aiter in self.packages
        saved = {name: os.environ.get(name) for name in switches}
        _set_environment(switches)
        self._aiter_ops.rocm_aiter_ops.refresh_env_variables()
        self._set_platform(config.platform.vendor, config.platform.arch)
        _clear_platform_caches()
        import torch

        # The x86 CPU classes ask the host CPU (cpu_moe.py:359): answer for the config's CPU instead.
        with _patched(torch.cpu, "_is_amx_tile_supported", lambda: config.platform.cpu_amx):
            try:
                yield
            finally:
                _set_environment(saved)

    def _set_platform(self, vendor: Vendor, arch: str):
        if self._platform_key == (vendor, arch):
            return
        platform = _platform(vendor, arch)
        import vllm.platforms as platforms

        platforms._current_platform = platform
        for module in self._vllm_modules():
            if "current_platform" in vars(module):
                module.current_platform = platform
        self._platform_key = (vendor, arch)


def _clear_platform_caches() -> None:
    """vLLM caches some answers about the machine for the process (`functools.cache` on
    utils/deep_gemm.py:112 is_deep_gemm_supported ...): with a stood-in machine per config they would
    carry the first config's platform and switches into every later one."""
    import vllm.utils.deep_gemm as deep_gemm

    for value in vars(deep_gemm).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def _import_selection_modules() -> None:
    """Every oracle, experts and prepare/finalize module, imported while the platform is still
    vLLM's CPU-less default: module-level code that would call a compiled op runs harmlessly here."""
    import pkgutil

    names = []
    for package in ("vllm.model_executor.layers.fused_moe.oracle", "vllm.model_executor.layers.fused_moe.experts",
                    "vllm.model_executor.layers.fused_moe.prepare_finalize"):
        module = importlib.import_module(package)
        names += [f"{package}.{info.name}" for info in pkgutil.iter_modules(module.__path__)]
    names.append("vllm.model_executor.layers.fused_moe.hpc_moe")   # HPC's experts live outside experts/
    for name in names:
        with contextlib.suppress(ImportError):   # a dispatcher whose package (deep_ep, mori ...) is absent
            importlib.import_module(name)


def _platform(vendor: Vendor, arch: str):
    """vLLM's own platform class for `vendor`, answering device queries for `arch`."""
    from vllm.platforms.interface import CpuArchEnum, DeviceCapability

    if vendor == Vendor.cuda:
        from vllm.platforms.cuda import CudaPlatformBase

        cc = int(arch[3:])
        capability = DeviceCapability(major=cc // 10, minor=cc % 10)
        base, extra = CudaPlatformBase, {}
    elif vendor == Vendor.rocm:
        rocm = _rocm_module(arch)
        capability = DeviceCapability(*rocm._capability_from_gcn_arch(arch))
        base, extra = rocm.RocmPlatform, {}
    elif vendor == Vendor.xpu:
        from vllm.platforms.xpu import XPUPlatform

        base, capability, extra = XPUPlatform, None, {}
    else:
        from vllm.platforms.cpu import CpuPlatform

        cpu_arch = {"x86_64": CpuArchEnum.X86, "aarch64": CpuArchEnum.ARM, "ppc64le": CpuArchEnum.POWERPC}.get(
            arch, CpuArchEnum.OTHER)
        base, capability = CpuPlatform, None
        extra = {"get_cpu_architecture": classmethod(lambda cls: cpu_arch)}
    attributes = {"get_device_capability": classmethod(lambda cls, device_id=0: capability),
                  "get_device_name": classmethod(lambda cls, device_id=0: f"moerules stand-in {arch}"),
                  **extra}
    return type(f"StandIn{base.__name__}", (base,), attributes)()


def _rocm_module(arch: str):
    """vllm.platforms.rocm, (re)loaded so that its arch probes (`on_gfx950()` ...) read `arch`."""
    import torch
    from unittest import mock

    properties = types.SimpleNamespace(gcnArchName=arch)
    with mock.patch.object(torch.cuda, "get_device_properties", lambda *args, **kwargs: properties):
        module = sys.modules.get("vllm.platforms.rocm")
        return importlib.reload(module) if module else importlib.import_module("vllm.platforms.rocm")


# -- the config, translated ------------------------------------------------------------------

# Our vocabulary -> vLLM's, one entry per value; a value absent here has no vLLM counterpart.
_ACTIVATIONS = {"silu": "SILU", "gelu": "GELU", "gelu_tanh": "GELU_TANH", "swigluoai": "SWIGLUOAI",
                "swigluoai_uninterleave": "SWIGLUOAI_UNINTERLEAVE", "silu_no_mul": "SILU_NO_MUL",
                "gelu_no_mul": "GELU_NO_MUL", "relu2_no_mul": "RELU2_NO_MUL"}
# fused_moe/config.py:135 get_routing_method_type: softmax+renormalize is RenormalizeNaive (Mixtral, Qwen3).
_ROUTING = {"softmax_renormalize": "RenormalizeNaive", "renormalize": "Renormalize", "softmax": "Default",
            "deepseek_v3": "DeepSeekV3", "minimax2": "MiniMax2", "sigmoid": "Sigmoid",
            "sigmoid_renormalize": "SigmoidRenorm", "llama4": "Llama4"}
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# config/parallel.py:45 All2AllBackend; ours over torch.distributed have no vLLM counterpart.
_ALL2ALL = {"allgather_reducescatter": "allgather_reducescatter", "deepep_high_throughput": "deepep_high_throughput",
            "deepep_low_latency": "deepep_low_latency", "deepep_v2": "deepep_v2", "mori": "mori_high_throughput",
            "nixl_ep": "nixl_ep", "moonep": "moonep", "flashinfer_nvlink": "flashinfer_nvlink_two_sided",
            "flashinfer_nvlink_one_sided": "flashinfer_nvlink_one_sided"}


def _parallel_config(config: MoEConfig):
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    parallel = config.parallel
    if parallel.use_all2all and parallel.all2all_backend.value not in _ALL2ALL:
        raise Inexpressible(f"parallel.all2all_backend={parallel.all2all_backend.value} is ours; vLLM has no such "
                            "dispatcher")
    # FusedMoEParallelConfig.make (fused_moe/config.py): TP flattened over DP; under EP, ep = that and tp = 1.
    flat = parallel.tp * parallel.dp
    return FusedMoEParallelConfig(
        tp_size=1 if parallel.use_ep else flat, pcp_size=1, dp_size=parallel.dp, ep_size=parallel.ep_size,
        tp_rank=0, pcp_rank=0, dp_rank=0, ep_rank=0, sp_size=1, use_ep=parallel.use_ep,
        all2all_backend=_ALL2ALL.get(parallel.all2all_backend.value, "allgather_reducescatter"),
        enable_eplb=parallel.eplb)


def _moe_config(config: MoEConfig, moe_backend: str):
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, RoutingMethodType

    model = config.model
    ep = config.parallel.ep_size
    return FusedMoEConfig(
        num_experts=model.num_experts, experts_per_token=model.top_k, hidden_dim=model.hidden_size,
        intermediate_size=model.moe_intermediate_size, num_local_experts=model.num_experts // ep,
        num_logical_experts=model.num_experts, activation=MoEActivation[_ACTIVATIONS[model.activation.value]],
        device="cpu" if config.platform.vendor == Vendor.cpu else "cuda",
        routing_method=RoutingMethodType[_ROUTING[model.routing.value]],
        moe_parallel_config=_parallel_config(config), in_dtype=getattr(torch, _DTYPES[model.in_dtype.value]),
        moe_backend=moe_backend, has_bias=model.has_bias, is_lora_enabled=config.features.lora)


@contextlib.contextmanager
def _patched(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _set_environment(values: dict[str, Optional[str]]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _keys():
    from vllm.model_executor.layers.quantization.utils import quant_utils

    return quant_utils


def _fp8_keys(config: MoEConfig):
    """The FP8 keys and `allow_vllm_cutlass` the checkpoint's quantisation method passes:
    fp8.py:493-527 (native), modelopt.py:501, compressed_tensors_moe_w8a8_fp8.py:94-111, quark_moe.py:628-669."""
    k = _keys()
    quant, checkpoint = config.quant, config.quant.checkpoint.value
    weight_granularity = quant.weight_key.granularity.value
    weight = {"tensor": k.kFp8StaticTensorSym, "channel": k.kFp8StaticChannelSym,
              "block128": k.kFp8Static128BlockSym}[weight_granularity]
    activation = quant.activation_key
    if activation is None:
        return weight, None, checkpoint == "compressed_tensors"
    granularity, dynamic = activation.granularity.value, activation.dynamic
    if checkpoint == "modelopt" and (weight_granularity != "tensor" or dynamic):
        raise Inexpressible("modelopt FP8 checkpoints have per-tensor weights and static activation scales")
    if checkpoint == "native" and weight_granularity == "channel":
        raise Inexpressible("native fp8 checkpoints have per-tensor or block weights (per-channel needs "
                            "quant.checkpoint=compressed_tensors or quark)")
    if granularity == "group128":
        act = k.kFp8Dynamic128Sym
    elif granularity == "token":
        act = k.kFp8DynamicTokenSym
    elif not dynamic:
        act = k.kFp8StaticTensorSym
    elif checkpoint == "compressed_tensors":
        act = k.kFp8Dynamic128Sym     # compressed_tensors_moe_w8a8_fp8.py:94-97 maps dynamic per-tensor to 1x128
    elif checkpoint == "native" and config.features.batch_invariant:
        act = k.kFp8DynamicTokenSym   # fp8.py:509: a per-tensor dynamic scale would depend on the batch
    else:
        act = k.kFp8DynamicTensorSym
    return weight, act, checkpoint == "compressed_tensors"


def _wna16_arguments(config: MoEConfig):
    """What the checkpoint's WNA16 method passes to select_wna16_moe_backend (our weight-only int4
    `wna16` and int8 `int8_w8a16`, symmetric, no act-order): weight key, quant config (the oracle
    only tests its class and group_size/desc_act/actorder/strategy), may_have_bias, allow_tile_padding.
    native = GPTQ (auto_gptq.py:457-479: kInt4Static for every group size, may_have_bias=True always,
    tile padding); compressed_tensors (compressed_tensors_moe_wna16.py:74-110: group 32 keeps its key,
    may_have_bias=False, tile padding); quark W4A16 int4 (quark.py:566-570, quark_moe.py:346: no tile
    padding, no int8 weight-only MoE)."""
    k = _keys()
    quant, checkpoint = config.quant, config.quant.checkpoint.value
    bits = 8 if quant.family.value == "int8_w8a16" else 4
    granularity = quant.weight_key.granularity.value
    group = {"group128": 128, "group32": 32}.get(granularity, -1)
    weight = k.kInt8Static if bits == 8 else k.kInt4Static32 if group == 32 and checkpoint != "native" \
        else k.kInt4Static
    if checkpoint == "native":
        from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

        quant_config = object.__new__(AutoGPTQConfig)
        quant_config.group_size, quant_config.desc_act, quant_config.is_sym = group, False, True
        return weight, quant_config, True, True
    if checkpoint == "compressed_tensors":
        from compressed_tensors.quantization import QuantizationArgs

        strategy = "channel" if group == -1 else "group"
        quant_config = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy,
                                        group_size=None if group == -1 else group)
        return weight, quant_config, False, True
    if checkpoint == "quark" and bits == 4:
        from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig

        return weight, object.__new__(QuarkConfig), False, False
    raise Inexpressible(f"quant.checkpoint={checkpoint} has no {quant.family.value} MoE method in vLLM")


_FAMILIES = {"fp8_w8a8": "fp8", "fp8_w8a16": "fp8", "int8_w8a8": "int8", "int8_w8a16": "wna16",
             "mxfp4_w4a16": "mxfp4", "mxfp4_w4a4": "mxfp4", "mxfp4_w4a8": "mxfp4"}


def vllm_family(config: MoEConfig) -> str:
    """vLLM's select-function family for the config's scheme."""
    family = config.quant.family.value
    return _FAMILIES.get(family, family)


def _selection(config: MoEConfig, moe: object) -> Callable[[], tuple]:
    """The select function vLLM's quantisation method for this scheme calls, with its arguments."""
    from vllm.model_executor.layers.fused_moe.oracle import (fp8, int8, int_wna16, mxfp4, mxfp8, nvfp4,
                                                              unquantized, w4a8)

    k = _keys()
    quant = config.quant
    family = quant.family.value
    if family == "unquantized":
        return lambda: unquantized.select_unquantized_moe_backend(moe)
    if family in ("fp8_w8a8", "fp8_w8a16"):
        weight, activation, allow_cutlass = _fp8_keys(config)
        return lambda: fp8.select_fp8_moe_backend(moe, weight, activation, allow_vllm_cutlass=allow_cutlass)
    if family == "int8_w8a8":
        return lambda: int8.select_int8_moe_backend(moe, k.kInt8StaticChannelSym, k.kInt8DynamicTokenSym)
    if family == "mxfp8":
        return lambda: mxfp8.select_mxfp8_moe_backend(moe)
    if family == "mxfp4_w4a16":
        return lambda: mxfp4.select_mxfp4_moe_backend(moe)
    if family == "mxfp4_w4a4":
        return lambda: mxfp4.select_mxfp4_moe_backend(moe, activation_key=k.kMxfp4Dynamic)
    if family == "mxfp4_w4a8":
        return lambda: mxfp4.select_mxfp4_moe_backend(moe, activation_key=k.kMxfp8Dynamic)
    if family == "nvfp4":
        return lambda: nvfp4.select_nvfp4_moe_backend(moe, k.kNvfp4Static, k.kNvfp4Dynamic)
    if family == "w4a8":
        return lambda: w4a8.select_w4a8_moe_backend(moe)
    if family in ("wna16", "int8_w8a16"):
        weight, quant_config, may_have_bias, allow_tile_padding = _wna16_arguments(config)
        return lambda: int_wna16.select_wna16_moe_backend(
            moe, weight, quant_config=quant_config, may_have_zp=False, may_have_bias=may_have_bias,
            allow_tile_padding=allow_tile_padding)
    raise Inexpressible(f"quant.family={family} has no vLLM select function")



# Variables selection also reads that no config field models: always unset (vLLM's defaults), so the
# host's environment cannot leak into an answer.
_DEFAULTED_VARIABLES = ("VLLM_B12X_MOE_FP4_FORCE_A16", "VLLM_DEEPEPLL_NVFP4_DISPATCH", "VLLM_HUMMING_INPUT_QUANT_CONFIG",
                        "VLLM_HUMMING_USE_F16_ACCUM", "VLLM_ROCM_MOE_PADDING",
                        "VLLM_CPU_INT4_W4A8", "VLLM_ROCM_USE_AITER_MOE_A4W4_DSV4")


def _switches(config: MoEConfig) -> dict[str, Optional[str]]:
    """The VLLM_* environment vLLM's selection reads; unset where the config leaves vLLM's default."""
    values: dict[str, Optional[str]] = dict.fromkeys(_DEFAULTED_VARIABLES)
    values["VLLM_BATCH_INVARIANT"] = "1" if config.features.batch_invariant else None
    for field, variables in SWITCH_VARIABLES.items():
        switch = getattr(config.switches, field).value
        values.update((name, None if switch == "unset" else "1" if switch == "on" else "0") for name in variables)
    gemm = config.switches.humming_moe_gemm_type.value
    values[HUMMING_GEMM_VARIABLE] = None if gemm == "unset" else gemm
    return values


# What vLLM itself carries on each vendor (its compiled ops, its own Triton kernels): a config without
# one of them describes a machine vLLM cannot be, so it is compared with nothing.
_VLLM_ITSELF = {Vendor.cuda: {Package.triton, Package.vllm, Package.marlin, Package.vllm_cutlass},
                Vendor.rocm: {Package.triton, Package.vllm}, Vendor.xpu: {Package.triton, Package.vllm,
                                                                        Package.xpu_kernels},
                Vendor.cpu: {Package.vllm, Package.vllm_cpu}}


def _check_expressible(config: MoEConfig) -> None:
    missing = _VLLM_ITSELF[config.platform.vendor] - config.platform.packages
    if missing:
        raise Inexpressible(f"platform.packages lacks {', '.join(sorted(p.value for p in missing))}: vLLM on "
                            f"{config.platform.vendor.value} always has them")


# The package each vLLM all2all backend's manager and prepare/finalize need: without it vLLM fails at
# startup (distributed/device_communicators/all2all.py:207 deep_ep, :659/:763 flashinfer NVLink, :924 mori,
# :1046 deep_ep v2) or when it builds the prepare/finalize, whose class is then undefined
# (model_executor/layers/fused_moe/all2all_utils.py:111-133: nixl_ep, moonep). Those classes import only on
# CUDA/ROCm (all2all_utils.py:111), so off them every all2all but allgather_reducescatter fails the same way.
_DISPATCHER_PACKAGES = {"deepep_high_throughput": Package.deep_ep, "deepep_low_latency": Package.deep_ep,
                        "deepep_v2": Package.deep_ep, "mori": Package.mori, "nixl_ep": Package.nixl_ep,
                        "moonep": Package.moonep, "flashinfer_nvlink": Package.flashinfer,
                        "flashinfer_nvlink_one_sided": Package.flashinfer}


def _dispatcher_refusal(config: MoEConfig) -> Optional[str]:
    """Why vLLM cannot run the config's all2all dispatcher at all (None: it can)."""
    parallel = config.parallel
    if parallel.all2all_backend.value == "moonep" and (
            config.quant.family.value != "unquantized" or config.model.in_dtype.value != "bf16" or parallel.eplb):
        return "ValueError: the moonep all2all backend supports unquantized BF16 models without EPLB only " \
               "(config/vllm.py:2106-2132)"
    package = _DISPATCHER_PACKAGES.get(parallel.all2all_backend.value)
    if not parallel.use_all2all or package is None:
        return None
    if config.platform.vendor not in (Vendor.cuda, Vendor.rocm):
        return (f"NameError: the {parallel.all2all_backend.value} prepare/finalize is imported only on CUDA/ROCm "
                "(fused_moe/all2all_utils.py:111)")
    if package not in config.platform.packages:
        return (f"AssertionError: all2all backend {parallel.all2all_backend.value} needs {package.value} "
                "(distributed/device_communicators/all2all.py, fused_moe/all2all_utils.py:111-133)")
    return None


class VllmOracle:
    """vLLM 0.33's selection, callable per config; building it imports vLLM once (~seconds)."""

    def __init__(self):
        self._machine = _Machine()

    def select(self, config: MoEConfig, moe_backend: str = "auto") -> OracleAnswer:
        """vLLM's answer for `config`; raises `Inexpressible` for inputs vLLM cannot be given."""
        _check_expressible(config)
        switches = _switches(config)
        refusal = _dispatcher_refusal(config)
        if refusal:     # vLLM's selection would pick experts for a dispatcher it cannot build
            return OracleAnswer(vllm_family(config), error=refusal)
        with self._machine.standing_in(config, switches), _vllm_config_context(config):
            family = vllm_family(config)
            try:    # vLLM refuses in FusedMoEConfig.__post_init__ (asserts) or in the select function
                backend, experts = _selection(config, _moe_config(config, moe_backend))()
            except (Inexpressible, VllmUnavailableError):
                raise
            except Exception as error:
                return OracleAnswer(family, error=f"{type(error).__name__}: {error}")
        return OracleAnswer(family, backend=backend.name, experts=experts.__name__ if experts else None)


@contextlib.contextmanager
def _vllm_config_context(config: MoEConfig):
    """vLLM's current config, holding only what selection reads of it: the model type
    (`should_auto_disable_deep_gemm`) and no user quantisation override (mxfp4.py:487)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    if not _VLLM_CONFIG:
        _VLLM_CONFIG.append(VllmConfig())
    vllm_config = _VLLM_CONFIG[0]
    architecture = config.model.architecture
    hf_config = types.SimpleNamespace(model_type=None if architecture == "unknown" else architecture)
    vllm_config.model_config = types.SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config,
                                                     quantization_config=None)
    with set_current_vllm_config(vllm_config):
        yield


_VLLM_CONFIG: list = []
