"""Where the shipped data folders (default rules, JSON Schema) live.

In a wheel they are installed inside the package (`moerules/rules`, `moerules/schema`);
in a source checkout or an editable install they are the top-level folders of the repo.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    installed = _PACKAGE / name
    return installed if installed.is_dir() else _PACKAGE.parent / name


def default_rules_dir() -> Path:
    return _data_dir("rules")


def schema_dir() -> Path:
    return _data_dir("schema")
