"""`build(decision, weights)`: the layer a Decision names, on our registered kernels.

An external backend (aiter, flashinfer, ...) may be the right decision for a platform,
but moerules does not ship those kernels: building one fails with a message naming the
backend and the package, never by quietly running something else.
"""

from __future__ import annotations

from typing import Optional

from moerules.config import Routing
from moerules.decision import Decision, Outcome
from moerules.errors import KernelUnavailableError


def routing_for(decision: Decision):
    """Router settings for softmax-style routing; others need topk_ids/topk_weights from the caller."""
    from moerules.kernels import RoutingConfig
    model = decision.config.model
    if model.routing in (Routing.softmax_renormalize, Routing.softmax):
        return RoutingConfig(top_k=model.top_k, renormalize=model.routing == Routing.softmax_renormalize)
    return None


def build(decision: Decision, weights, *, device=None, routing=None):
    """A runnable MoE layer (prepare -> experts -> finalize) for a selected decision.

    `weights` are `moerules.kernels.MoEWeights` in the decision's quant scheme (see
    `make_random_weights`); they are padded in place, once, as the decision's padding says.
    """
    if decision.outcome != Outcome.selected:
        raise KernelUnavailableError(f"cannot build an unsupported decision: {decision.error}")
    for component, kernel, package in (("experts backend", decision.kernel, decision.external_package),
                                       ("prepare/finalize", decision.prepare_finalize_kernel, None)):
        if kernel is None:
            name = decision.backend if component.startswith("experts") else decision.prepare_finalize
            raise KernelUnavailableError(
                f"{component} {name!r} is an external kernel from package {package or 'external'!r}; moerules "
                "decided it for this platform but does not ship it. Install the package and call it, or pin "
                f"one of our backends (features.backend), e.g. {', '.join(decision.alternatives) or 'triton'}")
    try:
        from moerules.kernels import KernelBuildError, build_layer
    except ImportError as error:
        raise KernelUnavailableError(f"the kernels need torch (and triton on GPUs): {error}; "
                                     "pip install 'moerules[kernels]'") from None
    config = decision.config
    try:
        return build_layer(kernel_id=decision.kernel, prepare_finalize_id=decision.prepare_finalize_kernel,
                           quant=config.quant, activation=config.model.activation, in_dtype=config.model.in_dtype,
                           activation_format=decision.activation_format.value,
                           hidden_pad=decision.padding.hidden_pad, intermediate_pad=decision.padding.intermediate_pad,
                           weight_block=decision.quant.weight_block, weights=weights, device=device if device is not None else weights.device,
                           routing=routing if routing is not None else routing_for(decision),
                           defer_input_quant=decision.quant.defer_input_quant)
    except KernelBuildError as error:
        raise KernelUnavailableError(f"cannot build {decision.backend} behind {decision.prepare_finalize}: "
                                     f"{error}") from None


def default_device(requested: Optional[str]) -> str:
    if requested:
        return requested
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"
