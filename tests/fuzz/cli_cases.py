"""Malformed `moerules` invocations for every subcommand, generated from a seed.

Each case is an argv. Files are hostile in every way the issue lists (binary, non-UTF-8, deeply
nested, tagged, huge, over-long names, folders, devices, corrupt golden tables) plus adversarial
config text built from the pieces of test_fuzz_input.py. Commands that evaluate the whole matrix
(lint, matrix, diff, mutate, conformance) always carry one `poison`, an option that must be refused
before that work starts, so a case that runs for minutes is a bug (a missing early check), not a
slow valid request; the other options are drawn freely, valid values included.
"""

from __future__ import annotations

import random
from pathlib import Path

from test_fuzz_input import HOSTILE

LONG_NAME = "x" * 300 + ".yaml"
BAD_INTS = ["0", "-1", "-3", str(10 ** 9), str(2 ** 70), "abc", "", "1e3", "0x10", "+-2", "9" * 400]
ANY_INTS = BAD_INTS + ["1", "2", "7"]
BAD_FLOATS = ["0", "-1", "nan", "inf", "-inf", "abc", "", "1e999"]
STRINGS = ["", "\x01", "x" * 5000, "é", "-", "--", "cuda", "meta", "bogus", "cuda:7", "cpu:99", ":", "cuda:sm_90",
           "rocm:gfx950", "cpu", "triton,aiter", ",,,", "mixtral-8x7b", "deepseek-v3", "auto", "triton"]
# Values each bounded option refuses at parse time (argparse types in tools/cli/main.py).
REFUSED = {"--workers": ["0", "-1", str(2 ** 70), "abc", ""], "--sample": ["0", "-3", str(2 ** 70), "abc", "1e3"],
           "--limit": ["-1", "abc", "+-2"], "--random": ["-1", "abc", str(10 ** 7)],
           "--seed": ["-5", "x", str(2 ** 70), "0x10"], "--tokens": ["0", "-1", str(10 ** 9), "abc"]}
DEVICES = ["cuda", "cuda:0", "cuda:7", "meta", "bogus", "", "cpu:99", "mps", "xla", "CPU", "-1"]


class Files:
    """The hostile files of one fuzz run, written once under `root`."""

    def __init__(self, root: Path, seed: int = 0):
        self.root = root
        rng = random.Random(seed)
        write = self._write
        self.configs = [
            write("binary.yaml", bytes(range(256)) * 4),
            write("latin1.yaml", "model: caf\xe9\n".encode("latin-1")),
            write("deep.yaml", b"x: " + b"[" * 10_000),
            write("tagged.yaml", b"model: !!python/object:os.system x\n"),
            write("huge.yaml", b"#" * (5 * 1024 * 1024)),
            write("empty.yaml", b""),
            write("list.yaml", b"- 1\n- 2\n"),
            write("nan.yaml", b"model: {num_experts: .nan, top_k: 2, hidden_size: 64, moe_intermediate_size: 64}\n"),
            write("negative.yaml", b"model: {num_experts: -8, top_k: 2, hidden_size: 64, moe_intermediate_size: 64}\n"),
            write("unknown.yaml", b"model: mixtrall\n"),
            write("json.json", b'{"model": {"num_experts": 8,'),
            write("bom.yaml", b"\xef\xbb\xbf\x00"),
            str(root / "folder"), str(root / "missing.yaml"), str(root / LONG_NAME), "/dev/null", "/dev/zero", "-", "",
        ] + [write(f"adversarial{i}.yaml", self._adversarial(rng)) for i in range(40)]
        (root / "folder").mkdir(exist_ok=True)
        # A tiny valid layer: `run` cases that happen to be valid finish in a second.
        self.tiny = write("tiny.yaml", b"model: {num_experts: 4, top_k: 2, hidden_size: 64, moe_intermediate_size: 64, "
                                       b"in_dtype: fp32}\nplatform: {vendor: cpu, arch: x86_64, packages: []}\n")
        self.rules = [self.configs[0], self.configs[1], self.configs[2], self.configs[5], str(root / "folder"),
                      str(root / "missing"), str(root / LONG_NAME), "/dev/null"]
        self.bad_outputs = ["/proc", "/proc/x/y", self.configs[0], str(root / LONG_NAME / "sub"),
                            str(root / "missing" / "x" / LONG_NAME)]
        self.bad_report = ["/proc/x", str(root / "folder"), str(root / "binary.yaml" / "r.md")]
        self.golden = [self._golden("binary", bytes(range(256))), self._golden("foreign", b"cell,backend\nfoo,bar\n"),
                       self._golden("ragged", None), self._golden("empty", b""), str(root / "no-golden")]

    def _write(self, name: str, data: bytes) -> str:
        path = self.root / name
        path.write_bytes(data)
        return str(path)

    def _golden(self, name: str, data) -> str:
        """A golden folder whose matrix file and conformance report both hold `data` (None: a malformed line)."""
        from moerules.tools.conformance import COLUMNS as CONFORMANCE
        folder = self.root / f"golden-{name}"
        (folder / "decisions").mkdir(parents=True, exist_ok=True)
        (folder / "decisions" / "cuda-sm_90.txt").write_bytes(
            data if data is not None else b"cuda:sm_90|x: triton scale_dim=1 bogus\n")
        (folder / "conformance.csv").write_bytes(
            data if data is not None else (",".join(CONFORMANCE) + "\nonly,three,fields\n").encode())
        return str(folder)

    @staticmethod
    def _adversarial(rng: random.Random) -> bytes:
        pieces = ["model:", "  num_experts: 8", "quant: {family: fp8_w8a8}", "platform: {vendor: cuda}",
                  "parallel:", "  tp: 2", "features: {backend: triton}"] + HOSTILE
        return "\n".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))).encode("utf-8", "surrogatepass")


