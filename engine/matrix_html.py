"""A static, self-contained HTML view of the decision matrix: one table per platform,
one colour per backend, the explanation of each cell on hover."""

from __future__ import annotations

import colorsys
import html

from moerules.engine.matrix import ACTIVATIONS, ALIGNMENTS, PARALLELS, PLATFORMS, QUANTS, _quant_name


def _colour(name: str, names: list[str]) -> str:
    if not name:
        return "#eeeeee"
    hue = names.index(name) / max(len(names), 1)
    r, g, b = colorsys.hls_to_rgb(hue, 0.78, 0.65)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def _explanation(row: dict) -> str:
    if row["outcome"] != "selected":
        return f"{row['outcome']}: {row['failure_reason'] or 'no backend'}; rules: {row['rules']}"
    how = row["selected_by"] + (f" via {row['fallback_rule']}" if row["fallback_rule"] else "")
    return (f"{row['backend']} ({how}) behind {row['prepare_finalize']}; quantised by {row['quantized_by']} "
            f"({row['dispatch_dtype']}, scale dim {row['scale_dim']}); pads +{row['hidden_pad']}/+{row['intermediate_pad']}"
            f"; rules: {row['rules']}")


def render(rows: dict[str, dict], rules_hash: str) -> str:
    backends = sorted({r["backend"] for r in rows.values() if r["backend"]})
    legend = " ".join(f'<span class="c" style="background:{_colour(b, backends)}">{html.escape(b)}</span>'
                      for b in backends)
    parts = [f"""<!doctype html><html><head><meta charset="utf-8"><title>moerules decision matrix</title>
<style>body{{font:13px sans-serif;margin:1em}} table{{border-collapse:collapse;margin-bottom:2em}}
td,th{{border:1px solid #ccc;padding:2px 4px;white-space:nowrap}} td.c,span.c{{cursor:help}}
span.c{{padding:2px 6px;margin:2px;display:inline-block}} th{{background:#f6f6f6;font-weight:normal}}</style>
</head><body><h1>moerules decision matrix</h1>
<p>Auto mode, every kernel package present, rules {html.escape(rules_hash[:16])}. Hover a cell for its explanation;
grey cells are unsupported. Source: <code>matrix/decisions.csv</code> (also pinned and package-less cells).</p>
<p>{legend}</p>"""]
    columns = [(p, lora) for p in PARALLELS for lora in (False, True)]
    for vendor, arch in PLATFORMS:
        parts.append(f"<h2>{vendor} {arch}</h2><table><tr><th>scheme / activation / shape</th>" +
                     "".join(f"<th>{p}{' +lora' if lora else ''}</th>" for p, lora in columns) + "</tr>")
        for quant in QUANTS:
            for activation in ACTIVATIONS:
                for align in ALIGNMENTS:
                    cells = []
                    for parallel, lora in columns:
                        key = "|".join([f"{vendor}:{arch}", _quant_name(quant), parallel, "lora" if lora else "-",
                                        align, activation, "pkg=all", "pin=auto"])
                        row = rows[key]
                        cells.append(f'<td class="c" style="background:{_colour(row["backend"], backends)}" '
                                     f'title="{html.escape(_explanation(row))}">{html.escape(row["backend"] or "-")}</td>')
                    parts.append(f"<tr><th>{_quant_name(quant)} / {activation} / {align}</th>{''.join(cells)}</tr>")
        parts.append("</table>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
