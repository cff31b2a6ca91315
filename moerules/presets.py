"""Model shapes people ask about by name (`--model mixtral-8x7b`), from the published configs."""

from __future__ import annotations

import difflib

PRESETS: dict[str, dict] = {
    "mixtral-8x7b": {"model": dict(num_experts=8, top_k=2, hidden_size=4096, moe_intermediate_size=14336)},
    "qwen3-30b-a3b": {"model": dict(num_experts=128, top_k=8, hidden_size=2048, moe_intermediate_size=768)},
    "deepseek-v3": {"model": dict(num_experts=256, top_k=8, hidden_size=7168, moe_intermediate_size=2048,
                                  routing="deepseek_v3"),
                    "quant": dict(family="fp8_w8a8", weight_granularity="block128")},
    "gpt-oss-120b": {"model": dict(num_experts=128, top_k=4, hidden_size=2880, moe_intermediate_size=2880,
                                   activation="swigluoai", has_bias=True),
                     "quant": dict(family="mxfp4_w4a16")},
    "gpt-oss-20b": {"model": dict(num_experts=32, top_k=4, hidden_size=2880, moe_intermediate_size=2880,
                                  activation="swigluoai", has_bias=True),
                    "quant": dict(family="mxfp4_w4a16")},
}


def preset(name: str) -> dict:
    """The config sections of a preset (a fresh copy); KeyError lists the known names."""
    key = name.strip().lower()
    if key not in PRESETS:
        close = difflib.get_close_matches(key, list(PRESETS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KeyError(f"unknown model preset {name!r}{hint}; known: {', '.join(sorted(PRESETS))}")
    return {section: dict(values) for section, values in PRESETS[key].items()}
