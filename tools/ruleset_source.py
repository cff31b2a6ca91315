"""Where a rule set comes from: a folder, a file, or a git ref of the rules folder."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from moerules.errors import RuleFileError, RuleSetError
from moerules.engine.loader import load_rules
from moerules.engine.textfile import is_folder, is_regular_file
from moerules.engine.ruleset import RuleSet


def resolve(spec: str, repo: Path = Path(".")) -> RuleSet:
    """`spec` is a rules folder/file, or `REF` / `REF:path` naming the rules folder at a git ref."""
    if is_folder(Path(spec)) or is_regular_file(Path(spec)):
        return load_rules(spec)
    ref, _, folder = spec.partition(":")
    folder = folder or "rules"
    listing = _git(repo, "ls-tree", "--name-only", f"{ref}:{folder}")
    if listing is None:
        raise RuleSetError([RuleFileError(f"neither a path nor a git ref with a {folder}/ folder "
                                          f"(try a branch, a commit, or REF:path/to/rules)", file=spec)])
    # The loaded RuleSet holds everything it read, so the extracted files can go at once.
    with tempfile.TemporaryDirectory(prefix="moerules-rules-") as out:
        for name in listing.split():
            if name.endswith(".yaml"):
                (Path(out) / name).write_text(_git(repo, "show", f"{ref}:{folder}/{name}") or "", encoding="utf-8")
        return load_rules(out)


def _git(repo: Path, *args: str):
    try:
        result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, errors="replace",
                                check=False)
    except FileNotFoundError:
        return None
    return result.stdout if result.returncode == 0 else None
