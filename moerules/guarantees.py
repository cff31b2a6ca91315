"""What each public function guarantees: the typed error it raises, and for what.

One declaration for three readers: the README's "Guarantees" table is rendered from it
(`python -m moerules.guarantees` prints it; tests/test_guarantees.py fails when the README is stale), and
the same test triggers every row, so a row that stops being true, or a row without a trigger, fails CI.
Anything not listed here that escapes a public function is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Guarantee:
    function: str   # as integrators call it
    raises: str     # the exception class, importable from moerules.errors unless qualified
    when: str


GUARANTEES = [
    Guarantee("moerules.decide", "UnknownBackendError", "features.backend names no backend of the rule set "
              "(lists the valid names, with a did-you-mean)"),
    Guarantee("moerules.decide", "BackendRejectedError", "the rules reject the pinned backend (carries the full "
              "Decision: the rule, its file:line, the eligible alternatives)"),
    Guarantee("moerules.decide", "RuleSetError", "the rules path is missing, unreadable, or holds malformed rule "
              "files (every error, each at file:line:col)"),
    Guarantee("moerules.decide", "TypeError", "config is not a MoEConfig (MoEConfig.model_validate builds one)"),
    Guarantee("moerules.decide", "ValueError", "engine is not auto, durable or reference"),
    Guarantee("moerules.explain", "RuleSetError", "as decide; a rejected pin is explained, not raised"),
    Guarantee("moerules.load_rules", "RuleSetError", "as decide, for the rules path given"),
    Guarantee("moerules.MoEConfig.model_validate", "pydantic.ValidationError", "a field is unknown, of the wrong "
              "type, or out of its range (each field named)"),
    Guarantee("moerules.build", "KernelUnavailableError", "the decision is unsupported, names an external kernel, "
              "does not fit the group, weights or adapters, or the kernels refuse to build (KernelBuildError's "
              "reason, ranks that disagree included)"),
    Guarantee("moerules.kernels.build_layer", "KernelBuildError", "unknown kernel or dispatcher id, a cell, "
              "activation or dtype the kernel lacks, weights of another scheme, a missing package or device, a "
              "group without a placement, or ranks that built different layers"),
    Guarantee("moerules.kernels.MoEWeights", "KernelInputError", "a tensor whose last dimension is strided, or "
              "tensors on several devices"),
    Guarantee("moerules.kernels.MoEWeights", "ValueError", "w13 and w2 do not form a gated or non-gated pair"),
    Guarantee("moerules.kernels.MoELayer.forward", "KernelInputError", "x, router_logits, topk_ids or "
              "topk_weights of the wrong shape, dtype or device, ids out of range, ids and weights swapped, or "
              "neither routing input given (a strided x is copied, never misread)"),
    Guarantee("moerules.kernels.MoELayer.forward", "InconsistentRanksError", "expert-parallel ranks run batches "
              "of another top_k, width or dtype (the same error on every rank, before the exchange)"),
    Guarantee("moerules.kernels.MoELayer.forward", "CollectiveError", "a peer rank failed, exited or missed a "
              "collective: within the collective timeout, never a hang"),
    Guarantee("moerules.kernels.MoELayer.forward", "CapacityError", "an expert-parallel batch larger than the "
              "exchange capacity agreed at the first forward (before any collective), or (token, rank) pairs past a "
              "reserved rows_per_peer (their tokens' outputs are NaN): never a silent drop"),
    Guarantee("moerules.kernels.ep.shard_weights", "PlacementError", "experts or the intermediate size do not "
              "split evenly over the ranks, or the weights were already padded"),
    Guarantee("moerules.kernels.ep.init_distributed", "CollectiveError", "the process group does not form within "
              "the timeout"),
    Guarantee("moerules.tools.cli.run.run_example", "RequestError", "a device that is not here, tokens outside 1 "
              "to 65,536, or weights over --max-gib or the memory available, before anything is allocated"),
]


def render() -> str:
    """The README table."""
    lines = ["| function | raises | when |", "|---|---|---|"]
    lines += [f"| `{g.function}` | `{g.raises}` | {g.when} |" for g in GUARANTEES]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
