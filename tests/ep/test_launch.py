"""`torchrun -m moerules.tools.cli.launch`: the documented command runs EP on gloo ranks and matches one device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from moerules.tools.cli.launch import EXIT_INPUT, main

from rank_pool import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/mixtral-ep2-cpu.yaml"


def test_the_example_runs_under_torchrun_and_matches_one_device():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), "-m", "moerules.tools.cli.launch", EXAMPLE,
                           "--json", "--tokens", "16", "--iters", "1", "--timeout", "60", "--dist-backend", "gloo"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert (report["dispatcher"], report["placement"], report["ranks"], report["dist_backend"]) == (
        "all2all", "contiguous", 2, "gloo")
    assert report["within_tolerance"] and report["rel_err_vs_single_device"] < 1e-5   # fp32 layer


def test_the_launcher_refuses_a_rank_count_the_config_does_not_span(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main([str(ROOT / EXAMPLE)]) == EXIT_INPUT
    assert capsys.readouterr().err.strip() == (
        "moerules.tools.cli.launch: the config spans 2 ranks (tp=1 x dp=2) but torchrun started 4; "
        "use --nproc-per-node 2 or change tp/dp")


def test_the_launcher_needs_torchrun(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert main([str(ROOT / EXAMPLE)]) == EXIT_INPUT
    assert "runs under torchrun" in capsys.readouterr().err
