"""A MoE layer's experts from a Hugging Face safetensors checkpoint, into `MoEWeights`.

Layouts, as the checkpoints on the Hub store them (transformers 5 saves them the same way):
  per expert   model.layers.{L}.{block}.experts.{e}.{gate,up,down}.weight: [I, H], [I, H], [H, I]
               (Mixtral: block_sparse_moe, w1/w3/w2; Qwen, OLMoE, DeepSeek, Kimi, GLM: mlp, *_proj)
               block FP8: `weight` float8_e4m3fn plus `weight_scale_inv` [ceil(N/128), ceil(K/128)]
  gpt-oss      model.layers.{L}.mlp.experts.gate_up_proj [E, H, 2I] (gate and up interleaved along 2I),
               down_proj [E, I, H], gate_up_proj_bias [E, 2I], down_proj_bias [E, H]; MXFP4 stores
               {gate_up,down}_proj_blocks [E, N, K/32, 16] (two e2m1 per byte, low nibble first) and
               _scales [E, N, K/32] (e8m0) in the [N, K] orientation instead.
  DeepSeek-V3, Kimi, GLM-4-MoE: the router's correction bias at model.layers.{L}.mlp.gate.e_score_correction_bias.
Needs torch and safetensors; transformers is not imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from moerules.builder import BIASED_ROUTING
from moerules.config import MoEConfig
from moerules.errors import CheckpointError
from moerules.hf_config import read_hf_config
from moerules.kernels.scheme import TORCH_DTYPE, Scheme
from moerules.kernels.weights import MoEWeights
from moerules.quant import QuantFamily


@dataclass(frozen=True)
class _PerExpert:
    block: str
    gate: str
    up: str
    down: str


_QWEN_STYLE = _PerExpert("mlp", "gate_proj", "up_proj", "down_proj")
LAYOUTS = {"mixtral": _PerExpert("block_sparse_moe", "w1", "w3", "w2"), "qwen2_moe": _QWEN_STYLE,
           "qwen3_moe": _QWEN_STYLE, "olmoe": _QWEN_STYLE, "deepseek_v2": _QWEN_STYLE, "deepseek_v3": _QWEN_STYLE,
           "kimi_k2": _QWEN_STYLE, "glm4_moe": _QWEN_STYLE, "gpt_oss": "fused"}


class _Tensors:
    """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint folder."""

    def __init__(self, folder: Path):
        from safetensors import safe_open
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({folder / name for name in weight_map.values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors files")
        self.handles = [safe_open(str(path), framework="pt") for path in files]
        self.where = {name: handle for handle in self.handles for name in handle.keys()}
        self.folder = folder

    def get(self, name: str) -> torch.Tensor:
        handle = self.where.get(name)
        if handle is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing; the checkpoint's layout is not the "
                                  "Hugging Face one this architecture's config names")
        return handle.get_tensor(name)

    def has(self, name: str) -> bool:
        return name in self.where


def load_experts(checkpoint: Union[str, Path], layer: int, *, config: Optional[MoEConfig] = None,
                 device: Union[str, torch.device] = "cpu") -> MoEWeights:
    """The experts (and the router's correction bias) of MoE layer `layer`, in the scheme of `config`
    (default: MoEConfig.from_hf of the checkpoint's config.json). Unsharded: pass this rank's share with
    moerules.kernels.ep.shard_weights."""
    folder = Path(checkpoint)
    hf, _ = read_hf_config(folder)
    config = config if config is not None else MoEConfig.from_hf(hf, layer=layer)
    layout = LAYOUTS.get(config.model.architecture)
    if layout is None:
        raise CheckpointError(f"{folder}: checkpoints of model_type {config.model.architecture!r} are not mapped; "
                              f"known: {', '.join(sorted(LAYOUTS))}")
    tensors = _Tensors(folder)
    prefix = f"model.layers.{layer}."
    if layout == "fused":
        weights = _gpt_oss(tensors, prefix + "mlp.experts.", config)
    else:
        weights = _per_expert(tensors, prefix + layout.block + ".experts.", layout, config)
    if config.model.routing in BIASED_ROUTING:
        weights.correction_bias = tensors.get(prefix + "mlp.gate.e_score_correction_bias").float()
    return _to(weights, torch.device(device))


def _scheme(config: MoEConfig, loadable: tuple[str, ...]) -> Scheme:
    scheme = Scheme.from_quant(config.quant)
    if scheme.cell not in loadable:
        raise CheckpointError(f"loading {scheme.cell} experts of model_type {config.model.architecture!r} is not "
                              f"implemented; loadable: {', '.join(loadable)}")
    return scheme


def _per_expert(tensors: _Tensors, prefix: str, layout: _PerExpert, config: MoEConfig) -> MoEWeights:
    scheme = _scheme(config, ("unquantized", "fp8_w8a8/block128/group128"))
    dtype = TORCH_DTYPE[config.model.in_dtype]
    names = [(f"{prefix}{e}.{layout.gate}", f"{prefix}{e}.{layout.up}", f"{prefix}{e}.{layout.down}")
             for e in range(config.model.num_experts)]
    if scheme.weight_dtype is None:
        w13 = torch.stack([torch.cat([tensors.get(g + ".weight"), tensors.get(u + ".weight")]) for g, u, _ in names])
        w2 = torch.stack([tensors.get(d + ".weight") for _, _, d in names])
        return MoEWeights(w13=w13.to(dtype), w2=w2.to(dtype), scheme=scheme, in_dtype=config.model.in_dtype)
    if config.model.moe_intermediate_size % 128:
        raise CheckpointError(f"block-FP8 experts with moe_intermediate_size {config.model.moe_intermediate_size} "
                              "(not a multiple of 128): gate and up rows would share 128-row scale blocks")
    w13 = torch.stack([torch.cat([tensors.get(g + ".weight"), tensors.get(u + ".weight")]) for g, u, _ in names])
    s13 = torch.stack([torch.cat([tensors.get(g + ".weight_scale_inv"), tensors.get(u + ".weight_scale_inv")])
                       for g, u, _ in names])
    w2 = torch.stack([tensors.get(d + ".weight") for _, _, d in names])
    s2 = torch.stack([tensors.get(d + ".weight_scale_inv") for _, _, d in names])
    return MoEWeights(w13=w13.to(torch.float8_e4m3fn), w2=w2.to(torch.float8_e4m3fn), scheme=scheme,
                      in_dtype=config.model.in_dtype, w13_scale=s13.float(), w2_scale=s2.float())


def _gpt_oss(tensors: _Tensors, prefix: str, config: MoEConfig) -> MoEWeights:
    scheme = _scheme(config, ("unquantized", "mxfp4_w4a16/group32"))
    family = config.quant.family
    dtype = TORCH_DTYPE[config.model.in_dtype]
    biases = dict(w13_bias=tensors.get(prefix + "gate_up_proj_bias").to(dtype),
                  w2_bias=tensors.get(prefix + "down_proj_bias").to(dtype))
    if family == QuantFamily.unquantized:
        # transformers keeps [E, K, N] (x @ w); ours are [E, N, K] like every Linear.
        return MoEWeights(w13=tensors.get(prefix + "gate_up_proj").transpose(1, 2).contiguous().to(dtype),
                          w2=tensors.get(prefix + "down_proj").transpose(1, 2).contiguous().to(dtype),
                          scheme=scheme, in_dtype=config.model.in_dtype, **biases)
    w13, s13 = _mx_blocks(tensors, prefix + "gate_up_proj")
    w2, s2 = _mx_blocks(tensors, prefix + "down_proj")
    return MoEWeights(w13=w13, w2=w2, scheme=scheme, in_dtype=config.model.in_dtype, w13_scale=s13, w2_scale=s2,
                      **biases)


def _mx_blocks(tensors: _Tensors, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K/32, 16] packed e2m1 blocks and [E, N, K/32] e8m0 scales -> ours: [E, N, K/2] and the scales.

    Both pack two e2m1 codes per byte with the even element in the low nibble (mx.py, and transformers'
    integrations/mxfp4.py), so the bytes are the same, only the last two dims are merged."""
    blocks, scales = tensors.get(name + "_blocks"), tensors.get(name + "_scales")
    if blocks.dim() != 4 or blocks.shape[:3] != scales.shape or blocks.shape[3] != 16:
        raise CheckpointError(f"{name}_blocks {tuple(blocks.shape)} and {name}_scales {tuple(scales.shape)} are not "
                              "an [E, N, K/32, 16] / [E, N, K/32] MXFP4 pair")
    return blocks.reshape(*blocks.shape[:2], -1).to(torch.uint8).contiguous(), scales.to(torch.uint8).contiguous()


def _to(weights: MoEWeights, device: torch.device) -> MoEWeights:
    for field in ("w13", "w2", "w13_bias", "w2_bias", "w13_scale", "w2_scale", "correction_bias"):
        value = getattr(weights, field)
        if value is not None:
            setattr(weights, field, value.to(device))
    return weights
