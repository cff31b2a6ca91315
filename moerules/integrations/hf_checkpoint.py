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
from pathlib import Path
from typing import Optional, Union

import torch

from moerules.kernels.builder import BIASED_ROUTING
from moerules.config import MoEConfig
from moerules.errors import CheckpointError
from moerules.hf_config import ARCHITECTURES, read_hf_config
from moerules.kernels.scheme import TORCH_DTYPE, Scheme
from moerules.kernels.weights import MoEWeights
from moerules.quant import QuantFamily


# Model types by how their checkpoints store the experts; the module names are hf_config.ARCHITECTURES'.
PER_EXPERT = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "kimi_k2",
                        "glm4_moe"})
FUSED_GPT_OSS = frozenset({"gpt_oss"})


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


def load_experts(checkpoint: Union[str, Path], layer: int, *, config: Optional[MoEConfig] = None,
                 device: Union[str, torch.device] = "cpu") -> MoEWeights:
    """The experts (and the router's correction bias) of MoE layer `layer`, in the scheme of `config`
    (default: MoEConfig.from_hf of the checkpoint's config.json). Unsharded: pass this rank's share with
    moerules.kernels.ep.shard_weights."""
    folder = Path(checkpoint)
    hf, _ = read_hf_config(folder)
    config = config if config is not None else MoEConfig.from_hf(hf, layer=layer)
    model_type = config.model.architecture
    if model_type not in PER_EXPERT | FUSED_GPT_OSS:
        raise CheckpointError(f"{folder}: checkpoints of model_type {model_type!r} are not mapped; known: "
                              f"{', '.join(sorted(PER_EXPERT | FUSED_GPT_OSS))}")
    arch = ARCHITECTURES[model_type]
    tensors = _Tensors(folder)
    prefix = f"model.layers.{layer}."
    experts = f"{prefix}{arch.block}.experts."
    if model_type in FUSED_GPT_OSS:
        weights = _gpt_oss(tensors, experts, config)
    else:
        weights = _per_expert(tensors, experts, arch.linears, config)
    if config.model.routing in BIASED_ROUTING:
        weights.correction_bias = tensors.get(f"{prefix}{arch.block}.gate.e_score_correction_bias").float()
    return _to(weights, torch.device(device))


def _scheme(config: MoEConfig, loadable: tuple[str, ...]) -> Scheme:
    scheme = Scheme.from_quant(config.quant)
    if scheme.cell not in loadable:
        raise CheckpointError(f"loading {scheme.cell} experts of model_type {config.model.architecture!r} is not "
                              f"implemented; loadable: {', '.join(loadable)}")
    return scheme


def _per_expert(tensors: _Tensors, prefix: str, linears: tuple[str, str, str], config: MoEConfig) -> MoEWeights:
    scheme = _scheme(config, ("unquantized", "fp8_w8a8/block128/group128"))
    dtype = TORCH_DTYPE[config.model.in_dtype]
    names = [tuple(f"{prefix}{e}.{linear}" for linear in linears) for e in range(config.model.num_experts)]

    def stacked(suffix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13-like [E, 2I, ...]: gate rows then up rows, w2-like [E, H, ...]) of one tensor per linear."""
        return (torch.stack([torch.cat([tensors.get(g + suffix), tensors.get(u + suffix)]) for g, u, _ in names]),
                torch.stack([tensors.get(d + suffix) for _, _, d in names]))

    w13, w2 = stacked(".weight")
    if scheme.weight_dtype is None:
        return MoEWeights(w13=w13.to(dtype), w2=w2.to(dtype), scheme=scheme, in_dtype=config.model.in_dtype)
    if config.model.moe_intermediate_size % 128:
        raise CheckpointError(f"block-FP8 experts with moe_intermediate_size {config.model.moe_intermediate_size} "
                              "(not a multiple of 128): gate and up rows would share 128-row scale blocks")
    s13, s2 = stacked(".weight_scale_inv")
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
