"""Engines over time: byte-stable records, bounded caches that free durable's memory, rule
folders read as one snapshot (hot swap), and decisions pinned to a RuleSet object."""

import gc
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

from moerules import MoEConfig
from moerules.errors import EngineError
from moerules.engine import decide as decide_module
from moerules.engine.decide import Engine, decide, engine_for
from moerules.engine.loader import load_rules
from moerules.presets import preset

RULES = Path(__file__).parents[2] / "rules"
CONFIG = MoEConfig(**{**preset("gpt-oss-120b"), "platform": {"vendor": "cuda", "arch": "sm_90",
                      "packages": ["triton", "flashinfer", "marlin", "deep_gemm", "aiter", "flashinfer"]}})


@pytest.mark.parametrize("engine", ["durable", "reference"])
def test_the_json_record_is_byte_identical_across_hash_seeds(engine):
    if engine == "durable":
        pytest.importorskip("durable_rules_engine")
    command = [sys.executable, "-m", "moerules.tools.cli.main", "decide", "--model", "gpt-oss-120b", "--platform",
               "cuda:sm_90", "--packages", "triton,flashinfer,marlin,deep_gemm,aiter", "--json", "--engine", engine]
    digests = set()
    for seed in range(5):
        out = subprocess.run(command, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
        digests.add(hashlib.sha256(out.encode()).hexdigest())
    assert len(digests) == 1


def _variant(tmp_path: Path, name: str, cuda_order: str) -> Path:
    """A complete rules folder whose CUDA priority list starts with the given backends (and whose
    first file says so too: versions differ in two files, so reading a mix of them shows)."""
    folder = tmp_path / name
    shutil.copytree(RULES, folder)
    components = folder / "10-components.yaml"
    components.write_text(components.read_text().replace("description: Experts backends", f"description: ({name}) Experts backends", 1))
    # A CUDA order in the first file: the first matching `order` wins, so no family's own order shadows it.
    (folder / "00-flip.yaml").write_text(
        f"version: 1\npriorities:\n  - id: flip.cuda\n    when: platform.vendor == cuda\n    order: [{cuda_order}]\n")
    return folder


def test_flipping_a_rules_symlink_never_mixes_versions(tmp_path):
    first = _variant(tmp_path, "a", "triton, marlin")
    second = _variant(tmp_path, "b", "marlin, triton")
    expected = {load_rules(folder).hash: decide(CONFIG, rules=folder).backend for folder in (first, second)}
    assert len(set(expected.values())) == 2
    link = tmp_path / "current"
    link.symlink_to(first)
    stop, flips = threading.Event(), [0]  # odd while a flip is under way

    def flip() -> None:
        while not stop.is_set():
            swap = tmp_path / "swap"
            swap.symlink_to(second if flips[0] % 4 == 0 else first)
            flips[0] += 1
            os.replace(swap, link)  # atomic, like a deployment's `ln -sfn`
            flips[0] += 1
            time.sleep(0.001)

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for _ in range(40):
            decide_module._rulesets = decide_module._Lru(8)  # every call reads the folder while it flips
            before = flips[0]
            decision = decide(CONFIG, rules=link)
            assert expected[decision.rules_hash] == decision.backend  # one version, never a mix
            if flips[0] == before and before % 2 == 0:  # the link held still: the decision is from its target
                assert decision.backend == expected[load_rules(second if before % 4 == 2 else first).hash]
    finally:
        stop.set()
        flipper.join()


def test_a_rule_set_object_pins_its_version(tmp_path):
    folder = _variant(tmp_path, "a", "marlin, triton")
    pinned = load_rules(folder)
    before = decide(CONFIG, rules=pinned)
    (folder / "00-flip.yaml").unlink()
    assert decide(CONFIG, rules=pinned) == before
    assert decide(CONFIG, rules=folder).rules_hash != pinned.hash


def test_engine_and_rule_set_caches_are_bounded_and_free_durable_rulesets(tmp_path):
    pytest.importorskip("durable_rules_engine")
    runners = []
    for version in range(3 * decide_module._engines.size):
        folder = _variant(tmp_path, f"v{version}", ", ".join(["triton"] * (version + 1)))
        runners.append(weakref.ref(engine_for(folder, "durable").runner))
    gc.collect()
    assert len(decide_module._engines._items) == decide_module._engines.size
    assert len(decide_module._rulesets._items) <= decide_module._rulesets.size
    alive = [ref() is not None for ref in runners]
    assert alive == [False] * (len(runners) - decide_module._engines.size) + [True] * decide_module._engines.size


def test_a_dropped_durable_engine_deletes_its_state_then_its_ruleset(monkeypatch):
    """durable's delete_ruleset leaves each state's frame tables allocated: the state goes first."""
    pytest.importorskip("durable_rules_engine")
    from moerules.engine import durable_runner
    calls, real = [], durable_runner._c

    class Recorder:
        def __getattr__(self, name):
            function = getattr(real, name)
            return lambda *args: (calls.append((name, *args)), function(*args))[1]

    engine = Engine(load_rules(), "durable")
    engine.decide(CONFIG)
    handle, sid = engine.runner._handle, engine.runner._sid
    monkeypatch.setattr(durable_runner, "_c", Recorder())
    del engine
    gc.collect()
    assert calls == [("delete_state", handle, sid), ("delete_ruleset", handle)]


def test_a_decision_that_fails_part_way_gives_its_sid_up_and_the_next_one_is_right(tmp_path):
    pytest.importorskip("durable_rules_engine")
    folder = tmp_path / "rules"
    shutil.copytree(RULES, folder)
    (folder / "90-conflict.yaml").write_text(
        "version: 1\nplan:\n  - id: extra.conflicting_quant\n    when: model.top_k == 3\n"
        "    set: {quantized_by: experts, dispatch_dtype: input, scale_dim: 0, scale_type_size: 0}\n")
    ruleset = load_rules(folder)
    durable, reference = Engine(ruleset, "durable"), Engine(ruleset, "reference")
    durable.decide(CONFIG)
    failing = MoEConfig(**{**CONFIG.model_dump(), "model": {**CONFIG.model.model_dump(), "top_k": 3}})
    first_sid = durable.runner._sid
    with pytest.raises(EngineError, match="conflicting rules decide the activation quantization"):
        durable.decide(failing)
    assert durable.runner._sid != first_sid and first_sid not in durable.runner._live
    later = MoEConfig(**{**CONFIG.model_dump(), "model": {**CONFIG.model.model_dump(), "top_k": 2}})
    assert durable.decide(later).model_dump(exclude={"engine"}) == reference.decide(later).model_dump(exclude={"engine"})
