"""Human-readable rendering of a Decision: the winner and why it beat the other eligible backends
(the ranking), the plan, and one decisive rejection per component, wrapped to the terminal."""

from __future__ import annotations

import shutil
import textwrap
from typing import Collection, Optional

from moerules.decision import Decision, Outcome, RankStep
from moerules.engine.misses import by_component, decisive
from moerules.engine.table import table

_FALLBACK_WIDTH = 120  # a pipe or file has no terminal: wide enough for a rule id, file:line and a phrase


def _config_line(decision: Decision) -> str:
    c = decision.config
    m, p, q = c.model, c.parallel, c.quant
    return (f"E={m.num_experts} top_k={m.top_k} hidden={m.hidden_size} moe_intermediate={m.moe_intermediate_size} "
            f"({c.intermediate_per_partition}/partition) {m.activation.value} {m.in_dtype.value} "
            f"{_routing_text(m)} quant={_quant_text(q)} | tp={p.tp} dp={p.dp} ep={p.ep_size} all2all={p.use_all2all} | "
            f"{c.platform.vendor.value} {c.platform.arch} | lora={c.features.lora} requested={decision.requested}")


def _quant_text(quant) -> str:
    """The family and, where it quantises, its weight and activation keys (block128 is what says block-FP8)."""
    keys = [f"{name} {key.granularity.value}" + ("" if name == "w" else " dynamic" if key.dynamic else " static")
            for name, key in (("w", quant.weight_key), ("a", quant.activation_key)) if key is not None]
    return quant.family.value + (f" ({', '.join(keys)})" if keys else "")


def _routing_text(model) -> str:
    groups = (f" groups={model.routing_topk_groups}/{model.routing_groups}" if model.routing_groups > 1 else "")
    shared = f" shared={model.shared_experts}x{model.shared_intermediate_size}" if model.shared_experts else ""
    return f"routing={model.routing.value}{groups}{shared}"


def explain_text(decision: Decision, *, dispatchers: Collection[str] = (), show_all: bool = False,
                 width: Optional[int] = None) -> str:
    """The report. `dispatchers`: the rule set's prepare/finalize ids, whose rejections are shown only
    for the one the layout uses (all of them with `show_all`, which also lists every rejection)."""
    width = width or shutil.get_terminal_size((_FALLBACK_WIDTH, 24)).columns
    out = [decision.describe(), ""] + _wrapped("config: ", _config_line(decision), width) + [
        f"rules:  {decision.rules_hash[:16]}  engine: {decision.engine}"]
    out += _selected_lines(decision, width) if decision.outcome == Outcome.selected else _unsupported_lines(decision)
    out += _ranking_lines(decision, width)
    out += _rejection_lines(decision, dispatchers, show_all, width)
    return "\n".join(out)


def _selected_lines(decision: Decision, width: int) -> list[str]:
    q, pad = decision.quant, decision.padding
    kernel = decision.kernel or (f"adapter {decision.adapter} over " if decision.adapter else "") + \
        f"external package {decision.external_package}"
    fields = [
        ("experts", f"{decision.backend} (kernel {kernel}), selected by {decision.selected_by.value}"
         + _fallback_text(decision)),
        ("prepare/finalize", f"{decision.prepare_finalize}, {decision.activation_format.value} format, "
                             f"{'monolithic' if decision.monolithic else 'modular'}"),
        ("quantisation", f"by {q.quantized_by.value}; expects_unquantized_inputs={q.expects_unquantized_inputs}; "
                         f"dispatch {q.dispatch_dtype}, scale dim {q.scale_dim} x {q.scale_type_size} B  "
                         f"[{', '.join(q.rules)}]"),
        ("padding", f"hidden +{pad.hidden_pad} -> {pad.hidden_padded}, "
                    f"intermediate/partition +{pad.intermediate_pad} -> {pad.intermediate_padded}"),
        ("experts on ranks", f"{decision.expert_placement.value} (ep_size {decision.config.parallel.ep_size})"),
    ]
    return [""] + [line for label, text in fields for line in _wrapped(f"{label + ':':<18}", text, width)]


