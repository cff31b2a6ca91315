"""The `moerules` command line. Exit codes: 0 ok, 1 unsupported config, 2 invalid input, 141 stdout closed."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

from pydantic import ValidationError

from moerules.config import MoEConfig
from moerules.errors import BackendRejectedError, ConfigFileError, MoeRulesError, TableFileError
from moerules.engine.loader import structure_error
from moerules.engine.textfile import is_folder, is_regular_file, read_text
from moerules.engine.yamlsource import YamlDocument
from moerules.limits import DEFAULT_CPU_RUN_GIB, MAX_RUN_TOKENS, MAX_SEED, MAX_TABLE_BYTES
from moerules.presets import PRESETS, preset
from moerules.tools.cli.flags import add_config_flags, flag_sections

OK, UNSUPPORTED, INVALID = 0, 1, 2
INTERRUPTED = 130  # the shell's code for Ctrl-C
BROKEN_PIPE = 141  # the shell's code for a writer whose reader closed the pipe (128 + SIGPIPE)


class InputError(Exception):
    """Bad command-line input; printed without a traceback, exit code 2."""


# -- reading and writing the files a command names ------------------------------------------
def _read_table(path: Path, parse: Callable[[str, str], dict], *, missing: str, regenerate: str) -> dict:
    """A golden table this tool wrote, parsed; any unreadable or foreign file is a TableFileError."""
    if not is_regular_file(path):
        raise InputError(f"{path}: {missing}; run `{regenerate}` and commit it")
    hint = f"regenerate it with `{regenerate}` and commit it"
    text = read_text(path, str(path), TableFileError, limit=MAX_TABLE_BYTES, split_hint=hint)
    return parse(text, str(path))


def _check_writable_folder(out: Path) -> None:
    """Create `out` if needed and prove a file can be written there, before any long computation."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except (OSError, ValueError) as error:
        raise InputError(f"{out}: cannot write output files there ({_os_reason(error)})") from None


def _check_writable_file(path: Path) -> None:
    """`path` can be (over)written: an existing regular file, or a new name in a writable folder."""
    if is_folder(path):
        raise InputError(f"{path}: is a folder; give a file name")
    if is_regular_file(path):
        if not os.access(path, os.W_OK):
            raise InputError(f"{path}: cannot write output file there (permission denied)")
        return
    _check_writable_folder(path.parent)


def _os_reason(error: Exception) -> str:
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)


# -- building a config ----------------------------------------------------------------------
def _read_config_file(path: str) -> tuple[YamlDocument, dict]:
    """The config file's document and its data, a named preset (`model: mixtral-8x7b`) filled in."""
    doc = YamlDocument(Path(path), path, error=ConfigFileError)  # JSON is YAML too
    if not isinstance(doc.data, dict):
        raise doc.error("a config is a mapping with model/quant/parallel/platform/features sections", ())
    data = doc.data
    if isinstance(data.get("model"), str):
        try:
            base = preset(data["model"])
        except KeyError as error:
            raise doc.error(error.args[0], ("model",)) from None
        data = _merge(base, {k: v for k, v in data.items() if k != "model"})
    return doc, data


def _preset(name: str) -> dict:
    try:
        return preset(name)
    except KeyError as error:
        raise InputError(error.args[0]) from None


def _merge(base: dict, extra: dict) -> dict:
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in extra.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = values
    return merged


def _flags_to_sections(args) -> dict:
    """The config sections the command line sets: the generated field flags, and the --platform shorthand."""
    sections = flag_sections(args, args.config_flags)
    if args.platform:
        platform = sections.setdefault("platform", {})
        if {"vendor", "arch"} & set(platform):
            raise InputError("give --platform VENDOR:ARCH or --vendor/--arch, not both")
        vendor, _, arch = args.platform.partition(":")
        platform.update({"vendor": vendor, **({"arch": arch} if arch else {})})
    if args.detect and sections.get("platform"):
        given = ", ".join(f"--{name.replace('_', '-')}" for name in sections["platform"])
        raise InputError(f"--detect takes the platform from this machine; drop {given}, or drop --detect")
    return sections


