"""The field table: every name a rule condition may read, with its type.

It is generated from the pydantic models, so a new config field is readable by rules
(and documented by `moerules schema`) without being declared twice.
"""

from __future__ import annotations

import typing
from enum import Enum
from functools import lru_cache
from typing import Iterable

from pydantic import BaseModel

from moerules.config import ModelShape, MoEConfig, Package
from moerules.decision import ActivationFormat
from moerules.quant import Checkpoint, Granularity, QuantDtype, QuantFamily, ScaleDtype
from moerules.engine.expr import FieldSpec

# The pin is the engine's business: a rule that read it could quietly override the policy
# "a pinned backend is honoured or the decision fails".
_HIDDEN = {"features.backend"} | {f"model.{name}" for name in ModelShape.MATH_ONLY_FIELDS}


def _spec(path: str, annotation) -> FieldSpec:
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return FieldSpec(path, "enum", tuple(member.value for member in annotation))
    kind = {bool: "bool", int: "int", str: "str"}.get(annotation)
    if kind is None:
        raise TypeError(f"config field {path} has a type rules cannot compare: {annotation}")
    return FieldSpec(path, kind)


def _walk(model: type[BaseModel], prefix: str) -> Iterable[FieldSpec]:
    annotations = {name: info.annotation for name, info in model.model_fields.items()}
    annotations.update({name: info.return_type for name, info in model.model_computed_fields.items()})
    for name, annotation in annotations.items():
        path = f"{prefix}{name}"
        if path in _HIDDEN or path == "quant":
            continue
        if typing.get_origin(annotation) is frozenset:  # the package set becomes one flag per package
            yield from (FieldSpec(f"{path}.{package.value}", "bool") for package in Package)
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _walk(annotation, path + ".")
        else:
            yield _spec(path, annotation)


def _quant_fields() -> Iterable[FieldSpec]:
    yield _spec("quant.family", QuantFamily)
    yield _spec("quant.checkpoint", Checkpoint)
    for operand in ("weight", "activation"):
        base = f"quant.{operand}"
        yield FieldSpec(f"{base}.quantized", "bool")
        yield FieldSpec(f"{base}.dynamic", "bool")
        for name, enum in (("dtype", QuantDtype), ("granularity", Granularity), ("scale_dtype", ScaleDtype)):
            yield FieldSpec(f"{base}.{name}", "enum", ("none",) + tuple(m.value for m in enum))


@lru_cache(maxsize=None)
def config_fields() -> dict[str, FieldSpec]:
    """Fields of the config fact (`MoEConfig.facts()`)."""
    specs = list(_walk(MoEConfig, "")) + list(_quant_fields())
    return {spec.path: spec for spec in specs}


def backend_fields(backend_ids: Iterable[str]) -> dict[str, FieldSpec]:
    """Static capabilities of a backend, resolved per backend when a constraint is compiled."""
    specs = [FieldSpec(f"backend.{name}", "bool", fact="backend")
             for name in ("monolithic", "lora", "bias", "expert_map", "batch_invariant")]
    specs.append(FieldSpec("backend.format", "enum", tuple(f.value for f in ActivationFormat), fact="backend"))
    specs.append(FieldSpec("backend.id", "enum", tuple(backend_ids), fact="backend"))
    return {spec.path: spec for spec in specs}


def plan_fields(backends: Iterable[str], dispatchers: Iterable[str], with_placement: bool) -> dict[str, FieldSpec]:
    """Plan facts readable by `plan` rules; the placement is known only in the quantization stage."""
    specs = [FieldSpec("plan.backend", "enum", tuple(backends), fact="plan"),
             FieldSpec("plan.dispatcher", "enum", tuple(dispatchers), fact="plan")]
    if with_placement:
        specs.append(FieldSpec("plan.expects_unquantized_inputs", "bool", fact="plan"))
    return {spec.path: spec for spec in specs}


def flatten(facts: dict, prefix: str = "") -> dict[str, object]:
    """{'a': {'b': 1}} -> {'a.b': 1}: the dotted view used for message placeholders."""
    flat: dict[str, object] = {}
    for key, value in facts.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
