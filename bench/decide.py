"""Decision speed: cold decide (new config), cached decide, and rules load+compile,
for durable-rules and the reference evaluator on the same configs.

    python bench/decide.py [--configs 400] [--rounds 5] [--grow 4]

`--grow N` benchmarks a synthetic rule set N times the shipped one (bench/grown_rules.py),
standing in for the default rule set after its growth to every vLLM backend.

Goals on a 2-core CPU: cached <= 5 us, cold <= 300 us with durable-rules, load+compile <= 1 s.
Medians over interleaved rounds, so both engines see the same machine noise. "cold" is a new
config on a fresh engine, as `decide` runs it (each shard's rules are evaluated once per distinct
set of the fields it reads, engine/evaluate.py:ShardMemo); "no shard memo" evaluates every shard
of every config (the first decision a process makes, or a config new in every field).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from moerules.config import MoEConfig
from moerules.engine.compiler import compile_rules
from moerules.engine.decide import Engine
from moerules.engine.loader import load_rules

from grown_rules import grow

PLATFORMS = [{"vendor": "cuda", "arch": "sm_90", "packages": ["triton", "flashinfer", "marlin"]},
             {"vendor": "cuda", "arch": "sm_100", "packages": ["triton", "flashinfer", "deep_gemm"]},
             {"vendor": "rocm", "arch": "gfx950", "packages": ["triton", "aiter"]},
             {"vendor": "cpu", "arch": "x86_64", "packages": []}]
QUANTS = [{"family": "unquantized"}, {"family": "fp8_w8a8", "weight_granularity": "block128"},
          {"family": "mxfp4_w4a16"}, {"family": "int8_w8a8"}]


def configs(n: int, offset: int) -> list[MoEConfig]:
    """Distinct configs (the intermediate size varies), so none is served from a cache."""
    return [MoEConfig(model=dict(num_experts=64, top_k=4, hidden_size=4096,
                                 moe_intermediate_size=256 * (i + offset + 1),
                                 activation="swigluoai" if i % 3 == 0 else "silu"),
                      quant=QUANTS[i % len(QUANTS)], platform=PLATFORMS[(i // 4) % len(PLATFORMS)],
                      features={"lora": i % 5 == 0})
            for i in range(n)]


def per_call_us(func, items) -> float:
    start = time.perf_counter()
    for item in items:
        func(item)
    return (time.perf_counter() - start) / len(items) * 1e6


def first_sight(engine: Engine, config: MoEConfig) -> None:
    """An evaluation in which every shard's fields are new to the engine: the full cost of the engine."""
    engine.memo.clear()
    engine.evaluate(config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--grow", type=int, default=1, help="benchmark a synthetic rule set N times the shipped one")
    parser.add_argument("--shared", action="store_true", help="grown copies share their originals' conditions")
    args = parser.parse_args()
    folder = (grow(Path(tempfile.mkdtemp(prefix="moerules-grown-")), args.grow, distinct=not args.shared)
              if args.grow > 1 else None)
    results: dict[str, dict[str, list[float]]] = {e: {"cold": [], "unmemoised": [], "cached": [], "equal": [],
                                                      "load": []} for e in ("durable", "reference")}
    for round_ in range(args.rounds):
        for name in results:
            start = time.perf_counter()
            ruleset = load_rules(folder)
            engine = Engine(ruleset, name)  # compiles, and registers with durable
            results[name]["load"].append((time.perf_counter() - start) * 1e6)
            batch = configs(args.configs, offset=round_ * args.configs)
            results[name]["cold"].append(per_call_us(lambda c: engine.decide(c, quiet=True), batch))
            unseen = configs(args.configs, offset=(args.rounds + round_) * args.configs)
            results[name]["unmemoised"].append(per_call_us(lambda c: first_sight(engine, c), unseen))
            results[name]["cached"].append(per_call_us(lambda c: engine.decide(c, quiet=True), batch))
            equal_copies = [MoEConfig.model_validate(c.model_dump()) for c in batch]  # equal, not identical
            results[name]["equal"].append(per_call_us(lambda c: engine.decide(c, quiet=True), equal_copies))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    compile_us = statistics.median(per_call_us(lambda r: compile_rules(r), [load_rules(folder)] * 20) for _ in range(3))
    print(f"{'metric':<28}{'durable':>14}{'reference':>14}   goal")
    goals = {"cold": "<= 300 us (durable)", "unmemoised": "", "cached": "<= 5 us", "equal": "<= 5 us",
             "load": "<= 1 s"}
    for metric, label in (("cold", "cold decide (us)"), ("unmemoised", "cold, no shard memo (us)"),
                          ("cached", "cached, same object (us)"),
                          ("equal", "cached, equal config (us)"), ("load", "load+compile (us)")):
        row = [statistics.median(results[e][metric]) for e in ("durable", "reference")]
        print(f"{label:<28}{row[0]:>14.1f}{row[1]:>14.1f}   {goals[metric]}")
    print(f"{'compile alone (us)':<28}{compile_us:>14.1f}{'':>14}")
    rules = load_rules(folder)
    grown = f" grown {args.grow}x ({'shared' if args.shared else 'distinct'} conditions)" if folder else ""
    print(f"rule set{grown}: {len(rules.rules())} rules, {len(compile_rules(rules).rules)} compiled, "
          f"{len(rules.backends)} backends, hash {rules.hash[:12]}; {args.configs} configs x {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