def _fallback_text(decision: Decision) -> str:
    """' via RULE (file:line), displacing BACKEND' for a fallback: the better-ranked backend the rule took."""
    if not decision.fallback_rule:
        return ""
    # The first better-ranked backend only the fallback rule rejected (as decide found it).
    displaced = next((rejections[0] for name in decision.ranked_ahead()
                      for rejections in [decision.rejections_of(name)]
                      if rejections and all(r.rule == decision.fallback_rule for r in rejections)), None)
    where = f" ({displaced.source}), displacing {displaced.backend}" if displaced else ""
    return f" via {decision.fallback_rule}{where}"


def _unsupported_lines(decision: Decision) -> list[str]:
    return ["", f"unsupported:  {decision.failure_reason.value}",
            f"nearest miss: {decision.nearest_miss or 'none (no candidate backend was rejected)'}"]


# -- the ranking ------------------------------------------------------------------------------
def _ranking_lines(decision: Decision, width: int) -> list[str]:
    if not decision.ranking:
        return ["", "ranking: no platform priority rule matched (only a pinned backend can be chosen)"]
    out = ["", "ranking (the platform priority, then each promote/demote that moved something):"]
    for step in decision.ranking:
        cite = f"; vLLM {step.cite}" if step.cite else ""
        what = "" if step.action == "order" else f"{', '.join(step.moved)} by "
        out += _wrapped(f"  {'base order' if step.action == 'order' else step.action + 's'}: ",
                        f"{what}{step.rule} ({step.source}{cite})", width)
    rejected = {r.backend for r in decision.rejections}
    marks = [name + ("[x]" if name in rejected else "[winner]" if name == decision.backend else "")
             for name in decision.ranking[-1].order]
    out += _wrapped("  final order ([x] rejected): ", ", ".join(marks), width)
    for name in decision.alternatives:
        out += _wrapped(f"  {name} (eligible): ", runner_up_reason(decision, name), width)
    return out


def runner_up_reason(decision: Decision, name: str) -> str:
    """Why an eligible backend lost to the winner: the ranking step that last put it behind."""
    winner = decision.backend
    final = decision.ranking[-1].order if decision.ranking else ()
    if name not in final:
        return "not in the platform priority: eligible only when pinned (features.backend)"
    if decision.selected_by.value == "pinned":
        return f"ranks {final.index(name) + 1} in the priority, but {winner} was pinned"
    deciding = next(step for step in reversed(decision.ranking) if _behind(step, name, winner)
                    and (step is decision.ranking[0] or not _behind(_previous(decision, step), name, winner)))
    if deciding.action == "order":
        return f"ranks below {winner} in the base order {deciding.rule} ({deciding.source})"
    return f"{deciding.action}d behind {winner} by {deciding.rule} ({deciding.source})"


def _behind(step: RankStep, name: str, winner: str) -> bool:
    order = step.order
    return name in order and winner in order and order.index(name) > order.index(winner)


def _previous(decision: Decision, step: RankStep) -> RankStep:
    return decision.ranking[decision.ranking.index(step) - 1]


# -- rejections -------------------------------------------------------------------------------
def _rejection_lines(decision: Decision, dispatchers: Collection[str], show_all: bool, width: int) -> list[str]:
    in_layout = {decision.prepare_finalize} if decision.failure_reason is None or \
        decision.failure_reason.value != "no_dispatcher" else set(dispatchers)
    groups = by_component(decision.rejections)
    hidden = [] if show_all else [name for name in groups if name in dispatchers and name not in in_layout]
    rows = []
    for name, rejections in groups.items():
        if name in hidden:
            continue
        shown = rejections if show_all else [decisive(rejections)]
        for rejection in shown:
            more = f" (+{len(rejections) - 1} more)" if not show_all and len(rejections) > 1 else ""
            rows.append([name, rejection.reason.value + more, rejection.rule, f"{rejection.source}: {rejection.detail}"])
    title = f"rejections ({len(groups)} components, {len(decision.rejections)} rules"
    title += f"; {len(hidden)} dispatchers outside this layout hidden, --all shows them):" if hidden else "):"
    return ["", title] + (table(["component", "decisive reason", "rule", "where: detail"], rows, width) if rows
                          else ["  none"])


def _wrapped(lead: str, text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width=max(width, 40), initial_indent=lead, subsequent_indent=" " * len(lead),
                         break_on_hyphens=False)
