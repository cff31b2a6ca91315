"""Config builders for decision-level tests."""

from __future__ import annotations

from moerules.config import MoEConfig


def config(model=None, **sections) -> MoEConfig:
    """A config with a small default model; keyword sections override (quant=..., platform=...)."""
    base = dict(num_experts=8, top_k=2, hidden_size=4096, moe_intermediate_size=14336)
    return MoEConfig(model={**base, **(model or {})}, **sections)


def cuda(arch="sm_90", *packages) -> dict:
    return {"vendor": "cuda", "arch": arch, "packages": ["triton", *packages]}


def rocm(arch="gfx950", *packages) -> dict:
    return {"vendor": "rocm", "arch": arch, "packages": ["triton", *packages]}
