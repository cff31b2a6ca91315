"""The matrix page: the auto-mode cells with every kernel package present, as JSON inside one
self-contained HTML file (no network): filters, sticky headers, a legend, and for each cell the
winner, the other eligible backends in rank order, and the rules that decided it."""

from __future__ import annotations

import html
import itertools
import json
import math
from typing import Optional

from moerules.tools import pool
from moerules.engine.decide import Engine
from moerules.tools.matrix import (ACTIVATIONS, ALIGNMENTS, PARALLELS, PLATFORMS, QUANTS, Cell, _cell, _quant_name,
                                    beaten, decide_config, ranking)
from moerules.tools.progress import Progress
from moerules.engine.ruleset import RuleSet
from moerules.errors import EngineError
from moerules.config import MoEConfig

DIMENSIONS = ("platform", "family", "parallel", "lora", "shape", "activation")


def page_cells(platforms=PLATFORMS) -> list[tuple[tuple, Cell]]:
    """(dimension values, cell) for every page cell: the auto-mode product with every package."""
    return [((f"{vendor}:{arch}", _quant_name(quant), parallel, "lora" if lora else "-", align, activation),
             _cell((vendor, arch), quant, parallel, lora, align, activation, "all", "auto"))
            for (vendor, arch), quant, parallel, lora, align, activation
            in itertools.product(platforms, QUANTS, PARALLELS, (False, True), ALIGNMENTS, ACTIVATIONS)]


def explain(engine: Engine, config: MoEConfig) -> dict:
    """What the page shows of a cell: winner, eligible alternatives, the ranking rules, and for each
    backend the decision had to rule out its first rejection (rule, reason, how many more)."""
    try:
        d = decide_config(engine, config)
    except EngineError as error:
        return {"outcome": "error", "backend": "", "alternatives": [], "selected_by": "", "fallback_rule": "",
                "failure_reason": str(error), "prepare_finalize": "", "ranking": [], "ruled_out": []}
    order, ranked_by = ranking(engine, d)
    ruled_out = []
    for backend in beaten(order, d):
        reasons = [r for r in d.rejections if r.backend == backend]
        if reasons:
            ruled_out.append([backend, reasons[0].rule, reasons[0].detail, len(reasons) - 1])
    return {"outcome": d.outcome.value, "backend": d.backend or "", "alternatives": list(d.alternatives),
            "selected_by": d.selected_by.value if d.selected_by else "", "fallback_rule": d.fallback_rule or "",
            "failure_reason": d.failure_reason.value if d.failure_reason else "",
            "prepare_finalize": d.prepare_finalize or "", "ranking": ranked_by, "ruled_out": ruled_out}


def build(ruleset: RuleSet, evaluator: str = "auto", cells: Optional[list[tuple[tuple, Cell]]] = None, *,
          cache_root=None, workers: Optional[int] = None,
          progress: Optional[Progress] = None) -> list[tuple[tuple, dict]]:
    """(dimension values, explanation) of every page cell (default: `page_cells()`), through the decision cache."""
    chosen = page_cells() if cells is None else cells
    explained = pool.evaluate_all(explain, ruleset, [c.config for _, c in chosen], evaluator=evaluator,
                                  cache_root=cache_root, workers=workers, progress=progress)
    return [(values, e) for (values, _), e in zip(chosen, explained)]


