"""CLI fuzz: malformed invocations of every subcommand end in exit 0, 1 or 2 with a `moerules...` line on
stderr; never a traceback, an "internal error" (the boundary's name for a bug), a crash or a hang.

1,200 generated invocations (tests/fuzz/cli_cases.py) run in this process through `main`, the console
script's entry point, each bounded by an alarm; a sample of them, and the issue's own examples, run
through the real `moerules` console script in subprocesses, so the interpreter's exit path (signals,
buffered output) is covered too.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_cases import LONG_NAME, Files, cases

from moerules.tools.cli.main import main
from moerules.errors import ConfigFileError

IN_PROCESS = 1200
SUBPROCESS_SAMPLE = 24
CASE_TIMEOUT_S = 30
REPO = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = Path(sys.executable).parent / "moerules"


class Hang(BaseException):
    """Raised by the alarm; a BaseException so that the CLI's boundary cannot turn it into an exit code."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return Files(tmp_path_factory.mktemp("cli-fuzz"))


def in_process(argv: list[str]) -> tuple[object, str]:
    """(exit code, or "hang", stderr) of `moerules ARGV` run through main()."""
    err, out = io.StringIO(), io.StringIO()

    def alarm(signum, frame):
        raise Hang()
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as exit_:   # argparse: usage errors (2) and --help (0)
                code = exit_.code
    except Hang:
        code = "hang"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, err.getvalue()


def verdict(code, stderr: str) -> str:
    """'ok', or what broke the contract. (Exit 2 with nothing on stderr is `schema --check` finding stale
    files: it lists them on stdout.)"""
    if code == "hang":
        return "hang"
    if "Traceback" in stderr:
        return "traceback"
    if "internal error" in stderr:
        return "internal error"
    if code not in (0, 1, 2):
        return f"crash (exit {code})"
    if code == 2 and stderr.strip() and not stderr.lstrip().startswith(("moerules", "usage: moerules")):
        return "exit 2 with a message not from moerules"
    return "ok"


def test_a_thousand_malformed_invocations_keep_the_cli_contract(files, monkeypatch):
    monkeypatch.chdir(files.root)   # relative default outputs (matrix/, reports/) land in the fuzz folder
    argvs = cases(files, IN_PROCESS)
    assert {a[0] for a in argvs if a} >= {"decide", "explain", "run", "lint", "schema", "matrix", "diff", "mutate",
                                          "conformance"}
    broken = []
    for argv in argvs:
        code, stderr = in_process(argv)
        result = verdict(code, stderr)
        if result != "ok":
            broken.append((result, [a[:60] for a in argv], stderr[-400:]))
    assert not broken, f"{len(broken)} of {len(argvs)} invocations broke the contract: {broken[:5]}"


def console_script(argv: list[str], cwd: Path = REPO) -> tuple[object, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run([str(CONSOLE_SCRIPT), *argv], capture_output=True, timeout=90, cwd=cwd, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "hang", ""
    code = done.returncode if done.returncode >= 0 else f"signal {-done.returncode}"
    return code, done.stderr.decode("utf-8", "replace")


def issue_examples(files: Files) -> list[list[str]]:
    """The invocations issue 17 found broken (tracebacks, crashes, hangs), through the real script."""
    return [["decide", str(files.root / LONG_NAME)], ["explain", files.configs[0]], ["run", files.configs[1]],
            ["run", files.tiny, "--tokens", "0"], ["run", files.tiny, "--tokens", "-1"],
            ["run", files.tiny, "--tokens", str(10 ** 9)], ["run", files.tiny, "--seed", "-1"],
            ["run", files.tiny, "--seed", str(2 ** 70)], ["run", files.tiny, "--device", "cuda"] if not
            _has_cuda() else ["run", files.tiny, "--device", "cuda:99"], ["run", files.tiny, "--device", "meta"],
            ["run", files.tiny, "--device", "bogus"], ["run", "--model", "deepseek-v3", "--platform", "cpu"],
            ["mutate", "--sample", "-3"], ["schema", "--out", "/proc"],
            ["matrix", "--check", "--out", files.golden[0], "--quiet"], ["lint", "--rules", files.configs[3]]]


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def test_the_real_console_script_keeps_the_contract(files):
    assert CONSOLE_SCRIPT.is_file(), f"{CONSOLE_SCRIPT}: the moerules console script is not installed"
    argvs = issue_examples(files) + cases(files, IN_PROCESS)[::IN_PROCESS // SUBPROCESS_SAMPLE]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda argv: console_script(argv, cwd=files.root), argvs))
    broken = [(verdict(code, err), argv, err[-400:]) for argv, (code, err) in zip(argvs, results)
              if verdict(code, err) != "ok"]
    assert not broken, f"{len(broken)} of {len(argvs)} invocations broke the contract: {broken[:5]}"
    assert results[0] == (2, f"moerules: {files.root / LONG_NAME}: cannot read config file: no such file, or not a "
                             "regular file\n")


def test_debug_shows_the_traceback(files):
    for argv in (["--debug", "decide", files.configs[0]], ["decide", files.configs[0], "--debug"]):
        with pytest.raises(ConfigFileError, match="invalid UTF-8"):
            main(argv)
    code, stderr = console_script(["decide", files.configs[0], "--debug"], cwd=files.root)
    assert code == 1 and "Traceback" in stderr and "ConfigFileError" in stderr


def test_a_bug_behind_the_boundary_is_one_line_that_says_so(monkeypatch, files):
    import moerules.tools.cli.main as cli
    monkeypatch.setattr(cli, "cmd_decide", lambda args: {}["boom"])
    code, stderr = in_process(["decide", files.tiny])
    assert code == 2 and stderr == ("moerules: internal error: KeyError: 'boom' (a bug in moerules: rerun with "
                                    "--debug for the traceback and report it)\n")
