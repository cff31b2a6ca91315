"""Wall times of the every-edit tools: matrix (cold and warm decision cache), lint (static, full),
diff between two git refs. Each step is a fresh `moerules` process, as a rule author runs it.

    python bench/tools.py [--old HEAD~1] [--new HEAD] [--out bench/results/tools_cpu.md]

CPU seconds (the processes' user+sys) are printed beside wall seconds: on a shared machine the
load average at the start says how much of the wall time was spent waiting for a core.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moerules.tools.pool import cpu_count


def timed(label: str, args: list[str], env: dict) -> tuple[str, float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "moerules.tools.cli.main", *args], env=env, capture_output=True,
                            text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"{label:24s} {wall:7.1f} s wall {cpu:7.1f} s CPU  load {load:4.1f}  exit {result.returncode}: {last}",
          flush=True)
    return label, wall, cpu, f"{load:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="HEAD~1", help="diff's old side (git ref or rules folder)")
    parser.add_argument("--new", default="HEAD", help="diff's new side")
    parser.add_argument("--out", help="also write the table here (markdown)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moerules-bench-") as cache:
        env = {**os.environ, "MOERULES_CACHE_DIR": cache}
        steps = [("matrix, cold cache", ["matrix", "--check"]), ("matrix, warm cache", ["matrix", "--check"]),
                 ("lint, static checks", ["lint", "--static"]), ("lint, full (cold coverage)", ["lint"]),
                 ("lint, full (warm)", ["lint"])]
        rows = [timed(label, command, env) for label, command in steps]
        diff = ["diff", args.old, args.new]
        rows.append(timed(f"diff {args.old} {args.new}, cold", diff, {**env, "MOERULES_CACHE_DIR": cache + "/diff"}))
        rows.append(timed(f"diff {args.old} {args.new}, warm", diff, {**env, "MOERULES_CACHE_DIR": cache + "/diff"}))
    table = "\n".join([f"# moerules tools: wall times ({cpu_count()} CPUs usable, {os.cpu_count()} present; "
                       f"{platform.processor() or platform.machine()}, Python {platform.python_version()})", "",
                       "| step | wall s | CPU s | load avg at start |", "|---|---|---|---|"] +
                      [f"| {label} | {wall:.1f} | {cpu:.1f} | {load} |" for label, wall, cpu, load in rows]) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
