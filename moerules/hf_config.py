"""Hugging Face `config.json` -> the model and quant sections of a `MoEConfig` (`MoEConfig.from_hf`).

Plain dicts in, plain dicts out: transformers is not imported. Each supported `model_type` names the
config fields that hold its routed-expert count and per-expert size (Mixtral, OLMoE, Granite and gpt-oss
call it `intermediate_size`; the Qwen/DeepSeek/GLM families mean the dense MLP by that name and the
experts' by `moe_intermediate_size`), how it routes, which layers are MoE and which shared experts each
MoE layer runs. Anything that does not map is a `HFConfigError` naming the field, never a guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from moerules.activation import SwigluParams
from moerules.errors import HFConfigError
from moerules.hf_quant import quant_section


@dataclass(frozen=True)
class HFLayers:
    """Which decoder layers are MoE, which are dense MLPs, and the shared experts each MoE layer runs."""

    moe_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]
    shared_experts: int
    shared_intermediate_size: int

    def describe(self) -> str:
        dense = f"dense MLP layers {_ranges(self.dense_layers)}" if self.dense_layers else "no dense MLP layers"
        shared = (f"{self.shared_experts} shared expert(s) of {self.shared_intermediate_size}" if self.shared_experts
                  else "no shared experts")
        return f"MoE layers {_ranges(self.moe_layers)}, {dense}; {shared} per MoE layer"


def _ranges(layers: tuple[int, ...]) -> str:
    if not layers:
        return "none"
    spans, start = [], layers[0]
    for previous, current in zip(layers, layers[1:] + (None,)):
        if current != previous + 1:
            spans.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ",".join(spans)


class _Reader:
    """Typed access to one config dict, every failure naming the field."""

    def __init__(self, data: dict, source: str, prefix: str = ""):
        self.data, self.source, self.prefix = data, source, prefix

    def error(self, name: str, message: str) -> HFConfigError:
        return HFConfigError(self.prefix + name, message, source=self.source)

    def get(self, name: str, kind: type, default=None, *, required: bool = False):
        value = self.data.get(name, default)
        if value is None:
            if required:
                raise self.error(name, "missing; a MoE layer cannot be described without it")
            return None
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            raise self.error(name, f"expected {kind.__name__}, got {value!r}")
        return value

    def first(self, names: tuple[str, ...], kind: type):
        """The first of `names` present (config.json spellings, then transformers' attribute names)."""
        present = next((name for name in names if self.data.get(name) is not None), names[0])
        return self.get(present, kind, required=True)

    def nested(self, name: str) -> "_Reader":
        return _Reader(self.get(name, dict, {}), self.source, f"{self.prefix}{name}.")


# -- architectures --------------------------------------------------------------------------------------
def _every_layer(r: _Reader, layer: int) -> bool:
    return True


def _qwen_sparse(r: _Reader, layer: int) -> bool:
    """Qwen2/3-MoE: every `decoder_sparse_step`-th layer, minus `mlp_only_layers` (modeling_qwen3_moe)."""
    step = r.get("decoder_sparse_step", int, 1)
    return layer not in r.get("mlp_only_layers", list, []) and step > 0 and (layer + 1) % step == 0


def _deepseek_dense_first(r: _Reader, layer: int) -> bool:
    """DeepSeek-V2/V3, Kimi, GLM-4-MoE: dense below `first_k_dense_replace`, then every `moe_layer_freq`-th."""
    return layer >= r.get("first_k_dense_replace", int, 0) and layer % r.get("moe_layer_freq", int, 1) == 0


def _llama4_interleaved(r: _Reader, layer: int) -> bool:
    """Llama-4: the explicit `moe_layers` list, else every `interleave_moe_layer_step`-th layer."""
    listed = r.get("moe_layers", list)
    if listed is not None:
        return layer in listed
    step = r.get("interleave_moe_layer_step", int, 1)
    return step > 0 and (layer + 1) % step == 0


def _no_shared(r: _Reader, experts_size: int) -> tuple[int, int]:
    return 0, 0


def _deepseek_shared(r: _Reader, experts_size: int) -> tuple[int, int]:
    count = r.get("n_shared_experts", int, 0)
    return count, count * experts_size


def _qwen2_shared(r: _Reader, experts_size: int) -> tuple[int, int]:
    size = r.get("shared_expert_intermediate_size", int, 0)
    return (1, size) if size else (0, 0)


def _granite_shared(r: _Reader, experts_size: int) -> tuple[int, int]:
    size = r.get("shared_intermediate_size", int, 0)
    return (1, size) if size else (0, 0)


def _llama4_shared(r: _Reader, experts_size: int) -> tuple[int, int]:
    return 1, experts_size


def _fixed(routing: str) -> Callable[[_Reader], dict]:
    return lambda r: {"routing": routing}


def _norm_topk(default: bool) -> Callable[[_Reader], dict]:
    """Softmax over all experts, top-k, renormalised iff `norm_topk_prob` (Qwen, OLMoE)."""
    return lambda r: {"routing": "softmax_renormalize" if r.get("norm_topk_prob", bool, default) else "softmax"}


def _deepseek_v2_routing(r: _Reader) -> dict:
    """Softmax scores; `group_limited_greedy` keeps the best `topk_group` of `n_group` groups."""
    method = r.get("topk_method", str, "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise r.error("topk_method", f"{method!r} is not a DeepSeek-V2 routing; known: greedy, group_limited_greedy")
    fields = {"routing": "softmax_renormalize" if r.get("norm_topk_prob", bool, False) else "softmax",
              "routed_scaling_factor": r.get("routed_scaling_factor", float, 1.0)}
    if method == "group_limited_greedy":
        fields.update(routing_groups=r.get("n_group", int, required=True),
                      routing_topk_groups=r.get("topk_group", int, required=True))
    return fields


def _biased_grouped_routing(r: _Reader) -> dict:
    """DeepSeek-V3, Kimi-K2, GLM-4-MoE: sigmoid scores steered by e_score_correction_bias, group-limited,
    renormalised, scaled (vLLM RoutingMethodType.DeepSeekV3, fused_moe/config.py:150-156)."""
    scoring = r.get("scoring_func", str, "sigmoid")
    if scoring != "sigmoid":
        raise r.error("scoring_func", f"{scoring!r}: only sigmoid scoring with the correction bias is mapped")
    if not r.get("norm_topk_prob", bool, True):
        raise r.error("norm_topk_prob", "false: vLLM has no routing method for biased sigmoid routing without "
                                        "renormalisation (RoutingMethodType.Unspecified)")
    return {"routing": "deepseek_v3", "routing_groups": r.get("n_group", int, 1),
            "routing_topk_groups": r.get("topk_group", int, 1),
            "routed_scaling_factor": r.get("routed_scaling_factor", float, 1.0)}


def _gpt_oss(r: _Reader) -> dict:
    """Top-k of the logits, then softmax; clamped SwiGLU with (up + 1) on interleaved rows; expert biases."""
    return {"routing": "renormalize", "activation": "swigluoai", "has_bias": True,
            "swiglu_limit": r.get("swiglu_limit", float, SwigluParams.limit),
            "swiglu_alpha": r.get("swiglu_alpha", float, SwigluParams.alpha)}


@dataclass(frozen=True)
class _Architecture:
    experts: tuple[str, ...]                       # fields that may hold the routed expert count
    intermediate: str                              # field holding the per-expert intermediate size
    routing: Callable[[_Reader], dict]             # routing (and activation) fields of the model section
    is_moe_layer: Callable[[_Reader, int], bool] = _every_layer
    shared: Callable[[_Reader, int], tuple[int, int]] = _no_shared
    text_config: bool = False                      # the decoder's fields sit under `text_config`
    block: str = "mlp"                             # the MoE block's module name in the checkpoint's decoder layers
    linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")   # an expert's (gate, up, down) modules


# transformers 5 writes num_local_experts for every model type (its attribute_map); config.json files do not.
_LOCAL, _NUM, _ROUTED = ("num_local_experts",), ("num_experts", "num_local_experts"), ("n_routed_experts",
                                                                                      "num_local_experts")
ARCHITECTURES: dict[str, _Architecture] = {
    "mixtral": _Architecture(_LOCAL, "intermediate_size", _fixed("softmax_renormalize"), block="block_sparse_moe",
                             linears=("w1", "w3", "w2")),
    "qwen2_moe": _Architecture(_NUM, "moe_intermediate_size", _norm_topk(False), _qwen_sparse,
                               _qwen2_shared),
    "qwen3_moe": _Architecture(_NUM, "moe_intermediate_size", _norm_topk(True), _qwen_sparse),
    "olmoe": _Architecture(_NUM, "intermediate_size", _norm_topk(False)),
    "granitemoe": _Architecture(_LOCAL, "intermediate_size", _fixed("renormalize"), block="block_sparse_moe",
                                linears=("input_linear", "input_linear", "output_linear")),
    "granitemoeshared": _Architecture(_LOCAL, "intermediate_size", _fixed("renormalize"), block="block_sparse_moe",
                                      linears=("input_linear", "input_linear", "output_linear"), shared=_granite_shared),
    "deepseek_v2": _Architecture(_ROUTED, "moe_intermediate_size", _deepseek_v2_routing,
                                 _deepseek_dense_first, _deepseek_shared),
    "deepseek_v3": _Architecture(_ROUTED, "moe_intermediate_size", _biased_grouped_routing,
                                 _deepseek_dense_first, _deepseek_shared),
    "kimi_k2": _Architecture(_ROUTED, "moe_intermediate_size", _biased_grouped_routing,
                             _deepseek_dense_first, _deepseek_shared),
    "glm4_moe": _Architecture(_ROUTED, "moe_intermediate_size", _biased_grouped_routing,
                              _deepseek_dense_first, _deepseek_shared),
    "gpt_oss": _Architecture(_LOCAL, "intermediate_size", _gpt_oss, linears=("gate_up_proj", "gate_up_proj", "down_proj")),
    "llama4": _Architecture(_LOCAL, "intermediate_size", _fixed("llama4"), _llama4_interleaved,
                            _llama4_shared, text_config=True, block="feed_forward",
                            linears=("gate_up_proj", "gate_up_proj", "down_proj")),
}
# transformers' text-only model types read like their multimodal parent.
ARCHITECTURES["llama4_text"] = _Architecture(_LOCAL, "intermediate_size", _fixed("llama4"),
                                             _llama4_interleaved, _llama4_shared, block="feed_forward",
                                             linears=("gate_up_proj", "gate_up_proj", "down_proj"))

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh"}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def read_hf_config(source: Union[str, Path, dict]) -> tuple[dict, str]:
    """(the config dict, how messages name it): a dict, a config.json path, or a model folder holding one."""
    if isinstance(source, dict):
        return source, "config"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise HFConfigError("config.json", f"cannot read it: {error.strerror or error}", source=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HFConfigError("config.json", f"not valid JSON: {error}", source=str(path)) from None
    if not isinstance(data, dict):
        raise HFConfigError("config.json", "a Hugging Face config is a JSON object", source=str(path))
    return data, str(path)


def _architecture(data: dict, source: str) -> tuple[_Architecture, _Reader, str]:
    model_type = data.get("model_type")
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise HFConfigError("model_type", f"{model_type!r} is not a MoE architecture moerules maps; known: "
                                          f"{', '.join(sorted(ARCHITECTURES))}", source=source)
    reader = _Reader(data, source)
    return arch, reader.nested("text_config") if arch.text_config else reader, model_type


def hf_layers(source: Union[str, Path, dict]) -> HFLayers:
    """Which layers of the model are MoE and which dense, and its shared experts."""
    data, name = read_hf_config(source)
    arch, r, _ = _architecture(data, name)
    return _layers(arch, r)


def _layers(arch: _Architecture, r: _Reader) -> HFLayers:
    count = r.get("num_hidden_layers", int, required=True)
    moe = tuple(i for i in range(count) if arch.is_moe_layer(r, i))
    shared, shared_size = arch.shared(r, r.get(arch.intermediate, int, required=True))
    return HFLayers(moe_layers=moe, dense_layers=tuple(i for i in range(count) if i not in moe),
                    shared_experts=shared, shared_intermediate_size=shared_size)


def hf_sections(source: Union[str, Path, dict], *, layer: Optional[int] = None) -> dict:
    """The `model` and `quant` sections of a MoEConfig for the MoE layers (or MoE layer `layer`) of a model."""
    data, name = read_hf_config(source)
    arch, r, model_type = _architecture(data, name)
    layers = _layers(arch, r)
    if not layers.moe_layers:
        raise r.error("num_hidden_layers", f"no MoE layer: {layers.describe()}")
    if layer is not None and layer not in layers.moe_layers:
        raise r.error("num_hidden_layers", f"layer {layer} is not a MoE layer ({layers.describe()}); there is no "
                                           "MoE decision to make for it")
    model = {"num_experts": r.first(arch.experts, int),
             "top_k": r.get("num_experts_per_tok", int, required=True),
             "hidden_size": r.get("hidden_size", int, required=True),
             "moe_intermediate_size": r.get(arch.intermediate, int, required=True),
             "activation": _activation(r), "in_dtype": _dtype(r, data), "architecture": model_type,
             "shared_experts": layers.shared_experts, "shared_intermediate_size": layers.shared_intermediate_size}
    model.update(arch.routing(r))
    quantization = data.get("quantization_config")
    index = layer if layer is not None else layers.moe_layers[0]
    expert = f"model.layers.{index}.{arch.block}.experts.0.{arch.linears[0]}"
    quant = quant_section(quantization, name, expert_module=expert) if quantization is not None else {}
    return {"model": model, "quant": quant}


def _activation(r: _Reader) -> str:
    act = r.get("hidden_act", str, "silu")
    if act not in _ACTIVATIONS:
        raise r.error("hidden_act", f"{act!r} is not mapped; known: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[act]


def _dtype(r: _Reader, data: dict) -> str:
    """The activation dtype: `dtype` (transformers 5) or `torch_dtype`, of the decoder or the whole model."""
    for reader in (r, _Reader(data, r.source)):
        for name in ("dtype", "torch_dtype"):
            value = reader.get(name, str)
            if value is not None:
                if value not in _DTYPES:
                    raise reader.error(name, f"{value!r} is not an activation dtype; known: {', '.join(_DTYPES)}")
                return _DTYPES[value]
    return "bf16"
