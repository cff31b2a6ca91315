"""A transformers MoE block against the same block on a moerules layer (`replace_moe`'s MoERulesBlock), on a GPU.

    python bench/hf_moe.py --out DIR          # on the H100; writes hf_moe.md and hf_moe.json

Models: one MoE layer of Qwen3-30B-A3B and of Mixtral-8x7B (shapes from tests/hf/configs), bf16 weights
N(0, 0.02^2) (random: routing is what a random router gives). Boundary: hidden states [M, H] in, [M, H]
out, the block's router included on both sides. transformers runs its own experts implementations:
`eager` (a Python loop over the hit experts) and `grouped_mm` (torch's grouped GEMM); moerules runs the
layer `decide()` picks for the detected platform. Timing: `triton.testing.do_bench` median, eager mode on
both sides (transformers' loop reads expert ids on the host, so it cannot be captured in a CUDA graph).
Each row also gives the relative error of moerules' output against transformers' eager output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moerules.config import MoEConfig  # noqa: E402
from moerules.engine.decide import decide  # noqa: E402
from moerules.tools.detect import detect  # noqa: E402
from moerules.kernels.builder import build  # noqa: E402
from moerules.integrations.transformers import BLOCKS, MoERulesBlock  # noqa: E402
from moerules.kernels.scheme import Scheme  # noqa: E402
from moerules.kernels.weights import MoEWeights  # noqa: E402

CONFIGS = ROOT / "tests" / "hf" / "configs"
MODELS = {"qwen3-30b-a3b": ("qwen3-30b-a3b-fp8.json", "Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeSparseMoeBlock"),
          "mixtral-8x7b": ("mixtral-8x7b.json", "MixtralConfig", "mixtral", "MixtralSparseMoeBlock")}
M_LIST = (1, 16, 128, 1024, 4096)


def hf_block(name: str, implementation: str):
    import importlib
    import transformers
    file, config_class, module, block_class = MODELS[name]
    data = json.loads((CONFIGS / file).read_text())
    data = {k: v for k, v in data.items() if not k.startswith("_") and k != "quantization_config"}
    config = getattr(transformers, config_class)(**data)
    config._experts_implementation = implementation
    block_type = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), block_class)
    torch.manual_seed(0)
    block = block_type(config).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02)
    return block.eval(), data


def moerules_block(block, data):
    config = MoEConfig.from_hf(data, platform=detect())
    decision = decide(config)
    experts = block.experts   # transformers 5 keeps [E, 2I, H] (gate rows, then up) and [E, H, I]: ours
    weights = MoEWeights(w13=experts.gate_up_proj.data, w2=experts.down_proj.data,
                         scheme=Scheme.from_quant(config.quant), in_dtype=config.model.in_dtype)
    return MoERulesBlock(router=block.gate, shared=None, layer=build(decision, weights), decision=decision,
                         returns_scores=BLOCKS[data["model_type"]].returns_scores), decision


def time_us(fn) -> float:
    import triton.testing
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def run(out: Path) -> None:
    rows = []
    for name in MODELS:
        eager, data = hf_block(name, "eager")
        grouped, _ = hf_block(name, "grouped_mm")   # the same seed: the same weights
        ours, decision = moerules_block(eager, data)
        for m in M_LIST:
            x = torch.randn(1, m, data["hidden_size"], device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(m))
            with torch.no_grad():
                want, got = eager(x), ours(x)
                row = {"model": name, "M": m, "moerules_backend": decision.backend,
                       "rel_err_vs_eager": ((got.float() - want.float()).norm() / want.float().norm()).item(),
                       "transformers_eager_us": time_us(lambda: eager(x)),
                       "transformers_grouped_mm_us": time_us(lambda: grouped(x)),
                       "moerules_us": time_us(lambda: ours(x))}
            row["speedup_vs_eager"] = row["transformers_eager_us"] / row["moerules_us"]
            row["speedup_vs_grouped_mm"] = row["transformers_grouped_mm_us"] / row["moerules_us"]
            print(json.dumps(row), flush=True)
            rows.append(row)
        del eager, grouped, ours
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_moe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                 "rows": rows}, indent=1))
    (out / "hf_moe.md").write_text(_table(rows))


def _table(rows) -> str:
    lines = [f"# transformers MoE block vs moerules ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             "Produced by `bench/hf_moe.py` (protocol in its docstring). Times in µs, do_bench median, eager.", "",
             "| model | M | transformers eager | transformers grouped_mm | moerules (backend) | x eager | "
             "x grouped_mm | rel err vs eager |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['M']} | {r['transformers_eager_us']:.0f} | "
                     f"{r['transformers_grouped_mm_us']:.0f} | {r['moerules_us']:.0f} ({r['moerules_backend']}) | "
                     f"{r['speedup_vs_eager']:.1f} | {r['speedup_vs_grouped_mm']:.2f} | {r['rel_err_vs_eager']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hf")
    run(parser.parse_args().out)