class _Strings:
    """Interning: each distinct string once in the page, referred to by its index."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        return self.index.setdefault(text, len(self.index))


def _record(e: dict, s: _Strings, ruled_out: _Strings) -> list:
    return [s(e["backend"]), s(e["outcome"]), [s(a) for a in e["alternatives"]], s(e["selected_by"]),
            s(e["fallback_rule"]), s(e["failure_reason"]), s(e["prepare_finalize"]), [s(r) for r in e["ranking"]],
            [ruled_out(json.dumps([s(b), s(rule), s(detail), more])) for b, rule, detail, more in e["ruled_out"]]]


def base_layer() -> str:
    """What every page cell shares, read off one of them."""
    config = _cell(PLATFORMS[0], QUANTS[0], "single", False, "aligned", ACTIVATIONS[0], "all", "auto").config
    return (f"{config.model.num_experts} experts, top-{config.model.top_k}, {config.model.in_dtype.value} inputs, "
            f"every kernel package installed ({len(config.platform.packages)}), backend {config.features.backend}")


def _multiple(n: int) -> str:
    power = n & -n
    return "a multiple of 256" if power >= 256 else f"a multiple of {power}, not of {2 * power}"


def legend() -> dict[str, dict[str, str]]:
    """What each shape, parallel layout and scheme of the page means, from the matrix's own definitions."""
    return {
        "shape": {name: ", ".join(f"{k}={v} ({_multiple(v)})" for k, v in sizes.items())
                  for name, sizes in ALIGNMENTS.items()},
        "parallel": {name: ", ".join(f"{k}={v}" for k, v in layout.items()) or "one GPU, no parallelism"
                     for name, layout in PARALLELS.items()},
        "family": {_quant_name(q): ", ".join(f"{k}={v}" for k, v in q.items()) for q in QUANTS},
        "lora": {"-": "features.lora=false", "lora": "features.lora=true"},
    }


def page_data(explained: list[tuple[tuple, dict]], rules_hash: str) -> dict:
    """The page's JSON: the values of each dimension, interned strings, rejections and explanations,
    and one explanation index per cell, the cells in the order of the dimensions' product."""
    strings, ruled_out, records = _Strings(), _Strings(), _Strings()
    values: list[dict[str, int]] = [{} for _ in DIMENSIONS]
    cells = []
    for dims, e in explained:
        for known, value in zip(values, dims):
            known.setdefault(value, len(known))
        cells.append(records(json.dumps(_record(e, strings, ruled_out))))
    if len(cells) != math.prod(len(v) for v in values):
        raise ValueError("page cells must be a full product of their dimensions (see page_cells)")
    supported: dict[str, int] = {}
    for dims, e in explained:
        supported[dims[0]] = supported.get(dims[0], 0) + (e["outcome"] == "selected")
    return {"rules_hash": rules_hash, "base_layer": base_layer(), "legend": legend(),
            "dimensions": {name: list(v) for name, v in zip(DIMENSIONS, values)},
            "default_platform": max(supported, key=lambda p: (supported[p], -list(supported).index(p))),
            "strings": list(strings.index), "ruled_out": [json.loads(r) for r in ruled_out.index],
            "records": [json.loads(r) for r in records.index], "cells": cells}


