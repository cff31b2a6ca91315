"""A Hugging Face `quantization_config` -> the `quant` section of a MoEConfig (family, granularities, checkpoint).

Methods as vLLM 0.33 reads them for MoE layers: `fp8` (per-tensor, or 128x128 blocks with 1x128 activation
groups), `mxfp4` (gpt-oss: W4A16), `compressed-tensors` (from the weights'/input activations' num_bits,
type and strategy), `modelopt` (FP8, NVFP4, MXFP8), `gptq` and `awq` (4-bit: WNA16). Whatever else is
refused naming the field; nothing is guessed.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Optional

from moerules.errors import HFConfigError

_FIELD = "quantization_config"
_GROUP_GRANULARITY = {128: "group128", 32: "group32", -1: "channel"}


def quant_section(config, source: str, *, expert_module: str) -> dict:
    """QuantConfig fields for a `quantization_config` dict; {} (unquantised) when its exclusion list
    (`modules_to_not_convert`, compressed-tensors' `ignore`) names `expert_module`, an expert's linear."""
    if not isinstance(config, dict):
        raise HFConfigError(_FIELD, f"expected an object, got {config!r}", source=source)
    for field in ("modules_to_not_convert", "ignore"):
        excluded = config.get(field) or []
        if not isinstance(excluded, list) or not all(isinstance(entry, str) for entry in excluded):
            raise HFConfigError(f"{_FIELD}.{field}", f"expected a list of module names, got {excluded!r}", source=source)
        if any(_names(entry, expert_module) for entry in excluded):
            return {}
    method = config.get("quant_method")
    mapper = _METHODS.get(method) if isinstance(method, str) else None
    if mapper is None:
        raise HFConfigError(f"{_FIELD}.quant_method", f"{method!r} is not mapped; known: {', '.join(_METHODS)}",
                            source=source)
    return mapper(config, source)


def _names(entry: str, module: str) -> bool:
    """Whether an exclusion entry covers `module`: a compressed-tensors `re:` pattern, a glob
    (gpt-oss's `model.layers.*.self_attn`), or a module name or suffix (transformers' substring test)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    if any(c in entry for c in "*?["):
        return fnmatchcase(module, entry) or fnmatchcase(module, entry + ".*")
    return entry in module


def _fp8(config: dict, source: str) -> dict:
    block = config.get("weight_block_size")
    dynamic = config.get("activation_scheme", "dynamic")
    if dynamic not in ("dynamic", "static"):
        raise HFConfigError(f"{_FIELD}.activation_scheme", f"{dynamic!r}: expected dynamic or static", source=source)
    if block is None:
        return {"family": "fp8_w8a8", "weight_granularity": "tensor", "activation_granularity": "tensor",
                "activation_dynamic": dynamic == "dynamic"}
    if block != [128, 128]:
        raise HFConfigError(f"{_FIELD}.weight_block_size", f"{block!r}: only 128x128 weight blocks are mapped",
                            source=source)
    if dynamic != "dynamic":
        raise HFConfigError(f"{_FIELD}.activation_scheme", "static: block-FP8 activations are quantised per 1x128 "
                                                           "group, dynamically", source=source)
    return {"family": "fp8_w8a8", "weight_granularity": "block128", "activation_granularity": "group128"}


def _mxfp4(config: dict, source: str) -> dict:
    return {"family": "mxfp4_w4a16"}


def _gptq_awq(config: dict, source: str) -> dict:
    method = config["quant_method"]
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise HFConfigError(f"{_FIELD}.bits", f"{bits!r}: only 4-bit {method} weights (WNA16) are mapped",
                            source=source)
    group = config.get("group_size", config.get("q_group_size", 128))
    if group not in _GROUP_GRANULARITY:
        raise HFConfigError(f"{_FIELD}.group_size", f"{group!r}: mapped group sizes are 128, 32 and -1 (channel)",
                            source=source)
    return {"family": "wna16", "weight_granularity": _GROUP_GRANULARITY[group]}


# ModelOpt's quant_algo -> QuantConfig fields (vLLM modelopt.py: FP8 is per-tensor with static input scales).
_MODELOPT = {"FP8": {"family": "fp8_w8a8", "weight_granularity": "tensor", "activation_granularity": "tensor",
                     "activation_dynamic": False},
             "FP8_PER_CHANNEL_PER_TOKEN": {"family": "fp8_w8a8", "weight_granularity": "channel",
                                           "activation_granularity": "token"},
             "NVFP4": {"family": "nvfp4"}, "MXFP8": {"family": "mxfp8"}}


def _modelopt(config: dict, source: str) -> dict:
    nested = config.get("quantization") if isinstance(config.get("quantization"), dict) else config
    algo = nested.get("quant_algo")
    if algo not in _MODELOPT:
        raise HFConfigError(f"{_FIELD}.quant_algo", f"{algo!r} is not mapped; known: {', '.join(_MODELOPT)}",
                            source=source)
    return {**_MODELOPT[algo], "checkpoint": "modelopt"}


def _compressed_tensors(config: dict, source: str) -> dict:
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise HFConfigError(f"{_FIELD}.config_groups", "missing: compressed-tensors needs at least one scheme",
                            source=source)
    schemes = {name: _ct_scheme(group, f"{_FIELD}.config_groups.{name}", source) for name, group in groups.items()}
    distinct = {tuple(sorted(s.items())) for s in schemes.values()}
    if len(distinct) > 1:
        raise HFConfigError(f"{_FIELD}.config_groups", f"{len(distinct)} different schemes ({', '.join(schemes)}): "
                                                       "which one the experts use is not mapped", source=source)
    return {**next(iter(schemes.values())), "checkpoint": "compressed_tensors"}


def _ct_operand(spec, field: str, source: str) -> Optional[tuple[str, int, str, Optional[int]]]:
    """(type, num_bits, strategy, group_size) of one compressed-tensors operand, or None when absent."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise HFConfigError(field, f"expected an object, got {spec!r}", source=source)
    kind, bits, strategy = spec.get("type"), spec.get("num_bits"), spec.get("strategy")
    if kind not in ("int", "float") or not isinstance(bits, int) or not isinstance(strategy, str):
        raise HFConfigError(field, f"type {kind!r}, num_bits {bits!r}, strategy {strategy!r}: expected int/float, "
                                   "a bit count and a strategy", source=source)
    if strategy == "block" and spec.get("block_structure") not in (None, [128, 128]):
        raise HFConfigError(f"{field}.block_structure", f"{spec.get('block_structure')!r}: only 128x128 blocks "
                                                        "are mapped", source=source)
    return kind, bits, strategy, spec.get("group_size")


# (weight type, bits, activation type or None, bits) -> family.
_CT_FAMILIES = {("float", 8, "float", 8): "fp8_w8a8", ("float", 8, None, None): "fp8_w8a16",
                ("int", 8, "int", 8): "int8_w8a8", ("int", 8, None, None): "int8_w8a16",
                ("int", 4, None, None): "wna16", ("int", 4, "float", 8): "w4a8", ("float", 4, "float", 4): "nvfp4"}
_CT_WEIGHT = {"tensor": "tensor", "channel": "channel", "block": "block128"}
_CT_ACTIVATION = {"tensor": "tensor", "token": "token", "group": "group128"}
# Families whose granularities the family fixes (QuantConfig refuses them as fields).
_FIXED_KEYS = {"w4a8", "nvfp4"}


def _ct_scheme(group, field: str, source: str) -> dict:
    if not isinstance(group, dict):
        raise HFConfigError(field, f"expected an object, got {group!r}", source=source)
    weights = _ct_operand(group.get("weights"), f"{field}.weights", source)
    if weights is None:
        raise HFConfigError(f"{field}.weights", "missing: the experts' weights are not quantised by this scheme",
                            source=source)
    acts = _ct_operand(group.get("input_activations"), f"{field}.input_activations", source)
    key = weights[:2] + (acts[:2] if acts else (None, None))
    family = _CT_FAMILIES.get(key)
    if family is None:
        raise HFConfigError(field, f"weights {weights[0]}{weights[1]} with activations "
                                   f"{f'{acts[0]}{acts[1]}' if acts else 'unquantised'} is not mapped", source=source)
    section = {"family": family}
    if family in _FIXED_KEYS:
        return section
    if family == "wna16":
        group_size = weights[3] if weights[2] == "group" else -1
        if group_size not in _GROUP_GRANULARITY:
            raise HFConfigError(f"{field}.weights.group_size", f"{group_size!r}: mapped are 128, 32 and channel",
                                source=source)
        return {**section, "weight_granularity": _GROUP_GRANULARITY[group_size]}
    if weights[2] not in _CT_WEIGHT:
        raise HFConfigError(f"{field}.weights.strategy", f"{weights[2]!r} is not mapped; known: "
                                                         f"{', '.join(_CT_WEIGHT)}", source=source)
    section["weight_granularity"] = _CT_WEIGHT[weights[2]]
    if acts is not None:
        if acts[2] not in _CT_ACTIVATION:
            raise HFConfigError(f"{field}.input_activations.strategy", f"{acts[2]!r} is not mapped; known: "
                                                                       f"{', '.join(_CT_ACTIVATION)}", source=source)
        section["activation_granularity"] = _CT_ACTIVATION[acts[2]]
        section["activation_dynamic"] = bool(group["input_activations"].get("dynamic", True))
    return section


_METHODS = {"fp8": _fp8, "mxfp4": _mxfp4, "compressed-tensors": _compressed_tensors, "modelopt": _modelopt,
            "gptq": _gptq_awq, "awq": _gptq_awq}
