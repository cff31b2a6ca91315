"""`moerules run`: decide, build with seeded random weights (adapters too under features.lora), one checked forward."""

from __future__ import annotations

from typing import Optional

from moerules.builder import BIASED_ROUTING, build, default_device
from moerules.decision import Decision

# Rank of the random adapters a `features.lora` example runs with.
EXAMPLE_LORA_RANK = 8


def run_example(decision: Decision, *, num_tokens: int = 16, seed: int = 0, device: Optional[str] = None) -> dict:
    from moerules.kernels import make_random_lora, make_random_weights
    from moerules.kernels.example import run_forward
    config = decision.config
    device = default_device(device)
    weights = make_random_weights(num_experts=config.model.num_experts, hidden=config.model.hidden_size,
                                  intermediate=config.intermediate_per_partition, quant=config.quant,
                                  in_dtype=config.model.in_dtype, has_bias=config.model.has_bias, seed=seed,
                                  device=device, gated=config.model.activation.gated,
                                  correction_bias=config.model.routing in BIASED_ROUTING)
    if config.features.lora:
        weights.lora = make_random_lora(num_experts=config.model.num_experts, hidden=config.model.hidden_size,
                                        intermediate=config.intermediate_per_partition, rank=EXAMPLE_LORA_RANK,
                                        in_dtype=config.model.in_dtype, gated=config.model.activation.gated,
                                        seed=seed + 1, device=device)
    layer = build(decision, weights, device=device)
    return run_forward(layer, num_tokens=num_tokens, seed=seed, device=device, top_k=config.model.top_k)
