"""`build(decision, weights)`: the layer a Decision names, on our registered kernels.

An external backend (aiter, flashinfer, ...) may be the right decision for a platform,
but moerules does not ship those kernels. One whose rules name an adapter (`adapter:`, e.g.
oai_triton -> oai.triton_kernels) runs through its package where that package is installed;
any other, or one whose package is missing, fails with a message naming the backend and the
package, never by quietly running something else.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from moerules.config import Routing
from moerules.decision import Decision, Outcome
from moerules.errors import KernelUnavailableError


# Scores and renormalisation of each routing method (vLLM get_routing_method_type, fused_moe/config.py:135-169).
# `renormalize` (top-k of the logits, then softmax) is softmax, top-k, renormalise: the same weights.
_ROUTING_MATH = {Routing.softmax_renormalize: ("softmax", True), Routing.renormalize: ("softmax", True),
                 Routing.softmax: ("softmax", False), Routing.sigmoid: ("sigmoid", False),
                 Routing.sigmoid_renormalize: ("sigmoid", True), Routing.deepseek_v3: ("sigmoid", True),
                 Routing.minimax2: ("sigmoid", True)}
# The methods vLLM names only when the router has an e_score_correction_bias.
BIASED_ROUTING = frozenset({Routing.deepseek_v3, Routing.minimax2})


def routing_for(decision: Decision, *, correction_bias=None):
    """The layer's router settings, from the decision's config (method, groups, scaling factor) and, for
    the biased methods, the router's `correction_bias` tensor (MoEWeights.correction_bias)."""
    from moerules.kernels import RoutingConfig
    model = decision.config.model
    if model.routing not in _ROUTING_MATH:
        raise KernelUnavailableError(f"model.routing={model.routing.value!r} applies the router weights to the "
                                     "layer's input, which moerules kernels do not implement; route outside and "
                                     "scale the input yourself, or pick another routing")
    if model.routing in BIASED_ROUTING and correction_bias is None:
        raise KernelUnavailableError(f"model.routing={model.routing.value!r} needs the router's correction bias "
                                     "(e_score_correction_bias): set MoEWeights.correction_bias to the checkpoint's "
                                     "tensor")
    if model.routing not in BIASED_ROUTING and correction_bias is not None:
        raise KernelUnavailableError(f"MoEWeights.correction_bias is set but model.routing={model.routing.value!r} "
                                     f"takes none (only {', '.join(sorted(r.value for r in BIASED_ROUTING))} do)")
    scoring, renormalize = _ROUTING_MATH[model.routing]
    grouped = model.routing_groups > 1
    return RoutingConfig(top_k=model.top_k, renormalize=renormalize, scoring=scoring,
                         num_expert_group=model.routing_groups if grouped else None,
                         topk_group=model.routing_topk_groups if grouped else None,
                         routed_scaling_factor=model.routed_scaling_factor, e_score_correction_bias=correction_bias)


def build(decision: Decision, weights, *, device=None, routing=None, group=None, placement=None, timeout_s=None,
          shared_experts=None):
    """A runnable MoE layer (prepare -> experts -> finalize) for a selected decision.

    `weights` are `moerules.kernels.MoEWeights` in the decision's quant scheme (see
    `make_random_weights`); they are padded in place, once, as the decision's padding says.

    A decision for several ranks (tp * dp > 1) needs `group`, the torch.distributed process group
    of those ranks, and `weights` must be this rank's shard:
    `shard_weights(global_weights, placement, rank)`. `placement` defaults to `placement_for(decision)`.
    `timeout_s` bounds every collective (default $MOERULES_EP_TIMEOUT_S, else 300 s).
    LoRA adapters on the weights need a decision made with features.lora (without adapters such
    a decision still builds: they can arrive later through `MoELayer.set_lora`).
    `shared_experts`: a callable [T, H] -> [T, H] computing the model's shared experts, added to the output;
    required exactly when the config has model.shared_experts (they are never dropped silently).
    """
    if decision.outcome != Outcome.selected:
        raise KernelUnavailableError(f"cannot build an unsupported decision: {decision.error}")
    _check_buildable(decision)
    if weights.lora is not None and not decision.config.features.lora:
        raise KernelUnavailableError(
            f"the weights carry LoRA adapters but the decision was made without features.lora, so its backend "
            f"{decision.backend!r} was not chosen to apply them; decide again with features.lora=true")
    _shared_experts_check(decision.config.model, shared_experts)
    try:
        from moerules.kernels import KernelBuildError, build_layer
    except ImportError as error:
        raise KernelUnavailableError(f"the kernels need torch (and triton on GPUs): {error}; "
                                     "pip install 'moerules[kernels]'") from None
    config = decision.config
    placement = _parallel_checks(decision, weights, group, placement)
    refusal = None
    if routing is None:
        try:
            routing = routing_for(decision, correction_bias=weights.correction_bias)
        except KernelUnavailableError as error:   # the caller may still route: forward(topk_ids=, topk_weights=)
            refusal = str(error)
    try:
        layer = build_layer(kernel_id=decision.kernel or decision.adapter,
                            prepare_finalize_id=decision.prepare_finalize_kernel,
                            quant=config.quant, activation=config.model.activation, in_dtype=config.model.in_dtype,
                            activation_format=decision.activation_format.value,
                            hidden_pad=decision.padding.hidden_pad, intermediate_pad=decision.padding.intermediate_pad,
                            weight_block=decision.quant.weight_block, weights=weights,
                            device=device if device is not None else weights.device, routing=routing,
                            defer_input_quant=decision.quant.defer_input_quant, group=group, placement=placement,
                            timeout_s=timeout_s, decision_key=_digest(decision) if group is not None else None,
                            shared_experts=shared_experts, swiglu=config.model.swiglu)
    except KernelBuildError as error:
        raise KernelUnavailableError(f"cannot build {decision.backend} behind {decision.prepare_finalize}: "
                                     f"{error}") from None
    layer.routing_refusal = refusal
    return layer