def build_config(args) -> MoEConfig:
    """The config of a command: its source (file, preset, HF config or none), then the flags over it."""
    doc, data, source = _config_source(args)
    flags = _flags_to_sections(args)
    data = _merge(data, flags)
    if args.detect:
        from moerules.tools.detect import detect, detect_switches
        data["platform"] = detect().model_dump(include={"vendor", "arch", "packages", "torch_grouped_mm", "cpu_amx"})
        data["switches"] = detect_switches().model_dump()
    try:
        config = MoEConfig.model_validate(data)
    except ValidationError as error:
        raise _config_error(error, doc, source, _flag_names(args, flags)) from None
    if "platform" not in data:
        _say_assumed_platform()
    return config


def _config_source(args) -> tuple[Optional[YamlDocument], dict, str]:
    if sum(1 for given in (args.config, args.model, args.hf_config) if given) > 1:
        raise InputError("give one of a config file, --model or --hf-config")
    if args.config:
        doc, data = _read_config_file(args.config)
        return doc, data, args.config
    if args.model:
        return None, _preset(args.model), f"--model {args.model}"
    if args.hf_config:
        from moerules.hf_config import hf_sections
        return None, hf_sections(args.hf_config, layer=args.hf_layer), f"--hf-config {args.hf_config}"
    return None, {}, "the command line"


def _flag_names(args, sections: dict) -> dict[tuple[str, str], str]:
    """(section, field) -> the flag that set it, for each field the command line set."""
    names = {(flag.section, flag.field): flag.names[0] for flag in args.config_flags}
    if args.platform:
        names.update({("platform", "vendor"): "--platform", ("platform", "arch"): "--platform"})
    return {key: name for key, name in names.items() if key[1] in sections.get(key[0], {})}


def _config_error(error: ValidationError, doc: Optional[YamlDocument], source: str, flags: dict) -> Exception:
    """The first invalid field (fixing it may fix the rest): at its flag if the command line set it,
    else at its file:line:col in the config file, else named under its source."""
    first = error.errors()[0]
    flag = flags.get(tuple(str(part) for part in first["loc"][:2]))
    if flag:
        return InputError(f"{flag}: {first['msg']}")
    if doc is None and first["type"] == "missing" and first["loc"][:1] == ("model",):
        return InputError("give a config file (YAML/JSON), --model PRESET "
                          f"(presets: {', '.join(sorted(PRESETS))}), --hf-config config.json, or the model flags "
                          "(--num-experts, --top-k, --hidden-size, --moe-intermediate-size)")
    if doc is not None:
        return structure_error(doc, first, MoEConfig)
    return InputError(_pydantic_message(error, source))


def _say_assumed_platform() -> None:
    """No platform given: the default one is decided for, and stderr says which (stdout stays the record)."""
    from moerules.config import Platform
    default = Platform()
    packages = ",".join(sorted(p.value for p in default.packages))
    print(f"moerules: no platform given; deciding for {default.vendor.value}:{default.arch} with packages {packages} "
          "(give --platform VENDOR:ARCH, or --detect for this machine)", file=sys.stderr)


