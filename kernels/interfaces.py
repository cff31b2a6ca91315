"""The two component interfaces of a modular MoE layer, mirroring vLLM's split.

  PrepareFinalize.prepare   x -> (maybe quantised, maybe dispatched) hidden states
  Experts.apply             hidden states -> per-token expert output (already top-k reduced)
  PrepareFinalize.finalize  expert output -> layer output (combine, un-pad)

Two activation formats; the prepare/finalize and the experts of a layer must agree (build_layer checks):
  standard  hidden_q [T, Hp] plus top-k; `Experts.apply` returns [T, Hp], router-weighted and summed over k.
  batched   hidden_q [E_local, max_tokens, Hp] plus `expert_num_tokens`; `BatchedExperts.apply` returns
            [E_local, max_tokens, Hp] *unweighted*; the batched finalize applies the router weights and sums
            over k while it un-batches (see BatchedExperts).

Everything between components that could be swapped silently (topk ids and weights,
scales, biases) is passed by keyword only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from moerules.activation import Activation, SwigluParams

from .quantize import quantize_activation, quantize_activation_batched
from .scheme import Scheme
from .weights import MoEWeights

# Activation formats: "standard" ([tokens, H] plus top-k ids) and "batched" ([E_local, max_tokens, H]
# plus per-expert token counts), as the rules' `format` field names them.
STANDARD = "standard"
BATCHED = "batched"


@dataclass
class PreparedInput:
    """What `prepare` hands to the experts.

    hidden_q: [T, H] (standard) or [E_local, max_tokens, H] (batched) in the quantised dtype, or in
    in_dtype when nothing is quantised or the quantisation is deferred to the experts; a_scale: its
    scale (None when unquantised). expert_num_tokens: int32 [E_local], the valid rows per expert
    (batched format only). handle: whatever the dispatcher must remember between dispatch and
    combine (split sizes, permutations); opaque to the experts.

    Batched format, exactly: hidden_q [E_local, max_tokens, H] with a contiguous last dimension; row r
    of expert e is valid iff r < expert_num_tokens[e] (int32 on the device; the Triton experts never
    read it on the host); rows past the count are padding with undefined contents (NaN included) that
    must never reach an output. a_scale is None, [1] (per tensor), [E_local, max_tokens] (per token)
    or [E_local, max_tokens, cdiv(H, 128)] (per 1x128 group), each contiguous. topk_ids /
    topk_weights stay the rank's own routing [T, k] (global expert ids), for the finalize.
    """

    hidden_q: torch.Tensor
    a_scale: Optional[torch.Tensor]
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    expert_num_tokens: Optional[torch.Tensor] = None
    handle: Optional[object] = None


class PrepareFinalize(ABC):
    """Moves activations to the experts and results back; quantises the activations once.

    `quantizes_inputs` says whether this dispatcher quantises activations (before any
    communication, so the wire carries the quantised dtype). Experts read it to decide
    whether they must quantise themselves.
    """

    # Token-exchanging dispatchers cannot run without a process group; some route by owner rank
    # and so need whole experts per rank (not the tensor placement).
    needs_group: ClassVar[bool] = False
    needs_expert_placement: ClassVar[bool] = False

    def __init__(self, *, scheme: Scheme, hidden_pad: int = 0, quantizes_inputs: bool = True,
                 comm=None, placement=None, num_local_experts: Optional[int] = None):
        self.scheme = scheme
        self.hidden_pad = hidden_pad
        self.quantizes_inputs = quantizes_inputs
        # Expert parallelism (kernels/ep): the process group and where the experts live; None on one device.
        self.comm = comm
        self.placement = placement
        # Experts the paired weights hold (all of them on one rank); batched dispatchers size E_local by it.
        self.num_local_experts = num_local_experts

    @property
    def remote_expert_ids(self) -> bool:
        """True when prepare may hand the experts topk ids of -1: slots whose expert is on another
        rank, or padding rows. The experts must give those slots exactly zero output."""
        return False

    @abstractmethod
    def prepare(self, x: torch.Tensor, *, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                defer_input_quant: bool, a13_scale: Optional[torch.Tensor]) -> PreparedInput:
        ...

    @abstractmethod
    def finalize(self, expert_out: torch.Tensor, *, prepared: PreparedInput, hidden_size: int) -> torch.Tensor:
        """Expert output -> [T, hidden_size] on the rank that owns the tokens; `prepared` is what
        `prepare` returned for this batch (topk ids/weights, dispatcher handle)."""


class Experts(ABC):
    """Computes the experts for already routed (and maybe quantised) tokens.

    What a kernel takes (format, biases, LoRA) is its registry entry (kernels/registry.py), checked
    against the rules' declaration by tests/test_one_declaration.py. `expects_unquantized_inputs` is not a
    constant: it depends on the dispatcher the experts are paired with (`bind`).
    """

    def __init__(self, *, scheme: Scheme, activation: Activation, kernel_id: str,
                 swiglu: SwigluParams = SwigluParams()):
        self.scheme = scheme
        self.activation = activation
        self.swiglu = swiglu  # swigluoai's clamp limit and sigmoid gain (read only by that activation)
        self.kernel_id = kernel_id
        self.prepare_finalize: Optional[PrepareFinalize] = None

    def bind(self, prepare_finalize: PrepareFinalize) -> None:
        self.prepare_finalize = prepare_finalize

    def load_weights(self, weights: MoEWeights) -> None:
        """Called once at build, after padding. Our kernels read `weights` as they are; adapters of external
        kernels convert them here into their package's layout (never per call)."""

    @property
    def expects_unquantized_inputs(self) -> bool:
        """True when these experts quantise the activations themselves.

        That is the case exactly when the scheme quantises activations and the paired
        dispatcher does not. A dispatcher that ships quantised activations (e.g. FP8 dispatch)
        makes it False, so activations are never quantised twice nor skipped.
        """
        if self.prepare_finalize is None:
            raise RuntimeError(f"{self.kernel_id}: experts are not paired with a prepare/finalize yet (call bind)")
        return self.scheme.quantizes_activations and not self.prepare_finalize.quantizes_inputs

    def quantize_gemm_input(self, x: torch.Tensor, *,
                            static_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Quantise a GEMM input per the scheme's activation key (identity for weight-only schemes)."""
        if not self.scheme.quantizes_activations:
            return x, None
        return quantize_activation(x, dtype=self.scheme.act_torch_dtype, granularity=self.scheme.act_granularity,
                                   static_scale=static_scale)

    def gemm1_input(self, hidden_q: torch.Tensor, *, a_scale: Optional[torch.Tensor],
                    weights: MoEWeights) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The GEMM1 operand: as dispatched, or quantised here when the dispatcher deferred it."""
        if self.expects_unquantized_inputs:
            return self.quantize_gemm_input(hidden_q, static_scale=weights.a13_scale)
        return hidden_q, a_scale

    @abstractmethod
    def apply(self, hidden_q: torch.Tensor, *, weights: MoEWeights, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, a_scale: Optional[torch.Tensor]) -> torch.Tensor:
        """-> [T, H] in the layer's in_dtype: sum over k of topk_weight * expert(hidden).

        hidden_q is quantised (with a_scale) unless `expects_unquantized_inputs`, in which
        case it is in in_dtype and a_scale is None.
        """


class BatchedExperts(Experts):
    """Experts over the batched format: one [max_tokens, Hp] batch per local expert.

    `apply` takes the valid-row counts as the keyword `expert_num_tokens` (MoELayer passes
    `prepared.expert_num_tokens` to batched experts only, so standard experts keep their signature)
    and returns [E_local, max_tokens, Hp] in in_dtype: row r < expert_num_tokens[e] is expert e applied
    to hidden_q[e, r] (biases included), NOT multiplied by a router weight; rows past the count may hold
    anything. A dynamic per-tensor scale, of the input when quantisation is deferred or of the
    intermediate, spans the valid rows of all experts and never the padding.
    """

    def gemm1_input(self, hidden_q: torch.Tensor, *, a_scale: Optional[torch.Tensor], weights: MoEWeights,
                    expert_num_tokens: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The GEMM1 operand: as dispatched, or quantised here (valid rows only) when the dispatcher deferred it."""
        if self.expects_unquantized_inputs:
            return quantize_activation_batched(hidden_q, expert_num_tokens=expert_num_tokens,
                                               dtype=self.scheme.act_torch_dtype,
                                               granularity=self.scheme.act_granularity,
                                               static_scale=weights.a13_scale)
        return hidden_q, a_scale

    @abstractmethod
    def apply(self, hidden_q: torch.Tensor, *, weights: MoEWeights, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, a_scale: Optional[torch.Tensor],
              expert_num_tokens: torch.Tensor) -> torch.Tensor:
        """[E_local, max_tokens, Hp] -> [E_local, max_tokens, Hp] per expert, unweighted (see the class doc).

        topk_ids / topk_weights are the rank's routing, passed for symmetry; batched experts need not read them.
        """