def render(explained: list[tuple[tuple, dict]], rules_hash: str) -> str:
    data = json.dumps(page_data(explained, rules_hash), separators=(",", ":")).replace("</", "<\\/")
    return _PAGE.replace("@TITLE@", html.escape(f"moerules decision matrix ({rules_hash[:12]})")).replace(
        "@DATA@", data)


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>@TITLE@</title>
<style>
html,body{height:100%;margin:0}
body{font:13px system-ui,sans-serif;display:flex;flex-direction:column}
#bar{flex:none;padding:.5em 1em;border-bottom:1px solid #ccc}
#scroll{flex:1;overflow:auto}
#bar label{margin-right:1em}
#index{display:flex;flex-wrap:wrap;gap:.1em .8em}
#index a{white-space:nowrap}
#index a.on{font-weight:bold}
table{border-collapse:separate;border-spacing:0}
th,td{border:1px solid #ddd;padding:2px 5px;white-space:nowrap}
thead th{position:sticky;top:0;background:#f4f4f4;z-index:2}
thead th:first-child{left:0;z-index:3}
tbody th{position:sticky;left:0;background:#fafafa;text-align:left;font-weight:normal;z-index:1}
tr.platform th{background:#e8e8f4;font-weight:bold}
td{cursor:pointer}
td.none{color:#999;background:#f2f2f2}
td.dim{opacity:.25}
td.picked{outline:2px solid #000}
#panel{position:fixed;right:1em;bottom:1em;width:34em;max-height:45vh;overflow:auto;background:#fffff4;
border:1px solid #aaa;padding:.5em 1em;box-shadow:0 2px 8px #0003;z-index:4}
#panel:empty{display:none}
dl.legend dt{font-weight:bold}
dl.legend{max-height:30vh;overflow:auto}
dl.legend dd{margin:0 0 .3em 1.5em}
</style></head><body>
<div id="bar">
<b>moerules decision matrix</b> <span id="about"></span>
<div id="filters"></div>
<div id="index"></div>
<details><summary>Legend: what each shape, layout and scheme means</summary>
<dl class="legend" id="legend"></dl></details>
</div>
<div id="scroll"><table id="grid"><thead></thead><tbody></tbody></table></div>
<div id="panel"></div>
<script id="data" type="application/json">@DATA@</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const S = D.strings, DIMS = Object.keys(D.dimensions), V = D.dimensions;
const FILTERS = ["platform", "family", "parallel", "shape", "activation", "backend"];
const state = {platform: D.default_platform};
// Cell i of the dimensions' product (platform slowest, activation fastest): its value indices, then its record.
D.cells = D.cells.map((rec, i) => { const c = [];
  for (const dim of [...DIMS].reverse()) { c.unshift(i % V[dim].length); i = Math.floor(i / V[dim].length); }
  return [...c, rec]; });
const winners = [...new Set(D.records.filter(r => S[r[1]] === "selected").map(r => S[r[0]]))].sort();
const el = (tag, attrs, text) => { const e = document.createElement(tag);
  Object.assign(e, attrs || {}); if (text !== undefined) e.textContent = text; return e; };
const hue = name => { let h = 0; for (const c of name) h = (h * 31 + c.charCodeAt(0)) % 360; return h; };
const cellKey = c => [V.platform[c[0]], V.family[c[1]], V.parallel[c[2]], V.lora[c[3]], V.shape[c[4]],
  V.activation[c[5]], "pkg=all", "pin=auto"].join("|");

function record(c) {
  const r = D.records[c[6]];
  return {backend: S[r[0]], outcome: S[r[1]], alternatives: r[2].map(i => S[i]), selected_by: S[r[3]],
    fallback_rule: S[r[4]], failure_reason: S[r[5]], prepare_finalize: S[r[6]], ranking: r[7].map(i => S[i]),
    ruled_out: r[8].map(i => D.ruled_out[i])
      .map(x => ({backend: S[x[0]], rule: S[x[1]], reason: S[x[2]], more: x[3]}))};
}

function summary(r) {
  if (r.outcome !== "selected") return `${r.outcome}: ${r.failure_reason}`;
  const how = r.selected_by + (r.fallback_rule ? ` via ${r.fallback_rule}` : "");
  return `${r.backend} (${how})` + (r.alternatives.length ? `; then ${r.alternatives.join(", ")}` : "");
}

function buildFilters() {
  const box = document.getElementById("filters");
  for (const name of FILTERS) {
    const choices = name === "backend" ? winners : V[name];
    const select = el("select", {id: "filter-" + name});
    select.append(el("option", {value: ""}, "all"), ...choices.map(v => el("option", {value: v}, v)));
    select.value = state[name] || "";
    select.onchange = () => { state[name] = select.value; draw(); };
    const label = el("label", {}, name + " ");
    label.append(select);
    box.append(label);
  }
}

function buildIndex() {
  const box = document.getElementById("index");
  box.append(el("span", {}, "platforms:"));
  for (const p of V.platform) {
    const cells = D.cells.filter(c => V.platform[c[0]] === p);
    const ok = cells.filter(c => S[D.records[c[6]][1]] === "selected").length;
    const a = el("a", {href: "#", title: `${ok} of ${cells.length} cells have a backend`},
      `${p} (${ok}/${cells.length})`);
    a.dataset.platform = p;
    a.onclick = ev => { ev.preventDefault(); state.platform = p;
      document.getElementById("filter-platform").value = p; draw(); };
    box.append(a);
  }
}

function buildLegend() {
  const dl = document.getElementById("legend");
  dl.append(el("dt", {}, "every cell"), el("dd", {}, D.base_layer + "; rules " + D.rules_hash));
  for (const [dim, entries] of Object.entries(D.legend))
    for (const [name, meaning] of Object.entries(entries))
      dl.append(el("dt", {}, `${dim} ${name}`), el("dd", {}, meaning));
  dl.append(el("dt", {}, "grey cell"), el("dd", {}, "no backend can run this layer (click for why)"));
}

const keep = (c, dim, i) => !state[dim] || V[dim][c[i]] === state[dim];

function draw() {
  document.querySelectorAll("#index a").forEach(a => a.classList.toggle("on", a.dataset.platform === state.platform));
  const cells = D.cells.filter(c => keep(c, "platform", 0) && keep(c, "family", 1) && keep(c, "parallel", 2)
    && keep(c, "shape", 4) && keep(c, "activation", 5));
  const columns = [...new Set(cells.map(c => c[2] * 2 + c[3]))].sort((a, b) => a - b);
  const head = document.querySelector("#grid thead"), body = document.querySelector("#grid tbody");
  const top = el("tr");
  top.append(el("th", {}, "family / activation / shape"),
    ...columns.map(k => el("th", {title: D.legend.parallel[V.parallel[k >> 1]]},
      V.parallel[k >> 1] + (k & 1 ? " +lora" : ""))));
  head.replaceChildren(top);
  const rows = new Map();
  for (const c of cells) {
    const id = [c[0], c[1], c[5], c[4]].join(",");
    if (!rows.has(id)) rows.set(id, {c, by: new Map()});
    rows.get(id).by.set(c[2] * 2 + c[3], c);
  }
  const out = [];
  let platform = -1;
  for (const {c, by} of rows.values()) {
    const tds = columns.map(k => by.has(k) ? cellTd(by.get(k)) : el("td", {}, ""));
    if (state.backend && !tds.some(td => td.dataset.backend === state.backend)) continue;
    if (c[0] !== platform) {
      platform = c[0];
      const tr = el("tr", {className: "platform"});
      tr.append(el("th", {colSpan: columns.length + 1}, V.platform[platform]));
      out.push(tr);
    }
    const tr = el("tr");
    tr.append(el("th", {}, `${V.family[c[1]]} / ${V.activation[c[5]]} / ${V.shape[c[4]]}`), ...tds);
    out.push(tr);
  }
  body.replaceChildren(...out);
}

function cellTd(c) {
  const r = record(c), td = el("td", {title: summary(r)}, r.backend || "\\u2014");
  td.dataset.cell = cellKey(c);
  td.dataset.backend = r.backend;
  if (r.outcome !== "selected") td.className = "none";
  else td.style.background = `hsl(${hue(r.backend)},65%,85%)`;
  if (state.backend && r.backend !== state.backend) td.classList.add("dim");
  td.onmouseenter = () => { if (!document.querySelector("td.picked")) show(c); };
  td.onclick = () => { document.querySelectorAll("td.picked").forEach(t => t.classList.remove("picked"));
    td.classList.add("picked"); show(c); };
  return td;
}

function show(c) {
  const r = record(c), panel = document.getElementById("panel");
  const dl = el("dl");
  const row = (name, value, id) => dl.append(el("dt", {}, name), el("dd", {id: "panel-" + id}, value));
  row("cell", cellKey(c), "cell");
  row("winner", r.outcome === "selected" ? r.backend : `none (${r.outcome}: ${r.failure_reason})`, "winner");
  if (r.outcome === "selected")
    row("selected by", r.selected_by + (r.fallback_rule ? ` via rule ${r.fallback_rule}` : ""), "by");
  row("alternatives (eligible, in rank order)", r.alternatives.join(", ") || "none", "alternatives");
  row("ranked by", r.ranking.join(", ") || "no priority rule", "ranking");
  const list = el("ul", {id: "panel-ruled-out"});
  for (const x of r.ruled_out)
    list.append(el("li", {}, `${x.backend}: ${x.rule} \\u2014 ${x.reason}` + (x.more ? ` (+${x.more} more)` : "")));
  dl.append(el("dt", {}, r.outcome === "selected" ? "deciding rules: ranked ahead of it but ruled out" :
    "deciding rules: every ranked backend ruled out"),
    el("dd", {}, list.childElementCount ? "" : "none: it ranks first"));
  dl.lastChild.append(list);
  row("dispatcher", r.prepare_finalize || "none", "dispatcher");
  panel.replaceChildren(dl);
}

document.getElementById("about").textContent =
  `${D.cells.length} cells (auto mode, every package): pick filters, hover or click a cell.`;
buildFilters(); buildIndex(); buildLegend(); draw();
</script></body></html>
"""
