"""Where the shipped data folders (default rules, JSON Schema) live: inside the package.

In a wheel they are installed as `moerules/rules` and `moerules/schema`; in a checkout those are
symlinks to the repo's top-level folders, so both layouts read the same path.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def default_rules_dir() -> Path:
    return _PACKAGE / "rules"


def schema_dir() -> Path:
    return _PACKAGE / "schema"
