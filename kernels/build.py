"""`build_layer`: the one entry point from a decision to a runnable MoE layer."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from moerules.activation import Activation, Dtype, SwigluParams
from moerules.quant import QuantConfig

from .activations import is_interleaved
from .ep.connect import connect
from .errors import KernelBuildError
from .layer import MoELayer, RoutingConfig
from .lora import lora_refusal
from .mx import MX_GROUP
from .registry import ADAPTERS, EXPERTS, PREPARE_FINALIZE, experts_class, experts_spec, package_refusal, \
    prepare_finalize_class
from .scheme import Scheme, UnsupportedScheme
from .weights import MoEWeights, pad_weights


def build_layer(*, kernel_id: str, prepare_finalize_id: str, quant: QuantConfig, activation: Activation,
                in_dtype: Dtype, activation_format: str, hidden_pad: int = 0, intermediate_pad: int = 0,
                weight_block: Optional[int] = None, weights: MoEWeights, device: Union[str, torch.device],
                routing: Optional[RoutingConfig] = None, defer_input_quant: bool = False, group=None, placement=None,
                timeout_s: Optional[float] = None, decision_key: Optional[str] = None,
                shared_experts: Optional[Callable] = None, swiglu: SwigluParams = SwigluParams()) -> MoELayer:
    """Build prepare/finalize + experts over `weights`, or raise KernelBuildError naming the kernel and the reason.

    kernel_id: a registry id ("triton.fused_moe", "torch.grouped_mm", "torch.reference"; batched format:
        "triton.batched_moe", "torch.batched_reference"), or an adapter's ("oai.triton_kernels"), which
        imports its package here and converts `weights` into that package's layout once.
    prepare_finalize_id: "local", "allgather_reducescatter", "all2all" (standard format), "local_batched" or
        "all2all_batched" (batched format).
    quant / activation / in_dtype: the scheme, activation and compute dtype; `weights` must already
        be in that scheme (see `make_random_weights` / `quantize_weights`), gated exactly when the
        activation is, and may carry LoRA adapters (`weights.lora`) if the experts apply them.
    activation_format: "standard" or "batched"; the experts and the prepare/finalize must both produce it.
    hidden_pad / intermediate_pad: zero columns added to H / I (weights are padded in place, once;
        inputs are padded and outputs cut back to the logical hidden size).
    weight_block: K extent of one weight scale as the decision fixed it (`decision.quant.weight_block`):
        32 for MX, 128 for block-128 FP8, 0 when the scale does not vary along K. It must agree with
        the weights' scheme, and is checked before anything converts the weights. None (direct callers
        that name the scheme themselves): the scheme's own block. `moerules.build` always passes the decision's.
    routing: how router_logits are turned into top-k; without it forward needs topk_ids/topk_weights.
    defer_input_quant: the dispatcher ships unquantised activations and the experts quantise them.
    swiglu: swigluoai's clamp limit and sigmoid gain (the model's `swiglu_limit` / `swiglu_alpha`).
    shared_experts: the model's shared experts, a callable [T, H] -> [T, H] run on every token; its output
        is added to the routed experts' (DeepSeek, Qwen2-MoE, Llama-4, GLM-4-MoE).
    group / placement: expert parallelism (kernels/ep): the torch.distributed process group and the
        `Placement` of the experts over its ranks; `weights` are then this rank's shard
        (`shard_weights`). Both or neither; dispatchers that exchange tokens require them.
    timeout_s: bound on every collective (default $MOERULES_EP_TIMEOUT_S, else 300 s).
    decision_key: a digest of the decision the layer is built from (moerules.build passes it).

    Over a group, the ranks then exchange a fingerprint of what each built (decision_key, kernels, scheme,
    activation, dtype, sizes and padding, placement, and the checksum of the global weights a shard was
    cut from, `MoEWeights.origin`): any difference is a KernelBuildError on every rank, naming each field
    and every rank's value, within the collective timeout.
    """
    spec = experts_spec(kernel_id)
    if spec is None:
        raise KernelBuildError(kernel_id, f"unknown kernel id; registered: {', '.join(sorted(EXPERTS))}; "
                                          f"adapters: {', '.join(sorted(ADAPTERS))}")
    missing = spec.package is not None and package_refusal(kernel_id)
    if missing:
        raise KernelBuildError(kernel_id, missing)
    pf_spec = PREPARE_FINALIZE.get(prepare_finalize_id)
    if pf_spec is None:
        raise KernelBuildError(kernel_id, f"unknown prepare/finalize id {prepare_finalize_id!r}; registered: "
                                          f"{', '.join(sorted(PREPARE_FINALIZE))}")
    if activation_format != spec.activation_format:
        raise KernelBuildError(kernel_id, f"activation format {activation_format!r} requested, but these experts "
                                          f"take {spec.activation_format!r}")
    if pf_spec.activation_format != spec.activation_format:
        raise KernelBuildError(kernel_id, f"prepare/finalize {prepare_finalize_id!r} produces "
                                          f"{pf_spec.activation_format!r} activations, the experts take "
                                          f"{spec.activation_format!r}")
    try:
        scheme = Scheme.from_quant(quant)
    except UnsupportedScheme as exc:
        raise KernelBuildError(kernel_id, str(exc)) from None
    for what, value, allowed in (("scheme", scheme.cell, spec.cells),
                                 ("activation", activation.value, {a.value for a in spec.activations}),
                                 ("in_dtype", in_dtype.value, {d.value for d in spec.in_dtypes})):
        if value not in allowed:
            raise KernelBuildError(kernel_id, f"{what} {value!r} is not supported; supported: "
                                              f"{', '.join(sorted(allowed))}")
    if weights.has_bias and not spec.supports_bias:
        raise KernelBuildError(kernel_id, "the weights carry expert biases, which these experts do not support")
    if weights.scheme != scheme or weights.in_dtype != in_dtype:
        raise KernelBuildError(kernel_id, f"weights are {weights.scheme.cell}/{weights.in_dtype.value} but the layer "
                                          f"asks for {scheme.cell}/{in_dtype.value}; quantise them with "
                                          "quantize_weights first")
    if weight_block is not None:
        _check_weight_block(kernel_id, scheme, weight_block)
    if weights.gated != activation.gated:
        rows = "2I (gate and up)" if activation.gated else "I"
        raise KernelBuildError(kernel_id, f"activation {activation.value!r} needs w13 with {rows} rows, but the weights "
                                          f"are {'gated' if weights.gated else 'non-gated'} (w13 "
                                          f"{tuple(weights.w13.shape)}, w2 {tuple(weights.w2.shape)}); make them "
                                          f"with gated={activation.gated}")
    if weights.lora is not None:
        reason = lora_refusal(supports_lora=spec.supports_lora, scheme=scheme)
        if reason:
            raise KernelBuildError(kernel_id, reason)
        try:
            weights.check_lora()
        except ValueError as exc:
            raise KernelBuildError(kernel_id, str(exc)) from None
    device = torch.device(device)
    if weights.device.type != device.type:
        raise KernelBuildError(kernel_id, f"weights are on {weights.device}, the layer is for {device}")
    reason = spec.probe(scheme, in_dtype, device, weights)
    if reason:
        raise KernelBuildError(kernel_id, reason)
    pf_class = prepare_finalize_class(prepare_finalize_id)
    logical_hidden, logical_inter = (d - p for d, p in zip((weights.hidden, weights.intermediate),
                                                           weights.padding or (0, 0)))
    fingerprint = {"decision": decision_key or "", "experts": kernel_id, "dispatcher": prepare_finalize_id,
                   "scheme": scheme.cell, "activation": activation.value, "in_dtype": in_dtype.value,
                   "hidden": f"{logical_hidden}+{hidden_pad}", "intermediate": f"{logical_inter}+{intermediate_pad}",
                   "defer_input_quant": str(defer_input_quant), "bias": str(weights.has_bias)}
    comm = connect(pf_id=prepare_finalize_id, pf_class=pf_class, activation_format=activation_format, group=group,
                   placement=placement, weights=weights, timeout_s=timeout_s, fingerprint=fingerprint)
    if spec.needs_full_mx_groups and scheme.is_mx:
        _check_full_mx_groups(kernel_id, logical_hidden + hidden_pad, logical_inter + intermediate_pad,
                              hidden_pad, intermediate_pad)
    try:
        pad_weights(weights, hidden_pad=hidden_pad, intermediate_pad=intermediate_pad,
                    interleaved=is_interleaved(activation))
    except ValueError as exc:
        raise KernelBuildError(kernel_id, str(exc)) from None
    pf = pf_class(scheme=scheme, hidden_pad=hidden_pad, quantizes_inputs=not defer_input_quant, comm=comm,
                  placement=placement, num_local_experts=weights.num_experts)
    experts = experts_class(kernel_id)(scheme=scheme, activation=activation, kernel_id=kernel_id, swiglu=swiglu)
    experts.load_weights(weights)
    return MoELayer(prepare_finalize=pf, experts=experts, weights=weights, hidden_size=logical_hidden,
                    routing=routing, num_experts=placement.num_experts if placement else weights.num_experts,
                    shared_experts=shared_experts)


def _check_weight_block(kernel_id: str, scheme: Scheme, weight_block: int) -> None:
    """The decision's weight block must be the one the weights were quantised with.

    mxfp8 and block-128 weights are plain fp8 bytes: read with the wrong block (0 above all) they
    would be taken for per-tensor/channel FP8, as vLLM once converted MXFP8.
    """
    expected = scheme.weight_k_block
    if weight_block == expected:
        return
    what = f"K-block {expected}" if expected else "no K-block, 0"
    raise KernelBuildError(kernel_id, f"weight_block={weight_block} disagrees with the weights' scheme {scheme.cell} "
                                      f"({what}); the block must be fixed before the weights are converted: pass "
                                      f"weight_block={expected} (the decision's quant.weight_block), or quantise the "
                                      "weights for the scheme the decision names")


def _check_full_mx_groups(kernel_id: str, hidden: int, intermediate: int, hidden_pad: int,
                          intermediate_pad: int) -> None:
    """These experts step K in whole 32-element MX groups: both GEMM K sizes must be multiples of 32."""
    if hidden % MX_GROUP == 0 and intermediate % MX_GROUP == 0:
        return
    raise KernelBuildError(kernel_id, f"MX weights need hidden ({hidden}) and intermediate ({intermediate}) to be "
                                      f"multiples of {MX_GROUP} after padding (hidden_pad={hidden_pad}, "
                                      f"intermediate_pad={intermediate_pad}); pad them up to the next multiple of "
                                      f"{MX_GROUP} with hidden_pad/intermediate_pad")
