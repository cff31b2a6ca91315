"""`MoEConfig.from_hf`: Hugging Face config.json files of real models (their MoE fields, from the public
config.json of each model named in the file's `_source`) map to the right layer, and what does not map
is refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from moerules import MoEConfig, decide
from moerules.tools.cli.main import main
from moerules.errors import HFConfigError
from moerules.hf_config import hf_layers, hf_sections

CONFIGS = Path(__file__).parent / "configs"

# (config, expected model fields, expected quant fields, expected layer report)
REAL_MODELS = [
    ("qwen3-30b-a3b-fp8.json",
     dict(num_experts=128, top_k=8, hidden_size=2048, moe_intermediate_size=768, routing="softmax_renormalize"),
     dict(family="fp8_w8a8", weight_granularity="block128", activation_granularity="group128"),
     "MoE layers 0-47, no dense MLP layers; no shared experts per MoE layer"),
    ("mixtral-8x7b.json",
     dict(num_experts=8, top_k=2, hidden_size=4096, moe_intermediate_size=14336, routing="softmax_renormalize"),
     dict(family="unquantized"), "MoE layers 0-31, no dense MLP layers; no shared experts per MoE layer"),
    ("deepseek-v3.json",
     dict(num_experts=256, top_k=8, hidden_size=7168, moe_intermediate_size=2048, routing="deepseek_v3",
          routing_groups=8, routing_topk_groups=4, routed_scaling_factor=2.5, shared_experts=1,
          shared_intermediate_size=2048),
     dict(family="fp8_w8a8", weight_granularity="block128"),
     "MoE layers 3-60, dense MLP layers 0-2; 1 shared expert(s) of 2048 per MoE layer"),
    ("kimi-k2-instruct.json",
     dict(num_experts=384, top_k=8, moe_intermediate_size=2048, routing="deepseek_v3", routing_groups=1,
          routed_scaling_factor=2.827, shared_experts=1),
     dict(family="fp8_w8a8", weight_granularity="block128"),
     "MoE layers 1-60, dense MLP layers 0; 1 shared expert(s) of 2048 per MoE layer"),
    ("gpt-oss-120b.json",
     dict(num_experts=128, top_k=4, hidden_size=2880, moe_intermediate_size=2880, activation="swigluoai",
          has_bias=True, routing="renormalize", swiglu_limit=7.0, swiglu_alpha=1.702),
     dict(family="mxfp4_w4a16"), "MoE layers 0-35, no dense MLP layers; no shared experts per MoE layer"),
    ("llama-4-scout-17b-16e.json",
     dict(num_experts=16, top_k=1, hidden_size=5120, moe_intermediate_size=8192, routing="llama4", shared_experts=1,
          shared_intermediate_size=8192),
     dict(family="unquantized"), "MoE layers 0-47, no dense MLP layers; 1 shared expert(s) of 8192 per MoE layer"),
    ("qwen1.5-moe-a2.7b.json",
     dict(num_experts=60, top_k=4, moe_intermediate_size=1408, routing="softmax", shared_experts=1,
          shared_intermediate_size=5632),
     dict(family="unquantized"), "MoE layers 0-23, no dense MLP layers; 1 shared expert(s) of 5632 per MoE layer"),
    ("deepseek-v2.json",
     dict(num_experts=160, top_k=6, moe_intermediate_size=1536, routing="softmax", routing_groups=8,
          routing_topk_groups=3, routed_scaling_factor=16.0, shared_experts=2, shared_intermediate_size=3072),
     dict(family="unquantized"), "MoE layers 1-59, dense MLP layers 0; 2 shared expert(s) of 3072 per MoE layer"),
    ("glm-4.5-air.json",
     dict(num_experts=128, top_k=8, moe_intermediate_size=1408, routing="deepseek_v3", routing_groups=1,
          shared_experts=1, shared_intermediate_size=1408),
     dict(family="unquantized"), "MoE layers 1-45, dense MLP layers 0; 1 shared expert(s) of 1408 per MoE layer"),
    ("olmoe-1b-7b.json",
     dict(num_experts=64, top_k=8, hidden_size=2048, moe_intermediate_size=1024, routing="softmax"),
     dict(family="unquantized"), "MoE layers 0-15, no dense MLP layers; no shared experts per MoE layer"),
    ("granite-3.0-3b-a800m.json",
     dict(num_experts=40, top_k=8, hidden_size=1536, moe_intermediate_size=512, routing="renormalize"),
     dict(family="unquantized"), "MoE layers 0-31, no dense MLP layers; no shared experts per MoE layer"),
]


@pytest.mark.parametrize("name, model, quant, layers", REAL_MODELS, ids=[m[0] for m in REAL_MODELS])
def test_real_model_configs_map_to_their_moe_layer(name, model, quant, layers):
    config = MoEConfig.from_hf(CONFIGS / name)
    assert {field: getattr(config.model, field) for field in model} == {
        field: type(getattr(config.model, field))(value) for field, value in model.items()}
    assert config.model.architecture == json.loads((CONFIGS / name).read_text())["model_type"]
    assert {field: getattr(config.quant, field) for field in quant} == {
        field: type(getattr(config.quant, field))(value) for field, value in quant.items()}
    assert hf_layers(CONFIGS / name).describe() == layers


def test_the_dense_intermediate_size_is_never_taken_for_the_experts():
    data = json.loads((CONFIGS / "qwen3-30b-a3b-fp8.json").read_text())
    assert (data["intermediate_size"], MoEConfig.from_hf(data).model.moe_intermediate_size) == (6144, 768)


def test_platform_and_parallel_join_the_mapped_sections():
    config = MoEConfig.from_hf(CONFIGS / "deepseek-v3.json", platform={"vendor": "cuda", "arch": "sm_90"},
                               parallel={"tp": 8})
    assert (config.parallel.tp, config.intermediate_per_partition) == (8, 256)


def test_a_dense_layer_is_reported_not_guessed():
    with pytest.raises(HFConfigError) as raised:
        MoEConfig.from_hf(CONFIGS / "deepseek-v3.json", layer=2)
    assert str(raised.value).endswith("num_hidden_layers: layer 2 is not a MoE layer (MoE layers 3-60, dense MLP "
                                      "layers 0-2; 1 shared expert(s) of 2048 per MoE layer); there is no MoE "
                                      "decision to make for it")
    assert MoEConfig.from_hf(CONFIGS / "deepseek-v3.json", layer=3).model.num_experts == 256


@pytest.mark.parametrize("change, field, fragment", [
    ({"model_type": "llama"}, "model_type", "'llama' is not a MoE architecture moerules maps; known: deepseek_v2"),
    ({"num_experts": None}, "num_experts", "missing"),
    ({"num_experts": "128"}, "num_experts", "expected int, got '128'"),
    ({"hidden_act": "quick_gelu"}, "hidden_act", "'quick_gelu' is not mapped"),
    ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype", "'float8_e4m3fn' is not an activation dtype"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config.quant_method",
     "'bitsandbytes' is not mapped; known: fp8, mxfp4, compressed-tensors, modelopt, gptq, awq"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
     "quantization_config.weight_block_size", "only 128x128 weight blocks are mapped"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128}}, "quantization_config.bits",
     "only 4-bit gptq weights (WNA16) are mapped"),
    ({"decoder_sparse_step": 2, "mlp_only_layers": list(range(48))}, "num_hidden_layers", "no MoE layer"),
])
def test_what_does_not_map_is_refused_naming_the_field(change, field, fragment):
    data = {**json.loads((CONFIGS / "qwen3-30b-a3b-fp8.json").read_text()), **change}
    with pytest.raises(HFConfigError) as raised:
        MoEConfig.from_hf(data)
    assert raised.value.field == field and fragment in str(raised.value), str(raised.value)


def test_deepseek_routing_fields_that_vllm_cannot_name_are_refused():
    data = {**json.loads((CONFIGS / "deepseek-v3.json").read_text()), "norm_topk_prob": False}
    with pytest.raises(HFConfigError, match="norm_topk_prob: false: vLLM has no routing method"):
        MoEConfig.from_hf(data)


# quantization_config sections as the named checkpoints publish them.
QUANT_CONFIGS = [
    ("RedHatAI/Qwen3-30B-A3B-FP8-dynamic", {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
     dict(family="fp8_w8a8", checkpoint="compressed_tensors", weight_granularity="channel",
          activation_granularity="token")),
    ("compressed-tensors FP8 block", {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                  "dynamic": True}}}},
     dict(family="fp8_w8a8", checkpoint="compressed_tensors", weight_granularity="block128",
          activation_granularity="group128")),
    ("RedHatAI/Qwen3-30B-A3B-quantized.w4a16", {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True},
            "input_activations": None}}},
     dict(family="wna16", checkpoint="compressed_tensors", weight_granularity="group128")),
    ("compressed-tensors W8A8 INT8", {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     dict(family="int8_w8a8", checkpoint="compressed_tensors")),
    ("compressed-tensors W4A8 (int4 weights, fp8 activations)", {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
     dict(family="w4a8", checkpoint="compressed_tensors")),
    ("RedHatAI/Qwen3-30B-A3B-NVFP4", {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
            "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                  "dynamic": "local"}}}},
     dict(family="nvfp4", checkpoint="compressed_tensors")),
    ("nvidia ModelOpt NVFP4", {"quant_method": "modelopt", "quant_algo": "NVFP4"},
     dict(family="nvfp4", checkpoint="modelopt")),
    ("nvidia ModelOpt FP8", {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}},
     dict(family="fp8_w8a8", checkpoint="modelopt", weight_granularity="tensor", activation_dynamic=False)),
    ("nvidia ModelOpt MXFP8", {"quant_method": "modelopt", "quant_algo": "MXFP8"},
     dict(family="mxfp8", checkpoint="modelopt")),
    ("Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
     dict(family="wna16", weight_granularity="group128", checkpoint="native")),
    ("AWQ 4-bit", {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
     dict(family="wna16", weight_granularity="group128")),
    ("FP8 per-tensor, static activations", {"quant_method": "fp8", "activation_scheme": "static"},
     dict(family="fp8_w8a8", weight_granularity="tensor", activation_granularity="tensor", activation_dynamic=False)),
]


@pytest.mark.parametrize("name, quantization, expected", QUANT_CONFIGS, ids=[q[0] for q in QUANT_CONFIGS])
def test_quantization_configs_map_to_families_and_keys(name, quantization, expected):
    data = {**json.loads((CONFIGS / "qwen3-30b-a3b-fp8.json").read_text()), "quantization_config": quantization}
    quant = MoEConfig.from_hf(data).quant
    assert {field: getattr(quant, field) for field in expected} == {
        field: type(getattr(quant, field))(value) for field, value in expected.items()}


def test_compressed_tensors_schemes_that_disagree_are_refused():
    group = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    other = {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}
    data = {**json.loads((CONFIGS / "mixtral-8x7b.json").read_text()), "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"a": group, "b": other}}}
    with pytest.raises(HFConfigError, match=r"config_groups: 2 different schemes \(a, b\)"):
        MoEConfig.from_hf(data)


def test_a_mapped_scheme_the_family_refuses_names_the_quant_field():
    data = {**json.loads((CONFIGS / "mixtral-8x7b.json").read_text()), "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"g": {
            "weights": {"num_bits": 8, "type": "int", "strategy": "tensor"},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token"}}}}}
    with pytest.raises(ValidationError, match="weight_granularity='tensor' is not valid for family 'int8_w8a8'"):
        MoEConfig.from_hf(data)


def test_transformers_own_config_classes_map_the_same_way():
    transformers = pytest.importorskip("transformers")
    qwen = transformers.Qwen3MoeConfig(num_experts=128, num_experts_per_tok=8, hidden_size=2048,
                                       intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=4)
    assert MoEConfig.from_hf(qwen.to_dict()).model.moe_intermediate_size == 768
    deepseek = transformers.DeepseekV3Config(n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=3,
                                             first_k_dense_replace=1, num_hidden_layers=4)
    model = MoEConfig.from_hf(deepseek.to_dict()).model
    assert (model.num_experts, model.routing.value, model.routing_groups, model.routing_topk_groups) == (
        64, "deepseek_v3", 8, 3)
    assert hf_layers(deepseek.to_dict()).dense_layers == (0,)
    gpt_oss = transformers.GptOssConfig(num_local_experts=8, num_experts_per_tok=2, swiglu_limit=5.0,
                                        num_hidden_layers=2)
    assert MoEConfig.from_hf(gpt_oss.to_dict()).model.swiglu_limit == 5.0
    mixtral = transformers.MixtralConfig(num_local_experts=4, intermediate_size=96, num_hidden_layers=2)
    assert hf_sections(mixtral.to_dict())["model"]["moe_intermediate_size"] == 96


def test_the_cli_decides_from_a_hf_config(capsys):
    argv = ["explain", "--hf-config", str(CONFIGS / "qwen3-30b-a3b-fp8.json"), "--platform", "rocm:gfx942",
            "--packages", "triton,aiter"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ("config: E=128 top_k=8 hidden=2048 moe_intermediate=768 (768/partition) silu bf16 "
            "routing=softmax_renormalize quant=fp8_w8a8 (w block128, a group128 dynamic) | tp=1 dp=1 ep=1 "
            "all2all=False | rocm gfx942") in " ".join(out.split())  # the config line wraps to the terminal
    decision = decide(MoEConfig.from_hf(CONFIGS / "qwen3-30b-a3b-fp8.json",
                                        platform={"vendor": "rocm", "arch": "gfx942", "packages": ["triton", "aiter"]}))
    assert f"experts:          {decision.backend} " in out


def test_the_cli_refuses_a_dense_layer_and_a_second_source(capsys, tmp_path):
    assert main(["decide", "--hf-config", str(CONFIGS / "deepseek-v3.json"), "--hf-layer", "0"]) == 2
    assert "num_hidden_layers: layer 0 is not a MoE layer" in capsys.readouterr().err
    assert main(["decide", "--hf-config", str(CONFIGS), "--model", "mixtral-8x7b"]) == 2
    assert "give one of a config file, --model or --hf-config" in capsys.readouterr().err
    assert main(["decide", "--hf-config", str(tmp_path)]) == 2
    assert "config.json: cannot read it" in capsys.readouterr().err


FP8_CHANNEL = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
               "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}


@pytest.mark.parametrize("config_file, exclusions, family", [
    ("qwen3-30b-a3b-fp8.json", {"ignore": ["lm_head", "re:.*mlp.gate$"]}, "fp8_w8a8"),
    ("qwen3-30b-a3b-fp8.json", {"ignore": ["lm_head", "re:.*mlp[.]experts.*"]}, "unquantized"),
    ("qwen3-30b-a3b-fp8.json", {"ignore": ["model.layers.*.mlp"]}, "unquantized"),
    ("mixtral-8x7b.json", {"modules_to_not_convert": ["block_sparse_moe"]}, "unquantized"),
    ("mixtral-8x7b.json", {"modules_to_not_convert": ["block_sparse_moe.gate"]}, "fp8_w8a8"),
])
def test_experts_a_checkpoint_leaves_unquantised_are_unquantised(config_file, exclusions, family):
    data = {**json.loads((CONFIGS / config_file).read_text()), "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": FP8_CHANNEL}, **exclusions}}
    assert MoEConfig.from_hf(data).quant.family.value == family
