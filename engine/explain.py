"""Human-readable rendering of a Decision: the winner, the alternatives, every rejection."""

from __future__ import annotations

from moerules.decision import Decision, Outcome


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


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


def explain_text(decision: Decision) -> str:
    out = [decision.describe(), "", f"config: {_config_line(decision)}",
           f"rules:  {decision.rules_hash[:16]}  engine: {decision.engine}"]
    if decision.outcome == Outcome.selected:
        q, pad = decision.quant, decision.padding
        kernel = decision.kernel or (f"adapter {decision.adapter} over " if decision.adapter else "") + \
            f"external package {decision.external_package}"
        out += [
            "",
            f"experts:          {decision.backend} (kernel {kernel}), selected by {decision.selected_by.value}"
            + (f" via {decision.fallback_rule}" if decision.fallback_rule else ""),
            f"prepare/finalize: {decision.prepare_finalize}, {decision.activation_format.value} format, "
            f"{'monolithic' if decision.monolithic else 'modular'}",
            f"quantisation:     by {q.quantized_by.value}; expects_unquantized_inputs={q.expects_unquantized_inputs}; "
            f"dispatch {q.dispatch_dtype}, scale dim {q.scale_dim} x {q.scale_type_size} B  [{', '.join(q.rules)}]",
            f"padding:          hidden +{pad.hidden_pad} -> {pad.hidden_padded}, "
            f"intermediate/partition +{pad.intermediate_pad} -> {pad.intermediate_padded}",
            f"experts on ranks: {decision.expert_placement.value} (ep_size {decision.config.parallel.ep_size})",
            "",
            "alternatives (eligible, in priority order): " + (", ".join(decision.alternatives) or "none"),
        ]
    else:
        out += ["", f"error: {decision.error}"]
    rows = [[r.backend, r.reason.value, r.rule, str(r.source), r.detail] for r in decision.rejections]
    out += ["", f"rejections ({len(rows)}):"] + (_table(["component", "reason", "rule", "where", "detail"], rows)
                                                 if rows else ["  none"])
    return "\n".join(out)