def _pydantic_message(error: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config"]
    for detail in error.errors():
        field = ".".join(str(p) for p in detail["loc"]) or "config"
        lines.append(f"  {field}: {detail['msg']}")
    return "\n".join(lines)


# -- commands -------------------------------------------------------------------------------
def _decision(args):
    from moerules.engine.decide import decide
    try:
        return decide(build_config(args), args.rules, args.engine)
    except BackendRejectedError as error:  # a rejected pin is still a full, explainable record
        return error.decision


def cmd_decide(args) -> int:
    decision = _decision(args)
    print(decision.to_json() if args.json else decision.describe())
    return OK if decision.outcome.value == "selected" else UNSUPPORTED


def cmd_explain(args) -> int:
    from moerules.engine.decide import engine_for
    from moerules.engine.explain import explain_text
    decision = _decision(args)
    dispatchers = engine_for(args.rules, args.engine).ruleset.dispatchers
    print(decision.to_json() if args.json else explain_text(decision, dispatchers=dispatchers, show_all=args.all))
    return OK if decision.outcome.value == "selected" else UNSUPPORTED


def cmd_lint(args) -> int:
    from moerules.tools import lint
    report, ruleset = lint.static_checks(args.rules)
    static = len(report.findings)
    if not args.json and report.lines():  # static findings first: coverage takes a while
        print("\n".join(report.lines()), flush=True)
    if ruleset is not None and not args.static:
        lint.kernel_checks(ruleset, report)
        configs = [c.config for c in _matrix_cells(ruleset)]
        with _progress(args, len(configs), "lint coverage") as bar:
            lint.coverage(ruleset, report, configs, **_pool_options(args, bar))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print("\n".join(report.lines(static) + [report.tally()]))
    return INVALID if report.errors else OK


def cmd_schema(args) -> int:
    from moerules.tools import schema_export
    from moerules.resources import schema_dir
    out = Path(args.out) if args.out else schema_dir()
    if args.check:
        if not is_folder(out):
            raise InputError(f"{out}: no such folder; give --out the folder the schema files were written to")
        stale = schema_export.stale(out)
        for name in stale:
            print(f"{out / name}: stale; run `moerules schema` and commit the result")
        return INVALID if stale else OK
    _check_writable_folder(out)
    for path in schema_export.write(out):
        print(f"wrote {path}")
    return OK


def cmd_run(args) -> int:
    from moerules.tools.cli.run import run_example
    decision = _decision(args)
    print(decision.describe())
    if decision.outcome.value != "selected":
        return UNSUPPORTED
    from moerules.tools.cli.run import RUN_STAGES
    with _progress(args, RUN_STAGES, "run") as bar:
        report = run_example(decision, num_tokens=args.tokens, seed=args.seed, device=args.device,
                             max_gib=args.max_gib, stage=bar.stage)
    for key, value in report.items():
        print(f"{key}: {value}")
    return OK


@contextlib.contextmanager
def _progress(args, total: int, label: str):
    from moerules.tools.progress import progress
    bar = progress(total, label, quiet=args.quiet)
    try:
        yield bar
    finally:
        bar.close()


def _pool_options(args, bar) -> dict:
    from moerules.tools.decision_cache import default_root
    root = None if args.no_cache else Path(args.cache) if args.cache else default_root()
    if args.cache and not args.no_cache:
        _check_writable_folder(root)
    return {"cache_root": root, "workers": args.workers, "progress": bar}


def _matrix_cells(ruleset) -> list:
    from moerules.tools import matrix
    return list(matrix.cells(ruleset.backends))


def cmd_matrix(args) -> int:
    from moerules.tools import matrix, matrix_golden
    from moerules.engine.decide import engine_for
    out = Path(args.out)
    golden = out / "decisions"
    # Everything that can fail on the files fails before the matrix is decided (minutes).
    committed = matrix_golden.read(golden, regenerate=f"moerules matrix --out {out}") if args.check else None
    if not args.check:
        _check_writable_folder(out)
    engine = engine_for(args.rules, args.engine)
    cells = _matrix_cells(engine.ruleset)
    if not args.quiet:
        print(f"moerules: deciding the matrix ({len(cells)} cells, {engine.name} engine)...", file=sys.stderr)
    with _progress(args, len(cells), "matrix") as bar:
        rows = matrix.build_rows(engine.ruleset, args.engine, cells, **_pool_options(args, bar))
    if args.check:
        changes = matrix.compare(committed, {r["cell"]: r for r in rows})
        for change in changes[:args.limit]:
            print(change.describe())
        if len(changes) > args.limit:
            print(f"... and {len(changes) - args.limit} more")
        print(matrix.summary(changes, len(rows)))
        if changes:
            print("(rules: those now responsible; `moerules diff OLD NEW` gives both sides')")
            print(f"the rules changed these cells; if intended, run `moerules matrix --out {out}` and commit")
        return INVALID if changes else OK
    matrix_golden.write(golden, rows)
    page = _write_matrix_page(args, engine, out / "index.html")
    print(f"wrote {golden}/ ({len(rows)} cells) and {page}")
    return OK


def _write_matrix_page(args, engine, page: Path) -> Path:
    from moerules.tools import matrix_html
    cells = matrix_html.page_cells()
    with _progress(args, len(cells), "matrix page") as bar:
        explained = matrix_html.build(engine.ruleset, args.engine, cells, **_pool_options(args, bar))
    page.write_text(matrix_html.render(explained, engine.ruleset.hash), encoding="utf-8")
    return page


def cmd_diff(args) -> int:
    from moerules.tools import matrix
    from moerules.tools.ruleset_source import resolve
    old, new = resolve(args.old), resolve(args.new)
    cells = [] if args.no_matrix else list(matrix.cells({**old.backends, **new.backends}))
    cells += list(matrix.random_cells(args.random, args.seed))
    if not args.quiet:
        print(f"moerules: comparing {len(cells)} configs ({args.random} random)...", file=sys.stderr)
    sides = []
    for label, ruleset in (("old", old), ("new", new)):
        with _progress(args, len(cells), f"diff {label}") as bar:
            rows = matrix.build_rows(ruleset, "auto", cells, **_pool_options(args, bar))
        sides.append({r["cell"]: r for r in rows})
    changes = matrix.compare(*sides)
    if args.json:
        print(json.dumps({"old": old.hash, "new": new.hash, "configs": len(cells),
                          "changed": len(changes), "changes": [c.to_dict() for c in changes]}, indent=2))
    else:
        for change in changes[:args.limit]:
            print(change.describe())
        if len(changes) > args.limit:
            print(f"... and {len(changes) - args.limit} more (--json for all)")
        print(matrix.summary(changes, len(cells)))
    return UNSUPPORTED if changes and args.fail_on_change else OK


def cmd_mutate(args) -> int:
    from moerules.tools import mutate
    from moerules.engine.loader import load_rules
    ruleset = load_rules(args.rules)
    if args.report:
        _check_writable_file(Path(args.report))

    def progress(outcome, number, total):
        mark = "killed" if outcome.killed else "SURVIVED"
        print(f"  [{number}/{total}] {outcome.mutant.rule} {outcome.mutant.operator}: {mark}", file=sys.stderr,
              flush=True)
    outcomes = mutate.run(ruleset, sample=args.sample, seed=args.seed, workers=args.workers, progress=progress)
    survivors = [o for o in outcomes if not o.killed]
    if args.report:
        Path(args.report).write_text(mutate.report_markdown(outcomes, ruleset.hash), encoding="utf-8")
    if args.json:
        print(json.dumps([o.to_dict() for o in outcomes], indent=2))
    else:
        for o in survivors:
            print(f"SURVIVED {o.mutant.rule} {o.mutant.operator}: {o.mutant.detail}")
        print(f"{len(outcomes) - len(survivors)}/{len(outcomes)} mutants killed")
    return UNSUPPORTED if survivors else OK


def cmd_test(args) -> int:
    from moerules.engine.loader import load_rules
    from moerules.resources import default_rules_dir
    from moerules.tools import rule_cases
    rules_dir = Path(args.rules) if args.rules else default_rules_dir()
    if not is_folder(rules_dir):
        raise InputError(f"{rules_dir}: cases live in the cases/ folder beside the rule files; give --rules a folder")
    ruleset = load_rules(rules_dir, display="rules" if args.rules is None else None)
    results = rule_cases.run(rules_dir, ruleset, args.engine)
    failed = [r for r in results if r.problem]
    missing = rule_cases.missing_case_files(rules_dir, ruleset)
    for result in failed:
        print(f"{result.where}: [{result.rule}] {result.problem}")
    for name in missing:
        print(f"{rules_dir.name}/{name}: holds rules but has no case file {rules_dir.name}/{rule_cases.CASES}/{name}")
    print(f"{len(results) - len(failed)} of {len(results)} cases hold")
    short = False
    if args.coverage or args.min_coverage is not None or args.suggest:
        covered = rule_cases.coverage(ruleset, results)
        for file_name, ids in covered.uncovered.items():
            print(f"no case names {len(ids)} rule(s) of {file_name}: {', '.join(ids)}")
        for rule_id in covered.deviations:
            print(f"{rule_id} has `deviation:` but no case: a deviation is defended by name")
        print(f"coverage: {covered.percent:.1f}% of {covered.total} rules have a case that holds")
        short = bool(covered.deviations) or (args.min_coverage is not None and covered.percent < args.min_coverage)
        if args.suggest:
            _print_drafts(ruleset, args.engine, {i for ids in covered.uncovered.values() for i in ids})
    return UNSUPPORTED if failed or missing or short else OK


def _print_drafts(ruleset, engine: str, rule_ids: set) -> None:
    """A draft case for each rule, from the first matrix cell where it acts: printed for review, never written."""
    import yaml
    from moerules.engine.decide import Engine
    from moerules.tools import rule_cases
    found = rule_cases.suggest(Engine(ruleset, engine), rule_ids, (c.config for c in _matrix_cells(ruleset)))
    by_file: dict = {}
    for rule_id in sorted(found, key=lambda i: ruleset.position(ruleset.rule(i))):
        by_file.setdefault(rule_cases.rule_file(ruleset, rule_id), []).append(rule_cases.draft(rule_id, *found[rule_id]))
    for file_name, drafts in by_file.items():
        print(f"# drafts for {rule_cases.CASES}/{file_name}\n" + yaml.safe_dump(drafts, sort_keys=False, default_flow_style=None, width=110))
    for rule_id in sorted(rule_ids - set(found)):
        print(f"# {rule_id} acts on no matrix cell: write its case by hand")


def cmd_conformance(args) -> int:
    from moerules.tools import conformance, matrix
    from moerules.engine.loader import load_rules
    from moerules.tools.vllm_oracle import VLLM_VERSION, VllmOracle, vllm_family
    ruleset = load_rules(args.rules)
    out = Path(args.out)
    committed = out / "conformance.csv"
    golden = _read_table(committed, conformance.from_csv, missing="no committed conformance report",
                         regenerate="moerules conformance") if args.check else None
    if not args.check:
        _check_writable_folder(out)
    cells = list(matrix.cells(ruleset.backends)) + list(matrix.random_cells(args.random, args.seed))
    if args.family:
        cells = [cell for cell in cells if vllm_family(cell.config) in args.family.split(",")]
    if args.check:
        cells = conformance.sample(cells, args.sample)
    if not args.quiet:
        print(f"moerules: importing vLLM {VLLM_VERSION}, then comparing {len(cells)} configs...", file=sys.stderr)
    checker = conformance.Conformance(ruleset, VllmOracle())
    with _progress(args, len(cells), "conformance") as bar:
        rows = conformance.compare_all(checker, cells, bar)
    if args.check:
        return _check_conformance(golden, rows, args.limit)
    committed.write_text(conformance.to_csv(rows), encoding="utf-8")
    report = out / "conformance.md"
    report.write_text(conformance.report_markdown(conformance.Summary(rows), ruleset.hash, VLLM_VERSION),
                      encoding="utf-8")
    print(report.read_text(encoding="utf-8").split("\n## ")[0])
    print(f"wrote {committed} and {report}")
    return OK


def _check_conformance(committed: dict, rows: list, limit: int) -> int:
    changed = [(committed.get(row.cell), row) for row in rows if committed.get(row.cell) != row]
    for old, new in changed[:limit]:
        was = f"{old.ours} vs vLLM {old.theirs} ({old.verdict})" if old else "absent"
        print(f"{new.cell}: was {was}, now {new.ours} vs vLLM {new.theirs} ({new.verdict}) {new.rules}")
    print(f"{len(changed)} of {len(rows)} sampled configs differ from the committed conformance report")
    if changed:
        print("the rules or vLLM's selection changed; if intended, run `moerules conformance` and commit reports/")
    return INVALID if changed else OK


# -- argument parsing -----------------------------------------------------------------------
def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], else a one-line usage error naming the range."""
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value if len(str(value)) < 40 else str(value)[:40] + '...'} is out "
                                             f"of range: give {low} to {high:,}")
        return value
    parse.__name__ = "integer"
    return parse


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text[:40]} is out of range: give a number > 0")
    return value


SEED = bounded_int(0, MAX_SEED)
WORKERS = bounded_int(1, 4096)
LIMIT = bounded_int(0, 10 ** 9)
RANDOM_CONFIGS = bounded_int(0, 10 ** 6)
SAMPLE = bounded_int(1, 10 ** 9)
DEBUG_HELP = "show the traceback of any error (for bug reports)"


# Options of the commands that take a config (decide, explain, run, moerules.tools.cli.launch): a config field
# of the same name gets its section as a prefix instead.
_OWN_OPTIONS = frozenset({"--model", "--hf-config", "--hf-layer", "--platform", "--detect", "--rules", "--engine",
                          "--json", "--all", "--debug", "--quiet", "--tokens", "--seed", "--device", "--max-gib",
                          "--version", "--iters", "--timeout", "--dist-backend"})
_CONFIG_USAGE = ("moerules {} [CONFIG | --model PRESET | --hf-config PATH] [--platform VENDOR:ARCH | --detect]\n"
                 "       [--FIELD VALUE ...] [options]   (a flag per MoEConfig field: see below)")


def config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="config file (YAML or JSON) with MoEConfig sections")
    parser.add_argument("--model", help=f"model preset instead of a file: {', '.join(sorted(PRESETS))}")
    parser.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its model folder): the "
                                                            "MoE layers' model and quant sections")
    parser.add_argument("--hf-layer", type=int, metavar="N", help="with --hf-config: decide for decoder layer N "
                                                                  "(refused if it is a dense layer)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--platform", metavar="VENDOR[:ARCH]",
                       help="shorthand for --vendor/--arch, e.g. cuda:sm_90, rocm:gfx950, cpu:x86_64 "
                            "(default: cuda:sm_90, said on stderr)")
    where.add_argument("--detect", action="store_true",
                       help="take the platform and vLLM's VLLM_* switches from this machine")
    _rules_arguments(parser)
    parser.set_defaults(config_flags=add_config_flags(parser, _OWN_OPTIONS))


def _rules_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rules", help="rules folder or file (default: the shipped rule set)")


def _rules_arguments(parser: argparse.ArgumentParser) -> None:
    _rules_option(parser)
    parser.add_argument("--engine", default="auto", choices=["auto", "durable", "reference"],
                        help="rule evaluator (default: durable-rules where importable)")


_CACHE_HELP = ("Decisions are cached on disk per rule-set content hash in $MOERULES_CACHE_DIR (default "
               "$XDG_CACHE_HOME/moerules/decisions or ~/.cache/moerules/decisions); deleting it is always safe.")


def _bulk_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the tools that evaluate every matrix cell: cache, processes, progress."""
    parser.add_argument("--cache", metavar="DIR", help="decision cache folder (default: $MOERULES_CACHE_DIR, "
                                                        "else $XDG_CACHE_HOME/moerules/decisions)")
    parser.add_argument("--no-cache", action="store_true", help="decide every cell afresh; read and write no cache")
    parser.add_argument("--workers", type=WORKERS, help="processes (default: every core this process may use)")
    parser.add_argument("--quiet", action="store_true", help="no progress line (it shows only on a terminal anyway)")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moerules", description=__doc__.splitlines()[0] + (
        " Decide, explain and run the fused-MoE kernel backend for a layer."))
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    parser.add_argument("--version", action="version", version=f"moerules {metadata.version('moerules')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, func, text in (("decide", cmd_decide, "print the decision as one line (or --json)"),
                             ("explain", cmd_explain, "winner, alternatives and every rejection with rule and file:line")):
        sub = commands.add_parser(name, help=text, description=text, usage=_CONFIG_USAGE.format(name))
        config_arguments(sub)
        sub.add_argument("--json", action="store_true", help="the stable JSON record")
        if name == "explain":
            sub.add_argument("--all", action="store_true", help="every rejection of every component, dispatchers "
                                                                "outside this layout included")
        sub.set_defaults(func=func)
    lint = commands.add_parser("lint", help="static checks of a rule set, then coverage over the matrix",
                               description="static checks of a rule set (printed first), then dispatch/plan "
                                           "coverage over every matrix cell", epilog=_CACHE_HELP)
    _rules_option(lint)
    lint.add_argument("--json", action="store_true")
    lint.add_argument("--static", action="store_true", help="load and capacity checks only (no kernel registry, no coverage)")
    _bulk_arguments(lint)
    lint.set_defaults(func=cmd_lint)
    schema = commands.add_parser("schema", help="write the JSON Schema files", description="write the JSON Schema files")
    schema.add_argument("--out", help="folder (default: the package's schema/)")
    schema.add_argument("--check", action="store_true", help="fail if the committed files are stale")
    schema.set_defaults(func=cmd_schema)
    matrix = commands.add_parser("matrix", help="decide every cell of the categorical space (golden table + HTML)",
                                 description="decide every cell of the categorical space; write or check the golden table",
                                 epilog=_CACHE_HELP)
    _rules_option(matrix)
    matrix.add_argument("--out", default="matrix",
                        help="folder for the golden files (decisions/<platform>.txt) and the page index.html "
                             "(default matrix/)")
    matrix.add_argument("--check", action="store_true", help="fail (exit 2) listing every cell that differs from the golden table")
    matrix.add_argument("--limit", type=LIMIT, default=50, help="changed cells to print (default 50)")
    matrix.add_argument("--engine", default="auto", choices=["auto", "durable", "reference"],
                        help="evaluator; `--check --engine reference` is the engine differential over every cell")
    _bulk_arguments(matrix)
    matrix.set_defaults(func=cmd_matrix)
    diff = commands.add_parser("diff", help="which decisions change between two rule sets",
                               description="compare two rule sets (folders, files, or git refs of rules/) over the "
                                           "matrix and random configs", epilog=_CACHE_HELP)
    diff.add_argument("old", help="rules folder/file or git ref (e.g. main, HEAD~1, v0.1:rules)")
    diff.add_argument("new", help="rules folder/file or git ref")
    diff.add_argument("--random", type=RANDOM_CONFIGS, default=2000,
                      help="random configs beyond the matrix (default 2000)")
    diff.add_argument("--seed", type=SEED, default=0)
    diff.add_argument("--no-matrix", action="store_true", help="random configs only (quick)")
    diff.add_argument("--limit", type=LIMIT, default=50, help="changes to print (default 50)")
    diff.add_argument("--json", action="store_true")
    diff.add_argument("--fail-on-change", action="store_true", help="exit 1 when any decision changed (CI gate)")
    _bulk_arguments(diff)
    diff.set_defaults(func=cmd_diff)
    mutate = commands.add_parser("mutate", help="delete/negate/weaken each rule; report mutants the matrix misses",
                                 description="rule mutation testing against the decision matrix")
    _rules_option(mutate)
    mutate.add_argument("--sample", type=SAMPLE, help="test a seeded sample of this many mutants")
    mutate.add_argument("--seed", type=SEED, default=0)
    mutate.add_argument("--report", help="write a markdown report here")
    mutate.add_argument("--workers", type=WORKERS, default=os.cpu_count() or 1, help="processes (default: all cores)")
    mutate.add_argument("--json", action="store_true")
    mutate.set_defaults(func=cmd_mutate)
    conform = commands.add_parser(
        "conformance", help="compare decisions with vLLM 0.33's own selection (needs moerules[vllm])",
        description="run vLLM 0.33's select_*_moe_backend functions (platform and package probes stood in) and "
                    "decide over the matrix and random configs; report agreement, every disagreement by "
                    "responsible rule, and every named deviation")
    _rules_option(conform)
    conform.add_argument("--out", default="reports", help="folder for conformance.csv and conformance.md (default reports/)")
    conform.add_argument("--random", type=RANDOM_CONFIGS, default=2000,
                         help="random configs beyond the matrix (default 2000)")
    conform.add_argument("--seed", type=SEED, default=0)
    conform.add_argument("--family", help="only these vLLM select families, comma-separated: unquantized, fp8, "
                                          "int8, mxfp8, mxfp4, nvfp4, wna16, w4a8")
    conform.add_argument("--check", action="store_true",
                         help="re-check a sample against the committed report; exit 2 listing each changed config")
    conform.add_argument("--sample", type=SAMPLE, default=3000, help="configs --check re-runs (default 3000)")
    conform.add_argument("--limit", type=LIMIT, default=50, help="changed configs to print (default 50)")
    conform.add_argument("--quiet", action="store_true", help="no progress line")
    conform.set_defaults(func=cmd_conformance)
    test = commands.add_parser("test", help="run the cases beside each rule file (rules/cases/)",
                               description="run every case of rules/cases/ (config -> the rule's rejection or "
                                           "firing, and the winner); --coverage lists the rules no case defends")
    _rules_arguments(test)
    test.add_argument("--coverage", action="store_true", help="list the rules no case that holds names")
    test.add_argument("--min-coverage", type=bounded_int(0, 100), metavar="PERCENT",
                      help="fail (exit 1) when fewer rules than this have a case (implies --coverage)")
    test.add_argument("--suggest", action="store_true", help="print a draft case for each uncovered rule, from "
                                                             "the first matrix cell where it acts (review it)")
    test.set_defaults(func=cmd_test)
    run = commands.add_parser("run", help="decide, build the layer with seeded weights, run one forward",
                              usage=_CONFIG_USAGE.format("run"),
                              description="decide, build the layer with seeded weights, run one forward pass")
    config_arguments(run)
    run.add_argument("--tokens", type=bounded_int(1, MAX_RUN_TOKENS), default=16,
                     help="tokens in the forward pass (default 16)")
    run.add_argument("--seed", type=SEED, default=0)
    run.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    run.add_argument("--max-gib", type=positive_number, default=None,
                     help=f"largest weight footprint to generate, in GiB (default {DEFAULT_CPU_RUN_GIB:g} on a CPU; "
                          "a GPU's free memory)")
    run.add_argument("--quiet", action="store_true", help="no progress line (it shows only on a terminal anyway)")
    run.set_defaults(func=cmd_run)
    for sub in commands.choices.values():  # `moerules decide x --debug` as well as `moerules --debug decide x`
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = make_parser().parse_args(argv)
    except BrokenPipeError:  # `moerules --help | head`: the reader has all it wanted
        return _quiet_broken_pipe()
    return run_guarded(lambda: args.func(args), prog="moerules", debug=args.debug)


