"""Round trip through transformers: a tiny random-initialised model (no download) is saved as a safetensors
checkpoint, its MoE blocks are replaced by moerules layers loaded from that checkpoint (`replace_moe`),
and the logits match the original model's.

Tolerance: fp32 models; the experts run on torch.reference (the CPU decision) with another summation
order than transformers' loops, so logits agree to a relative (Frobenius) error of 1e-5; a wrong layout,
routing or missing shared expert gives errors of order 1.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from moerules.activation import SwigluParams  # noqa: E402
from moerules.errors import CheckpointError, KernelUnavailableError  # noqa: E402
from moerules.integrations.hf_checkpoint import load_experts  # noqa: E402
from moerules.integrations.transformers import MoERulesBlock, replace_moe  # noqa: E402
from moerules.kernels.mx import dequantize_mx, quantize_mx  # noqa: E402
from moerules.kernels.quantize import dequantize_weight, quantize_weight  # noqa: E402
from moerules.quant import Granularity  # noqa: E402

CPU = {"vendor": "cpu", "arch": "x86_64", "packages": []}
TOLERANCE = 1e-5
ATTENTION = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)

MODELS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **ATTENTION, intermediate_size=48, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **ATTENTION, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **ATTENTION, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **ATTENTION, intermediate_size=64, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["full_attention", "full_attention"])),
}


def tiny_model(name: str):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    for module in model.modules():  # transformers starts the correction bias at zero: make it steer
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(torch.randn_like(module.e_score_correction_bias) * 0.05)
    for name_, param in model.named_parameters():  # gpt-oss starts its expert biases at zero too
        if name_.endswith("_bias") and not param.abs().sum():
            param.data.normal_(0.0, 0.02)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def relative_error(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


def round_trip(model, checkpoint):
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    want = logits(model, ids)
    decisions = replace_moe(model, checkpoint, platform=CPU)
    return relative_error(logits(model, ids), want), decisions


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_logits_match_after_the_moe_blocks_are_replaced(name, tmp_path):
    model = tiny_model(name)
    model.save_pretrained(tmp_path)
    error, decisions = round_trip(model, tmp_path)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoERulesBlock)]
    assert moe_layers == ([1, 2] if name == "deepseek_v3" else [0, 1])
    assert {d.backend for d in decisions} == {"torch_reference"}
    assert error < TOLERANCE, error


def test_the_round_trip_fails_when_a_shared_expert_is_left_out(tmp_path):
    """The tolerance above is tight enough to see a dropped shared expert."""
    model = tiny_model("deepseek_v3")
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    want = logits(model, ids)
    replace_moe(model, tmp_path, platform=CPU)
    for layer in model.model.layers[1:]:
        layer.mlp.layer.shared_experts = None
    assert relative_error(logits(model, ids), want) > 100 * TOLERANCE


def quantize_gpt_oss_experts(model, checkpoint) -> None:
    """Round the model's experts to MXFP4 in place and write them to the checkpoint as gpt-oss does
    (`*_blocks` [E, N, K/32, 16], `*_scales` [E, N, K/32]) with quant_method mxfp4."""
    tensors = load_file(checkpoint / "model.safetensors")
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, name)               # [E, K, N] in transformers
            packed, scales = quantize_mx(param.data.transpose(1, 2), fp4=True)
            param.data.copy_(dequantize_mx(packed, scales, torch.float32).transpose(1, 2))
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors[key + "_blocks"] = packed.reshape(*packed.shape[:2], -1, 16).contiguous()
            tensors[key + "_scales"] = scales.contiguous()
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (checkpoint / "config.json").write_text(json.dumps(config))


def test_gpt_oss_mxfp4_checkpoint_runs_as_mxfp4(tmp_path):
    model = tiny_model("gpt_oss")
    model.save_pretrained(tmp_path)
    quantize_gpt_oss_experts(model, tmp_path)
    error, decisions = round_trip(model, tmp_path)
    assert {d.config.quant.family.value for d in decisions} == {"mxfp4_w4a16"}
    assert {layer.mlp.layer.weights.scheme.cell for layer in model.model.layers} == {"mxfp4_w4a16/group32"}
    assert error < TOLERANCE, error


def test_our_mxfp4_layout_is_the_one_transformers_reads(tmp_path):
    """transformers dequantises the same checkpoint (on CPU) to the same expert weights."""
    model = tiny_model("gpt_oss")
    model.save_pretrained(tmp_path)
    quantize_gpt_oss_experts(model, tmp_path)
    reloaded = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32)
    for ours, theirs in zip(model.model.layers, reloaded.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(ours.mlp.experts, name).data, getattr(theirs.mlp.experts, name).data.float())


def test_a_checkpoint_without_the_layer_tensors_is_a_typed_error(tmp_path):
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert load_experts(tmp_path, 0).num_experts == 4
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.block_sparse_moe.experts.3.w3.weight' is "
                                              r"missing"):
        load_experts(tmp_path, 1)


def test_unmapped_architectures_are_refused_by_name(tmp_path):
    torch.manual_seed(0)
    model = transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2))
    model.save_pretrained(tmp_path)
    with pytest.raises(KernelUnavailableError, match="MoE blocks of model_type 'granitemoe' are not replaced"):
        replace_moe(model, tmp_path, platform=CPU)


def test_gpt_oss_swiglu_limit_and_alpha_come_from_the_checkpoint_config(tmp_path):
    """A limit that clamps these small activations (~0.2): the kernels must use the model's values."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **ATTENTION, intermediate_size=64, num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["full_attention"], swiglu_limit=0.1, swiglu_alpha=1.2)).eval()
    model.save_pretrained(tmp_path)
    error, decisions = round_trip(model, tmp_path)
    assert (decisions[0].config.model.swiglu_limit, decisions[0].config.model.swiglu_alpha) == (0.1, 1.2)
    assert error < TOLERANCE, error
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    want = logits(transformers.GptOssForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval(), ids)
    model.model.layers[0].mlp.layer.experts.swiglu = SwigluParams()
    assert relative_error(logits(model, ids), want) > 100 * TOLERANCE


