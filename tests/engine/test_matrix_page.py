"""The matrix page: what it says of a cell, its legend, its size, and the page itself in a real
headless Chromium, filtered the way a reader would, against `moerules decide` for the same layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moerules.config import Package
from moerules.tools import matrix_html
from moerules.engine.decide import Engine
from moerules.engine.loader import load_rules
from moerules.tools.matrix import decide_config, ranking

CHROMIUM = Path("/usr/bin/chromium")
# Set by scripts/test.sh (CI), which installs Chromium and playwright: there the browser test must run.
REQUIRED = os.environ.get("MOERULES_REQUIRE_BROWSER") == "1"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
GFX950_MXFP4_TP4 = "rocm:gfx950|mxfp4_w4a16|tp4|-|aligned|silu|pkg=all|pin=auto"
# The same layer as a user writes it: what `moerules decide` reads.
GFX950_MXFP4_TP4_CONFIG = """\
model: {num_experts: 16, top_k: 2, hidden_size: 4096, moe_intermediate_size: 4096, activation: silu}
quant: {family: mxfp4_w4a16}
parallel: {tp: 4}
platform: {vendor: rocm, arch: gfx950, packages: [%s]}
"""


@pytest.fixture(scope="module")
def ruleset():
    return load_rules()


@pytest.fixture(scope="module")
def page(ruleset):
    """The whole page, as `moerules matrix` writes it."""
    return matrix_html.render(matrix_html.build(ruleset), ruleset.hash)


@pytest.fixture(scope="module")
def page_cells():
    return matrix_html.page_cells()


def test_a_cell_shows_the_winner_the_alternatives_and_why_those_ranked_ahead_lost(ruleset, page_cells):
    engine = Engine(ruleset)
    [config] = [c.config for _, c in page_cells if c.key == GFX950_MXFP4_TP4]
    shown, decision = matrix_html.explain(engine, config), decide_config(engine, config)
    order, ranked_by = ranking(engine, decision)
    assert (shown["backend"], shown["alternatives"]) == (decision.backend, list(decision.alternatives))
    assert shown["ranking"] == ranked_by and ranked_by[0].startswith("mxfp4.")
    assert [b for b, *_ in shown["ruled_out"]] == order[:order.index(decision.backend)]
    for backend, rule, reason, more in shown["ruled_out"]:
        rejections = [(r.rule, r.detail) for r in decision.rejections if r.backend == backend]
        assert (rule, reason) == rejections[0] and more == len(rejections) - 1


def test_the_legend_defines_every_shape_and_layout_on_the_page(page_cells):
    legend = matrix_html.legend()
    assert legend["shape"] == {
        "aligned": "hidden_size=4096 (a multiple of 256), moe_intermediate_size=4096 (a multiple of 256)",
        "unaligned": "hidden_size=2880 (a multiple of 64, not of 128), moe_intermediate_size=2880 (a multiple of 64, "
                     "not of 128)"}
    assert matrix_html.base_layer() == \
        f"16 experts, top-2, bf16 inputs, every kernel package installed ({len(Package)}), backend auto"
    assert legend["parallel"]["single"] == "one GPU, no parallelism"
    assert legend["parallel"]["tp2_ep"] == "tp=2, expert_parallel=True"
    assert legend["family"]["fp8_w8a8/channel@compressed_tensors"] == \
        "family=fp8_w8a8, weight_granularity=channel, checkpoint=compressed_tensors"
    values = {dim: {v[i] for v, _ in page_cells} for i, dim in enumerate(matrix_html.DIMENSIONS)}
    assert all(values[dim] == set(legend[dim]) for dim in ("shape", "parallel", "family", "lora"))


def test_the_page_is_under_a_megabyte_and_needs_no_network(page):
    assert len(page.encode()) < 1_000_000
    assert "http://" not in page and "https://" not in page and " src=" not in page


def _sync_playwright():
    """playwright's entry point and Chromium, or a skip (a failure where scripts/test.sh installed them)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "playwright is not installed (pip install -e '.[browser]')"
    else:
        if CHROMIUM.is_file():
            return sync_playwright
        missing = f"{CHROMIUM} is absent (apt-get install -y chromium; scripts/test.sh does it as root)"
    if REQUIRED:
        pytest.fail(f"the browser test must run here: {missing}")
    pytest.skip(missing)


def decide_with_the_cli(tmp_path: Path) -> dict:
    config = tmp_path / "gfx950-mxfp4-tp4.yaml"
    config.write_text(GFX950_MXFP4_TP4_CONFIG % ", ".join(p.value for p in Package))
    done = subprocess.run([sys.executable, "-m", "moerules.tools.cli.main", "decide", str(config), "--json"],
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_the_page_in_a_browser_filtered_to_gfx950_mxfp4_tp4_shows_what_decide_says(page, tmp_path):
    sync_playwright = _sync_playwright()
    decision = decide_with_the_cli(tmp_path)
    (tmp_path / "index.html").write_text(page, encoding="utf-8")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            view = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            view.on("pageerror", lambda error: errors.append(str(error)))
            view.goto((tmp_path / "index.html").as_uri())
            opening = view.locator("tr.platform th").first.inner_text()
            assert view.locator("thead th").first.evaluate("e => getComputedStyle(e).position") == "sticky"
            for name, value in (("platform", "rocm:gfx950"), ("family", "mxfp4_w4a16"), ("parallel", "tp4")):
                view.select_option(f"#filter-{name}", value)
            shown = view.locator(f'td[data-cell="{GFX950_MXFP4_TP4}"]')
            winner = shown.inner_text()
            shown.click()
            panel = {key: view.locator(f"#panel-{key}").inner_text() for key in ("winner", "alternatives")}
            platforms = view.locator("tr.platform th").all_inner_texts()
            rows = view.locator("tbody tr:not(.platform) th").all_inner_texts()
            columns = view.locator("thead th").all_inner_texts()
            view.select_option("#filter-backend", decision["backend"])
            others = view.locator(f'td:not(.dim):not([data-backend="{decision["backend"]}"])').count()
        finally:
            browser.close()
    assert errors == []
    assert opening == json.loads(page.split('type="application/json">')[1].split("</script>")[0])["default_platform"]
    assert opening != "cuda:sm_70"
    assert (winner, panel["winner"]) == (decision["backend"], decision["backend"])
    assert panel["alternatives"] == (", ".join(decision["alternatives"]) or "none")
    assert platforms == ["rocm:gfx950"] and columns == ["family / activation / shape", "tp4", "tp4 +lora"]
    assert rows == [f"mxfp4_w4a16 / {a} / {s}" for s in ("aligned", "unaligned") for a in ("silu", "swigluoai")]
    assert others == 0
