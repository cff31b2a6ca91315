"""Run a transformers model's MoE blocks on moerules layers: `replace_moe(model, checkpoint)`.

Each MoE block (`model.model.layers[i].mlp`) is swapped for a `MoERulesBlock`: the block's own router
linear computes the logits, the routing the layer's config names (top-k, groups, correction bias,
scaling) picks the experts, a layer built from `decide()` runs them on the weights loaded from the
checkpoint (`hf_checkpoint.load_experts`), and the block's shared experts, if any, are added as
transformers computes them. Architectures whose blocks cannot be reproduced this way are refused by
name, never run half.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from moerules.kernels.builder import build
from moerules.config import MoEConfig
from moerules.decision import Decision
from moerules.errors import KernelUnavailableError
from moerules.hf_config import hf_layers, read_hf_config
from moerules.integrations.hf_checkpoint import load_experts


@dataclass(frozen=True)
class _Block:
    router: str                     # attribute of the block holding the router linear (weight, maybe bias)
    shared: Optional[str] = None    # attribute of the shared experts' MLP
    shared_gate: Optional[str] = None  # Qwen2-MoE: a sigmoid gate on the shared expert's output
    returns_scores: bool = False    # gpt-oss's block returns (hidden_states, router_scores)


_DEEPSEEK_STYLE = _Block("gate", shared="shared_experts")
BLOCKS = {"mixtral": _Block("gate"), "qwen3_moe": _Block("gate"), "olmoe": _Block("gate"),
          "qwen2_moe": _Block("gate", shared="shared_expert", shared_gate="shared_expert_gate"),
          "deepseek_v2": _DEEPSEEK_STYLE, "deepseek_v3": _DEEPSEEK_STYLE, "kimi_k2": _DEEPSEEK_STYLE,
          "glm4_moe": _DEEPSEEK_STYLE, "gpt_oss": _Block("router", returns_scores=True)}


class _GatedShared(torch.nn.Module):
    """Qwen2-MoE's shared expert: its MLP times sigmoid(a one-output linear gate)."""

    def __init__(self, mlp: torch.nn.Module, gate: torch.nn.Module):
        super().__init__()
        self.mlp, self.gate = mlp, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.mlp(x)


def shared_experts_of(block: torch.nn.Module, spec: _Block) -> Optional[torch.nn.Module]:
    """The block's shared experts as one module [T, H] -> [T, H], or None."""
    if spec.shared is None:
        return None
    mlp = getattr(block, spec.shared)
    return _GatedShared(mlp, getattr(block, spec.shared_gate)) if spec.shared_gate else mlp


class MoERulesBlock(torch.nn.Module):
    """A transformers MoE block whose experts, routed and shared, run in a moerules layer."""

    def __init__(self, *, router: torch.nn.Module, shared: Optional[torch.nn.Module], layer, decision: Decision,
                 returns_scores: bool):
        super().__init__()
        self.router, self.shared = router, shared   # registered, so .to() and state_dict() still see them
        self.layer, self.decision, self.returns_scores = layer, decision, returns_scores

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = F.linear(x, self.router.weight, getattr(self.router, "bias", None))
        topk_ids, topk_weights = self.layer.route(logits)
        out = self.layer(x, topk_ids=topk_ids, topk_weights=topk_weights).reshape(hidden_states.shape)
        return (out, topk_weights) if self.returns_scores else out


def _default_decision(config: MoEConfig, layer: int) -> Decision:
    from moerules.engine.decide import decide
    return decide(config)


def replace_moe(model: torch.nn.Module, checkpoint: Union[str, Path], *,
                decision_for: Callable[[MoEConfig, int], Decision] = _default_decision,
                platform=None) -> list[Decision]:
    """Swap every MoE block of `model` (a transformers causal LM of the checkpoint's architecture) for a
    `MoERulesBlock`; returns the decisions, one per MoE layer.

    `checkpoint`: the model folder (config.json and *.safetensors) the experts are loaded from.
    `decision_for(config, layer)`: the decision for MoE layer `layer` given its config (from the
    checkpoint's config.json, on `platform`: default the detected one); default `decide(config)`.
    """
    hf, source = read_hf_config(checkpoint)
    model_type = hf.get("model_type")
    spec = BLOCKS.get(model_type)
    if spec is None:
        raise KernelUnavailableError(f"{source}: MoE blocks of model_type {model_type!r} are not replaced by "
                                     f"moerules layers; supported: {', '.join(sorted(BLOCKS))}")
    if platform is None:
        from moerules.tools.detect import detect
        platform = detect()
    decoder_layers = model.model.layers
    device = next(model.parameters()).device
    decisions = []
    for index in hf_layers(hf).moe_layers:
        config = MoEConfig.from_hf(hf, layer=index, platform=platform)
        decision = decision_for(config, index)
        weights = load_experts(checkpoint, index, config=decision.config, device=device)
        original = decoder_layers[index].mlp
        shared = shared_experts_of(original, spec)
        layer = build(decision, weights, shared_experts=shared)
        decoder_layers[index].mlp = MoERulesBlock(router=getattr(original, spec.router), shared=shared, layer=layer,
                                                  decision=decision, returns_scores=spec.returns_scores)
        decisions.append(decision)
    return decisions