def quantize_qwen3_experts_block_fp8(model, checkpoint) -> None:
    """Round the experts to 128x128 block FP8 in place and write them as the Qwen3-FP8 / DeepSeek-V3
    checkpoints do: per expert `weight` float8_e4m3fn and `weight_scale_inv` [N/128, K/128]."""
    tensors = load_file(checkpoint / "model.safetensors")
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        halves = experts.gate_up_proj.data.chunk(2, dim=1)              # [E, 2I, H]: gate rows, then up rows
        for name, weight in (("gate_proj", halves[0]), ("up_proj", halves[1]), ("down_proj", experts.down_proj.data)):
            q, scale = quantize_weight(weight, dtype=torch.float8_e4m3fn, granularity=Granularity.block128)
            weight.copy_(dequantize_weight(q, scale, granularity=Granularity.block128).float())
            for e in range(weight.shape[0]):
                key = f"model.layers.{i}.mlp.experts.{e}.{name}"
                tensors[key + ".weight"] = q[e].contiguous()
                tensors[key + ".weight_scale_inv"] = scale[e].contiguous()
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    (checkpoint / "config.json").write_text(json.dumps(config))


def test_block_fp8_experts_load_as_the_checkpoint_stores_them(tmp_path):
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=1, num_experts=4,
        num_experts_per_tok=2)).eval()
    model.save_pretrained(tmp_path)
    quantize_qwen3_experts_block_fp8(model, tmp_path)
    weights = load_experts(tmp_path, 0)
    assert weights.scheme.cell == "fp8_w8a8/block128/group128" and weights.w13_scale.shape == (4, 2, 1)
    experts = model.model.layers[0].mlp.experts
    for ours, theirs in ((weights.w13, experts.gate_up_proj), (weights.w2, experts.down_proj)):
        scale = weights.w13_scale if ours is weights.w13 else weights.w2_scale
        assert torch.equal(dequantize_weight(ours, scale, granularity=Granularity.block128).float(), theirs.data)
    # The layer quantises activations per 1x128 group to FP8 as well (W8A8): that rounding, not the
    # weights, bounds the logits' agreement (e4m3 keeps 3 mantissa bits: ~3% per element; 2.8e-3 measured).
    error, _ = round_trip(model, tmp_path)
    assert error < 3e-2, error
