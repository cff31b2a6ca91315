"""One seeded forward of a built layer, checked against `torch.reference` (used by `moerules run`)."""

from __future__ import annotations

from typing import Union

import torch

from .layer import MoELayer
from .prepare_finalize import LocalPrepareFinalize
from .reference import moe_reference
from .routing import fused_topk
from .scheme import TORCH_DTYPE


def run_forward(layer: MoELayer, *, num_tokens: int, seed: int, device: Union[str, torch.device],
                top_k: int = 2) -> dict:
    """Random (seeded) tokens and router logits through `layer`; returns a JSON-able summary.

    Routing uses the layer's RoutingConfig, or plain softmax top-`top_k` when it has none.
    The reference consumes the same prepared (quantised) inputs, so rel_err measures the
    experts kernel alone, in fp32.
    """
    device = torch.device(device)
    w = layer.weights
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, layer.hidden_size, generator=gen, device=device).to(TORCH_DTYPE[w.in_dtype])
    logits = torch.randn(num_tokens, w.num_experts, generator=gen, device=device)
    if layer.routing is not None:
        topk_ids, topk_weights = layer.route(logits)
    else:
        topk_ids, topk_weights = fused_topk(logits, top_k=top_k, renormalize=True)
    out = layer(x, topk_ids=topk_ids, topk_weights=topk_weights)

    # The standard local path quantises the input as every dispatcher must (once, on [T, H]), so it is the
    # yardstick whatever the layer's activation format.
    pf = LocalPrepareFinalize(scheme=w.scheme, hidden_pad=layer.prepare_finalize.hidden_pad)
    prepared = pf.prepare(x, topk_ids=topk_ids, topk_weights=topk_weights, defer_input_quant=False,
                          a13_scale=w.a13_scale)
    ref = moe_reference(prepared.hidden_q, weights=w, topk_ids=topk_ids, topk_weights=topk_weights,
                        a_scale=prepared.a_scale, activation=layer.experts.activation, swiglu=layer.experts.swiglu)
    ref = pf.finalize(ref, prepared=prepared, hidden_size=layer.hidden_size)
    denom = ref.norm().item()
    rel_err = (out.float() - ref).norm().item() / denom if denom else float((out.float() - ref).norm().item())
    return {"kernel_id": layer.kernel_id, "device": str(device), "num_tokens": num_tokens,
            "num_experts": w.num_experts, "hidden": layer.hidden_size, "intermediate": w.intermediate,
            "top_k": topk_ids.shape[1], "scheme": w.scheme.cell, "activation": layer.experts.activation.value,
            "in_dtype": w.in_dtype.value, "lora_rank": w.lora.rank if w.lora is not None else 0,
            "checksum": float(out.double().sum().item()),
            "all_finite": bool(torch.isfinite(out).all().item()), "rel_err_vs_reference": rel_err}
