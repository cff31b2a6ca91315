"""JSON Schema files generated from the pydantic models (never written by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from moerules.config import MoEConfig
from moerules.decision import Decision
from moerules.engine.rulefile import RuleFile
from moerules.engine.textfile import is_regular_file

SCHEMAS = {"moeconfig.schema.json": MoEConfig, "decision.schema.json": Decision,
           "rulefile.schema.json": RuleFile}


def render() -> dict[str, str]:
    """File name -> JSON text of each schema."""
    texts = {}
    for name, model in SCHEMAS.items():
        schema = model.model_json_schema(mode="validation" if model is not Decision else "serialization")
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        texts[name] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return texts


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render().items():
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    return written


def stale(out: Path) -> list[str]:
    """Names of schema files in `out` that differ from what the models generate now."""
    return [name for name, text in render().items() if not _holds(out / name, text.encode("utf-8"))]


def _holds(path: Path, expected: bytes) -> bool:
    """Whether `path` is a regular file with exactly these bytes (reading no more than one byte past them)."""
    if not is_regular_file(path):
        return False
    try:
        with path.open("rb") as stream:
            return stream.read(len(expected) + 1) == expected
    except OSError:
        return False
