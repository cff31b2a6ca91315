"""A synthetic rule set N times the size of the shipped one, for engine benchmarks and
stress tests ahead of the real growth (every vLLM 0.33 backend).

Each backend gets N-1 copies (`<id>__g<k>`); every constraint and plan rule restricted to
named backends is copied for the copies. By default each copy gets one always-true extra test
(`model.num_experts != 1000000<k>`) so no copy shares a compiled condition with its original:
the copies cost the engine what distinct real rules would (the worst case: real backends
often share gates, which the compiler merges). `--shared` keeps the copies' conditions as
they are. Rules over all backends, priorities and dispatch rules are kept as they are
(unlisted copies rank after the listed backends).

    python bench/grown_rules.py OUT_DIR [--factor 4] [--shared]
"""

from __future__ import annotations

import argparse
import copy
import shutil
from pathlib import Path

import yaml

from moerules.resources import default_rules_dir


def grow(out: Path, factor: int, distinct: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    sources = {source: yaml.safe_load(source.read_text(encoding="utf-8"))
               for source in sorted(default_rules_dir().glob("*.yaml"))}
    backends = {b["id"] for data in sources.values() for b in data.get("backends", [])}
    for source, data in sources.items():
        shutil.copy(source, out / source.name)
        copies = [_copy(data, k, backends, distinct) for k in range(2, factor + 1)]
        for k, extra in zip(range(2, factor + 1), copies):
            if any(extra.values()):
                (out / f"{source.stem}-g{k}.yaml").write_text(yaml.safe_dump({"version": 1, **extra}, sort_keys=False))
    return out


def _copy(data: dict, k: int, backends: set[str], distinct: bool) -> dict:
    """The k-th copy of a file's backends and of its rules about named backends (dispatchers stay)."""
    rename = lambda names: [f"{name}__g{k}" if name in backends else name for name in names]  # noqa: E731
    copies = [{**b, "id": f"{b['id']}__g{k}"} for b in data.get("backends", [])]
    constraints = [_renamed(c, k, distinct, applies_to=rename(c["applies_to"]))
                   for c in data.get("constraints", []) if isinstance(c.get("applies_to"), list)]
    plan = [_renamed(p, k, distinct, backends=rename(p["backends"])) for p in data.get("plan", []) if p.get("backends")]
    return {"backends": copies, "constraints": constraints, "plan": plan}


def _renamed(rule: dict, k: int, distinct: bool, **changes) -> dict:
    rule = copy.deepcopy({**rule, **changes, "id": f"{rule['id']}__g{k}"})
    if distinct:
        test = f"model.num_experts != {1000000 + k}"
        rule["when"] = f"({rule['when']}) and {test}" if rule.get("when") else test
    return rule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--shared", action="store_true", help="copies keep their originals' conditions")
    args = parser.parse_args()
    print(grow(args.out, args.factor, distinct=not args.shared))


if __name__ == "__main__":
    main()