def _config_flags(rng: random.Random, files: Files) -> list[str]:
    pool = {"--quant": STRINGS + ["fp8_w8a8", "nvfp4"], "--weight-granularity": STRINGS + ["block128"],
            "--activation-granularity": STRINGS + ["token"], "--platform": STRINGS, "--packages": STRINGS,
            "--tp": ANY_INTS, "--dp": ANY_INTS, "--all2all": STRINGS, "--backend": STRINGS, "--rules": files.rules,
            "--engine": ["auto", "durable", "reference", "bogus"]}
    argv = []
    for flag in rng.sample(sorted(pool), rng.randint(0, 4)):
        argv += [flag, rng.choice(pool[flag])]
    argv += rng.sample(["--ep", "--lora", "--detect", "--json"], rng.randint(0, 2))
    return argv


def decide_case(rng: random.Random, files: Files, command: str) -> list[str]:
    source = rng.choice([[rng.choice(files.configs)], ["--model", rng.choice(STRINGS)], [files.tiny], []])
    return [command, *source, *_config_flags(rng, files)]


def run_case(rng: random.Random, files: Files) -> list[str]:
    argv = ["run", rng.choice(files.configs + [files.tiny] * 6)]
    extras = {"--tokens": ANY_INTS, "--seed": BAD_INTS + ["3"], "--device": DEVICES + ["cpu"],
              "--max-gib": BAD_FLOATS + ["0.0001", "1"]}
    for flag in rng.sample(sorted(extras), rng.randint(1, 3)):
        argv += [flag, rng.choice(extras[flag])]
    flags = [f for f in _config_flags(rng, files) if f != "--json"]
    return argv + flags if "--model" not in flags else argv


def _poisoned(rng: random.Random, command: list[str], poisons: dict, extras: dict, flags: list[str]) -> list[str]:
    """command + one poison option + other options (never the poisoned one again, which would override it)."""
    flag = rng.choice(sorted(poisons))
    argv = command + [flag, *rng.choice(poisons[flag])]
    for other in rng.sample(sorted(set(extras) - {flag}), rng.randint(0, min(3, len(extras) - 1))):
        argv += [other, rng.choice(extras[other])]
    return argv + rng.sample(flags, rng.randint(0, len(flags)))