def _quiet_broken_pipe() -> int:
    """stdout's reader went away: say nothing (not even at exit, when Python flushes stdout again)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return BROKEN_PIPE


def run_guarded(action: Callable[[], int], *, prog: str, debug: bool) -> int:
    """The one error boundary of a command: its exit code, or 2 with one `prog: ...` line on stderr.

    Typed moerules errors and OS errors (a file or folder that cannot be read or written) are
    input errors; anything else is a bug in moerules, reported as one line that says so. `debug`
    lets every exception through with its traceback.
    """
    try:
        return action()
    except BrokenPipeError:  # `moerules decide --json | head -1`: as quiet as any Unix filter
        return _quiet_broken_pipe()
    except Exception as error:  # noqa: BLE001 - the boundary: every failure ends in one line and exit 2
        if debug:
            raise
        print(f"{prog}: {_one_line(error)}", file=sys.stderr)
        return INVALID
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED


def _one_line(error: Exception) -> str:
    if isinstance(error, (InputError, MoeRulesError)):
        return str(error)
    if isinstance(error, OSError):
        where = f"{error.filename}: " if error.filename is not None else ""
        return f"{where}{error.strerror or error}"
    if isinstance(error, MemoryError):
        return "out of memory; use a smaller config (fewer experts, tokens or a smaller hidden size)"
    return (f"internal error: {type(error).__name__}: {error} (a bug in moerules: rerun with --debug for the "
            "traceback and report it)")


if __name__ == "__main__":
    sys.exit(main())