def _shared_experts_check(model, shared_experts) -> None:
    if model.shared_experts and shared_experts is None:
        raise KernelUnavailableError(
            f"model.shared_experts={model.shared_experts} (shared_intermediate_size={model.shared_intermediate_size}): "
            "moerules layers compute the routed experts; pass shared_experts= (a callable [T, H] -> [T, H], e.g. the "
            "model's shared MLP) so the layer adds them, or decide with shared_experts=0 if they run elsewhere")
    if shared_experts is not None and not model.shared_experts:
        raise KernelUnavailableError("shared_experts= was passed but the decision's config has model.shared_experts=0; "
                                     "set model.shared_experts and shared_intermediate_size")


def _digest(decision: Decision) -> str:
    """What the ranks of a group compare: their decisions, byte for byte (decisions are deterministic)."""
    return hashlib.sha256(decision.to_json().encode()).hexdigest()[:16]


def _check_buildable(decision: Decision) -> None:
    """Both components name something we can run here: our kernel, or an adapter whose package is installed."""
    for component, kernel, package in (("experts backend", decision.kernel or decision.adapter,
                                        decision.external_package),
                                       ("prepare/finalize", decision.prepare_finalize_kernel, None)):
        if kernel is None:
            name = decision.backend if component.startswith("experts") else decision.prepare_finalize
            raise KernelUnavailableError(
                f"{component} {name!r} is an external kernel from package {package or 'external'!r}; moerules "
                "decided it for this platform but does not ship it. Install the package and call it, or pin "
                f"one of our backends (features.backend), e.g. {', '.join(decision.alternatives) or 'triton'}")
    if decision.kernel is None:
        try:
            from moerules.kernels.registry import adapter_refusal
        except ImportError:
            return  # build() then says what the kernels need
        missing = adapter_refusal(decision.adapter, decision.config.quant)
        if missing:
            raise KernelUnavailableError(
                f"experts backend {decision.backend!r} runs through adapter {decision.adapter!r}: {missing}; "
                f"or pin one of our backends (features.backend), e.g. {', '.join(decision.alternatives) or 'triton'}")


def ranks_of(decision: Decision) -> int:
    """Ranks one layer of this decision spans: tp * dp, the EP group under EP, else the group the experts
    are tensor-sharded over (both flatten TP across DP)."""
    parallel = decision.config.parallel
    return parallel.tp * parallel.dp


def placement_for(decision: Decision):
    """Where the experts live over the decision's ranks (None for one device): whole experts under EP,
    placed as the rules say (Decision.expert_placement); otherwise a slice of every expert's intermediate size."""
    from moerules.kernels.ep import Placement, PlacementKind
    ranks = ranks_of(decision)
    if ranks == 1:
        return None
    if not decision.config.parallel.use_ep:
        return Placement.tensor(decision.config.model.num_experts, ranks)
    return Placement(PlacementKind(decision.expert_placement.value), decision.config.model.num_experts, ranks)


def _parallel_checks(decision: Decision, weights, group, placement):
    """The placement to build with, once the decision, the group and this rank's weights agree."""
    config, ranks = decision.config, ranks_of(decision)
    where = (f"tp={config.parallel.tp}, dp={config.parallel.dp}, expert_parallel={config.parallel.expert_parallel}, "
             f"dispatcher {decision.prepare_finalize}")
    if ranks == 1:
        if group is not None or placement is not None:
            raise KernelUnavailableError(f"this decision is for one device ({where}); decide with the parallel "
                                         "config the group runs (tp, dp, expert_parallel) to build over a group")
        return None
    if group is None:
        raise KernelUnavailableError(
            f"this decision spans {ranks} ranks ({where}): pass group= (the torch.distributed process group of those "
            f"{ranks} ranks) and this rank's weight shard (moerules.kernels.ep.shard_weights). Built on one device it "
            "would compute only this rank's share of the experts")
    expected = placement_for(decision)
    if placement is None:
        placement = expected
    elif (placement.shards_experts, placement.num_experts, placement.num_ranks) != (
            expected.shards_experts, expected.num_experts, expected.num_ranks):
        raise KernelUnavailableError(f"placement {placement.kind.value} of {placement.num_experts} experts over "
                                     f"{placement.num_ranks} ranks does not fit this decision ({where}, "
                                     f"{config.model.num_experts} experts over {ranks} ranks): use "
                                     f"placement_for(decision) ({expected.kind.value})")
    intermediate = weights.intermediate - (weights.padding[1] if weights.padding else 0)
    if intermediate != config.intermediate_per_partition:
        raise KernelUnavailableError(f"the weights' intermediate size is {intermediate} but each rank of this "
                                     f"decision holds {config.intermediate_per_partition}; pass this rank's shard "
                                     "(moerules.kernels.ep.shard_weights)")
    return placement


def default_device(requested: Optional[str]) -> str:
    if requested:
        return requested
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"
