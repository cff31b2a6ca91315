"""Fuzzing the engines: generated, valid but adversarial rule sets (the shipped rules plus a
file of hundreds of constraints, deep and wide conditions, long `in` lists, equality bombs,
`or` chains, hundreds of backends, capability constraints, priorities, plan rules) either
fail to load with a typed error, or build, and then durable-rules and the reference
evaluator decide every drawn config identically. Nothing else escapes, nothing crashes,
nothing hangs.

durable-rules runs in a child process (engine_child.py) fed one case per line, so a crash
or hang fails one example, with its rule file saved, instead of killing pytest.
`--hypothesis-profile=deep` runs 10,000 examples per target (reports/fuzz.md has the last run).
"""

from __future__ import annotations

import json
import pickle
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moerules.resources import default_rules_dir
from moerules.testing import configs

from rule_sets import SHIPPED_BACKENDS, edge_shapes, render, shapes

pytest.importorskip("durable_rules_engine")

HERE = Path(__file__).parent
CHILD = HERE / "engine_child.py"
# A case takes well under a second; one that has not answered in this long is a hang.
CASE_TIMEOUT_S = 30
# Cases per child: a fresh child now and then bounds what a leak could cost. The first deep run's
# children were OOM-killed at 14 GB after ~4,300 cases, when dropped engines leaked their state
# (test_dropped_durable_engines_free_their_memory).
CHILD_CASES = 500
# The deep profile's 100,000 examples would take hours (a case builds two engines); 10,000 per target.
FUZZ = settings(max_examples=min(settings.default.max_examples, 10_000),
                suppress_health_check=[*settings.default.suppress_health_check, HealthCheck.function_scoped_fixture])
# A case's configs; pins include the shipped backends (the generated ones are rarely eligible anyway).
CONFIGS = st.lists(configs(pins=SHIPPED_BACKENDS), min_size=1, max_size=3)


class Child:
    """The long-lived child: `ask` sends one case and waits at most `timeout` seconds for its answer;
    a crash or hang returns None and the next case starts a fresh child."""

    def __init__(self, stderr: Path):
        self.process, self.stderr, self.exit, self.cases = None, stderr, None, 0

    def ask(self, request: dict, timeout: float):
        self.cases += 1
        if self.cases % CHILD_CASES == 0:
            self.close()
        if self.process is None:
            with open(self.stderr, "a") as errors:  # a file, never a pipe nobody reads (it would fill and block)
                # -X faulthandler: a crash writes its signal and the Python stack to stderr
                self.process = subprocess.Popen([sys.executable, "-X", "faulthandler", str(CHILD)], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, stderr=errors, text=True, cwd=HERE)
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:  # died (EOF) or hung (timeout)
            self.exit = "hung" if self.process.poll() is None else f"exit status {self.process.returncode}"
            self.close()
            return None
        return json.loads(line)

    def close(self):
        if self.process is not None:
            self.process.kill()
            self.process.communicate()  # reaps it and closes the pipes
            self.process = None


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    process = Child(tmp_path_factory.mktemp("engine-child") / "stderr.txt")
    yield process
    process.close()


@pytest.fixture
def folder(request, tmp_path_factory):
    """The rule folder of a test's cases: the shipped rules plus one generated file, rewritten per case."""
    path = tmp_path_factory.mktemp(request.node.name)
    shutil.copytree(default_rules_dir(), path, dirs_exist_ok=True)
    return path


def save_failure(text: str, configs_: list, tmp_path_factory) -> Path:
    """The failing rule file and configs, kept where the report can name them."""
    out = tmp_path_factory.getbasetemp() / "engine-fuzz-failures" / f"case-{time.time_ns()}"
    out.mkdir(parents=True)
    (out / "90-fuzz.yaml").write_text(text)
    (out / "configs.pickle").write_bytes(pickle.dumps(configs_))  # repr() of a config does not evaluate back
    return out


def log_case(tmp_path_factory, answer, seconds: float) -> None:
    """One line per case in <basetemp>/engine-fuzz-cases.jsonl: the deep run's numbers come from it."""
    outcome = "crash or hang" if answer is None else answer["load"]
    with open(tmp_path_factory.getbasetemp() / "engine-fuzz-cases.jsonl", "a") as log:
        log.write(json.dumps({"load": outcome, "seconds": round(seconds, 4)}) + "\n")


def check_case(child: Child, folder: Path, text: str, configs_: list, tmp_path_factory,
               timeout: float = CASE_TIMEOUT_S) -> None:
    """The property: typed load error, or two engines that agree on every config."""
    (folder / "90-fuzz.yaml").write_text(text)
    started = time.perf_counter()
    answer = child.ask({"rules": str(folder), "configs": [pickle.dumps(c).hex() for c in configs_]}, timeout)
    log_case(tmp_path_factory, answer, time.perf_counter() - started)
    if answer is None or answer["load"] == "untyped":
        where = save_failure(text, configs_, tmp_path_factory)
        what = f"crashed or hung ({child.exit})" if answer is None else answer["error"]
        pytest.fail(f"the engine child {what}; rule file and configs saved in {where}; its stderr: "
                    f"{child.stderr.read_text()[-2000:]}")
    event(f"load {answer['load']}")
    event(f"case time {'< 1 s' if answer['seconds'] < 1 else '< 5 s' if answer['seconds'] < 5 else '>= 5 s'}")
    if answer["load"] == "typed":
        return
    for durable, reference in zip(answer["durable"], answer["reference"]):
        assert "untyped" not in durable and "untyped" not in reference, (durable, reference)
        assert "please report it" not in durable.get("message", ""), durable
        assert durable == reference
        event("decision" if "decision" in durable else f"typed decide error {durable['error']}")


@FUZZ
@given(shape=shapes(), configs_=CONFIGS)
def test_generated_rule_sets_load_typed_or_engines_agree(child, folder, tmp_path_factory, shape, configs_):
    check_case(child, folder, render(shape), configs_, tmp_path_factory)


@FUZZ
@given(shape=edge_shapes(), configs_=CONFIGS)
def test_rule_sets_at_durable_capacity_edges_load_typed_or_engines_agree(child, folder, tmp_path_factory, shape, configs_):
    check_case(child, folder, render(shape), configs_, tmp_path_factory)


# Resident memory now, not ru_maxrss: a child keeps the peak of the pytest process it was forked from.
LEAK_PROBE = """
import gc, os
from moerules import MoEConfig
from moerules.engine.decide import Engine
from moerules.engine.loader import load_rules
from moerules.presets import preset
rss_mb = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
rules, config = load_rules(), MoEConfig(**preset("mixtral-8x7b"))
Engine(rules, "durable").decide(config)
before = rss_mb()
for _ in range(100):
    Engine(rules, "durable").decide(config)
    gc.collect()
print(rss_mb() - before)
"""


def test_dropped_durable_engines_free_their_memory():
    """Found by the deep fuzz run, whose long-lived children were OOM-killed: durable frees no state
    with its ruleset (~1.6 MB per engine on the shipped rules until the runner deleted it first)."""
    grown_mb = int(subprocess.run([sys.executable, "-c", LEAK_PROBE], capture_output=True, text=True, check=True,
                                  timeout=120).stdout)
    assert grown_mb < 20, f"100 durable engines built, used once and dropped kept {grown_mb} MB"
