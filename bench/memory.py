"""Memory over time: RSS while many rule-set versions come and go, and over many decisions.

    python bench/memory.py [--versions 200] [--decisions 1000000] [--engine durable]

Each version is a rules folder edited in place (a new content hash, so a new RuleSet, a new
compiled program and a new durable ruleset); each decision is cold (the configs cycle through
more distinct values than the decision cache holds). RSS should be flat once the bounded caches
are full. Prints RSS (MB) at checkpoints.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from moerules.config import MoEConfig
from moerules.engine import decide as decide_module
from moerules.resources import default_rules_dir

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE / 1e6


def versions(count: int, engine: str, config: MoEConfig) -> None:
    folder = Path(tempfile.mkdtemp(prefix="moerules-versions-")) / "rules"
    shutil.copytree(default_rules_dir(), folder)
    edited = folder / "99-version.yaml"   # one more rule per version: a new content hash each time
    for version in range(1, count + 1):
        edited.write_text(f"version: 1\npriorities:\n  - id: v{version}\n    when: model.top_k > {version + 10000}"
                          "\n    demote: [triton]\n")
        decide_module.decide(config, rules=folder, engine=engine)
        if version in (1, 10, 50, 100, count) or version % 100 == 0:
            gc.collect()
            print(f"rule-set versions {version:>9,}: RSS {rss_mb():8.1f} MB", flush=True)


def decisions(count: int, engine: str) -> None:
    pool = [MoEConfig(model={"num_experts": 64, "top_k": 4, "hidden_size": hidden, "moe_intermediate_size": 256 * size},
                      quant={"family": family}, platform={"vendor": "cuda", "arch": "sm_90", "packages": ["triton"]})
            for hidden in (2048, 4096) for size in range(1, 2501) for family in ("unquantized", "fp8_w8a8")]
    # 10,000 distinct configs: more than the 4,096-entry decision cache holds, so every decision is cold
    runner = decide_module.engine_for(None, engine)
    start = time.perf_counter()
    for index in range(1, count + 1):
        runner.decide(pool[index % len(pool)], quiet=True)
        if index in (1, 10_000, 100_000) or index % 250_000 == 0:
            gc.collect()
            rate = index / (time.perf_counter() - start)
            print(f"decisions {index:>17,}: RSS {rss_mb():8.1f} MB ({rate:,.0f} decisions/s)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=200)
    parser.add_argument("--decisions", type=int, default=1_000_000)
    parser.add_argument("--engine", default="durable", choices=["durable", "reference"])
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    config = MoEConfig(model={"num_experts": 8, "top_k": 2, "hidden_size": 4096, "moe_intermediate_size": 14336})
    print(f"start: RSS {rss_mb():.1f} MB ({args.engine} engine)")
    versions(args.versions, args.engine, config)
    decisions(args.decisions, args.engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