def bulk_case(rng: random.Random, files: Files, command: str) -> list[str]:
    workers = {"--workers": [[v] for v in REFUSED["--workers"]]}
    cache_extras = {"--workers": ["1", "2"] + BAD_INTS, "--cache": [str(files.root / "cache")] + files.bad_outputs}
    if command == "lint":
        poisons = {**workers, "--rules": [[r] for r in files.rules], "--cache": [[o] for o in files.bad_outputs[:3]]}
        return _poisoned(rng, ["lint"], poisons, {**cache_extras, "--rules": files.rules}, ["--json", "--quiet"])
    if command == "matrix":
        poisons = {**workers, "--limit": [[v] for v in REFUSED["--limit"]],
                   "--check": [["--out", g] for g in files.golden],
                   "--out": [[o] for o in files.bad_outputs]}
        extras = {**cache_extras, "--rules": files.rules, "--engine": ["auto", "reference", "bogus"]}
        return _poisoned(rng, ["matrix"], poisons, extras, ["--quiet", "--no-cache"])
    if command == "diff":
        old = rng.choice(files.rules + ["nope", "HEAD:nowhere", "x" * 5000, "refs/heads/\x01"])
        extras = {"--random": ANY_INTS, "--seed": ANY_INTS, "--limit": ANY_INTS, **cache_extras}
        return _poisoned(rng, ["diff", old, rng.choice(files.rules + ["HEAD"])],
                         {f: [[v] for v in REFUSED[f]] for f in ("--random", "--seed", "--limit", "--workers")},
                         extras,
                         ["--json", "--quiet", "--fail-on-change"])
    if command == "mutate":
        poisons = {"--sample": [[v] for v in REFUSED["--sample"]], **workers, "--rules": [[r] for r in files.rules],
                   "--report": [[r] for r in files.bad_report], "--seed": [[v] for v in REFUSED["--seed"]]}
        return _poisoned(rng, ["mutate"], poisons, {"--sample": ["1", "2"] + BAD_INTS, "--seed": ANY_INTS}, ["--json"])
    if command == "conformance":
        poisons = {"--check": [["--out", g] for g in files.golden], "--out": [[o] for o in files.bad_outputs],
                   "--sample": [[v] for v in REFUSED["--sample"]], "--random": [[v] for v in REFUSED["--random"]],
                   "--rules": [[r] for r in files.rules]}
        extras = {"--family": STRINGS + ["fp8,mxfp4"], "--seed": ANY_INTS, "--limit": ANY_INTS}
        return _poisoned(rng, ["conformance"], poisons, extras, ["--quiet"])
    raise ValueError(command)


def schema_case(rng: random.Random, files: Files) -> list[str]:
    out = rng.choice(files.bad_outputs + [str(files.root / "folder"), files.configs[5], str(files.root / "schema")])
    return ["schema", "--out", out] + rng.sample(["--check"], rng.randint(0, 1))


def junk_case(rng: random.Random, files: Files) -> list[str]:
    # No bare bulk command (a valid `mutate` runs for minutes, a bare `schema` rewrites the package's files).
    words = ["decide", "explain", "run", "bogus", "--json", "--model", "--tokens", "-x", "--", "-", "--help=1",
             "--rules=", "--debug=1"] + STRINGS[:10]
    return rng.sample(words, rng.randint(0, 4))


def cases(files: Files, count: int, seed: int = 0) -> list[list[str]]:
    """`count` invocations, every subcommand among them, the same list for the same seed."""
    rng = random.Random(seed)
    makers = [lambda: decide_case(rng, files, "decide")] * 6 + [lambda: decide_case(rng, files, "explain")] * 4 + \
             [lambda: run_case(rng, files)] * 4 + [lambda: schema_case(rng, files)] + \
             [lambda c=c: bulk_case(rng, files, c) for c in ("lint", "matrix", "diff", "mutate", "conformance")] + \
             [lambda: junk_case(rng, files)]
    return [rng.choice(makers)() for _ in range(count)]
