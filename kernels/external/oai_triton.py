"""`oai.triton_kernels`: OpenAI's triton_kernels MXFP4 MoE (`matmul_ogs`) behind our `Experts` interface.

What vLLM 0.33 ranks first for gpt-oss on Hopper (oracle/mxfp4.py:402-435, the `TRITON` backend). Facts
taken from vLLM's use of the package (experts/gpt_oss_triton_kernels_moe.py:703-848, 864-978 and
quantization/utils/mxfp4_utils.py:65-170), for the triton_kernels generation that has `SparseMatrix`
(Triton 3.6): the weights are laid out once for Hopper (`oai_layout`, then the package's value and scale
swizzles); per call, the top-k ids become a bitmatrix and routing metadata, GEMM1 gathers the tokens
and fuses bias and swiglu, GEMM2 adds its bias, applies the router weights and scatters back, summing
over k. The package is imported when the layer is built, never at import time.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from moerules.activation import Activation

from ..activations import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from ..interfaces import Experts
from ..weights import MoEWeights
from .oai_layout import OaiMxfp4Weights, from_oai_layout, to_oai_layout

BITS_PER_WORD = 32
# vLLM's Hopper settings: scale swizzle for 8 warps, and no split-K (mxfp4_utils.py:95-143).
SCALE_SWIZZLE_WARPS = 8
HOPPER_OPT_FLAGS = {"split_k": 1}


def _tk(name: str):
    return importlib.import_module(f"triton_kernels.{name}")


class OaiTritonExperts(Experts):

    def __init__(self, *, scheme, activation: Activation, kernel_id: str):
        super().__init__(scheme=scheme, activation=activation, kernel_id=kernel_id)
        self._loaded: Optional[dict] = None
        self._weights_id: Optional[int] = None
        self._shapes: dict[str, tuple[int, int]] = {}
        self._groups = (0, 0)

    def load_weights(self, weights: MoEWeights) -> None:
        """Swizzle `weights` once into the Hopper layout and keep the precision configs (vLLM's one-time step)."""
        oai = to_oai_layout(weights)
        tensor, layout = _tk("tensor"), _tk("tensor_details.layout")
        _tk("matmul_ogs_details.opt_flags").update_opt_flags_constraints(HOPPER_OPT_FLAGS)
        value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(
            mx_axis=1, num_warps=SCALE_SWIZZLE_WARPS)
        ogs = _tk("matmul_ogs")
        loaded = {"w13_bias": oai.w13_bias, "w2_bias": oai.w2_bias}
        for name in ("w13", "w2"):
            value = tensor.convert_layout(tensor.wrap_torch_tensor(getattr(oai, name), dtype=tensor.FP4),
                                          value_layout, **value_opts)
            scale = tensor.convert_layout(tensor.wrap_torch_tensor(getattr(oai, f"{name}_scale")), scale_layout,
                                          **scale_opts)
            loaded[name] = value
            loaded[f"{name}_precision"] = ogs.PrecisionConfig(
                weight_scale=scale, flex_ctx=ogs.FlexCtx(rhs_data=_tk("numerics").InFlexData()))
        swiglu = ogs.FnSpecs("swiglu", _tk("swiglu").swiglu_fn, ("alpha", "limit"), reduction_n=2)
        loaded["activation"] = ogs.FusedActivation(swiglu, (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT))
        self._loaded, self._weights_id = loaded, id(weights)
        self._shapes = {name: tuple(getattr(oai, name).shape[-2:]) for name in ("w13", "w13_scale", "w2", "w2_scale")}
        self._groups = (oai.w13_groups, oai.w2_groups)

    def converted_back(self, bias_dtype: torch.dtype) -> dict[str, Optional[torch.Tensor]]:
        """Our layout recovered from the swizzled tensors (unswizzle, then `from_oai_layout`): what tests compare
        with the weights the layer was built from."""
        w = self._loaded
        restored = {name: w[name].storage.layout.unswizzle_data(w[name].storage.data)[..., :rows, :cols]
                    for name, (rows, cols) in self._shapes.items() if not name.endswith("_scale")}
        for name in ("w13", "w2"):
            scale = w[f"{name}_precision"].weight_scale
            rows, cols = self._shapes[f"{name}_scale"]
            restored[f"{name}_scale"] = scale.storage.layout.unswizzle_data(scale.storage.data)[..., :rows, :cols]
        return from_oai_layout(OaiMxfp4Weights(**restored, w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
                                               w13_groups=self._groups[0], w2_groups=self._groups[1]), bias_dtype)

    def apply(self, hidden_q: torch.Tensor, *, weights: MoEWeights, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, a_scale: Optional[torch.Tensor]) -> torch.Tensor:
        if self._weights_id != id(weights):
            raise ValueError(f"{self.kernel_id}: these experts were loaded with other weights (build a layer per "
                             "weight set: the conversion into triton_kernels' layout happens once, at build)")
        w = self._loaded
        routing, gather, scatter = routing_data(topk_ids=topk_ids, topk_weights=topk_weights,
                                                num_experts=weights.num_experts)
        tokens, top_k = topk_ids.shape
        ogs = _tk("matmul_ogs")
        inter = torch.empty((1, tokens * top_k, weights.intermediate), device=hidden_q.device, dtype=hidden_q.dtype)
        out = torch.empty((1, tokens, weights.hidden), device=hidden_q.device, dtype=hidden_q.dtype)
        ogs.matmul_ogs(hidden_q, w["w13"], w["w13_bias"], routing, gather_indx=gather,
                       precision_config=w["w13_precision"], fused_activation=w["activation"], y=inter)
        ogs.matmul_ogs(inter.view(tokens * top_k, weights.intermediate), w["w2"], w["w2_bias"], routing,
                       scatter_indx=scatter, precision_config=w["w2_precision"], gammas=routing.gate_scal, y=out)
        return out.view(tokens, weights.hidden)


def routing_data(*, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """(RoutingData, GatherIndx, ScatterIndx) for matmul_ogs from our top-k (vLLM's make_routing_data).

    A slot of id -1 (an expert on another rank) sets no bit and gets weight -1, the kernel's skip mark.
    The bitmatrix is built with one scatter_add: a token's experts are distinct, so the sum of their bits
    is their OR (int32 wraps at bit 31 to the same bit pattern as uint32).
    """
    tensor, ogs = _tk("tensor"), _tk("matmul_ogs")
    tokens = topk_ids.shape[0]
    words = -(-num_experts // BITS_PER_WORD)
    ids = topk_ids.long()
    valid = ids >= 0
    bit = torch.where(valid, torch.ones_like(ids) << (ids.clamp(min=0) % BITS_PER_WORD), torch.zeros_like(ids))
    packed = torch.zeros((tokens, words), dtype=torch.int32, device=ids.device)
    packed.scatter_add_(1, ids.clamp(min=0) // BITS_PER_WORD, bit.to(torch.int32))
    mask = tensor.Bitmatrix(packed.view(torch.uint32), dtype=tensor.BIT, shape=[tokens, words * BITS_PER_WORD],
                            shape_max=[tokens, None])
    ids16 = topk_ids.to(torch.int16)
    gates = torch.where(valid, topk_weights.to(torch.bfloat16), -1.0)
    sparse = tensor.SparseMatrix(indx=ids16, vals=gates, mask=mask)
    meta = sparse.mask_metadata
    dispatch, combine = meta.row_sorted_indx, meta.col_sorted_indx
    ragged = tensor.make_ragged_tensor_metadata(meta.col_sum, dispatch.shape[0])
    routing = ogs.RoutingData(gates.flatten()[combine], ragged.block_sizes, num_experts, topk_ids.shape[1], ragged)
    return routing, ogs.GatherIndx(combine, dispatch), ogs.ScatterIndx(dispatch, combine)
