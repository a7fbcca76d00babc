"""ModelConfig.from_hf_dict: HF's derivations (checked against transformers' DeepseekV4Config),
legacy released keys, and clear rejection of V4.1 features in V4 configs (V4.1 configs:
test_v41_config.py)."""

from __future__ import annotations

import json

import pytest
from sgl_dspark.srt.configs.model_config import (
    CSA,
    HCA,
    SLIDING,
    ModelConfig,
    UnsupportedConfigError,
)
from transformers import DeepseekV4Config


def _hf_derived(hf: DeepseekV4Config) -> dict:
    rp = hf.rope_parameters
    return {
        "layer_types": tuple(hf.layer_types),
        "mlp_layer_types": tuple(hf.mlp_layer_types),
        "qk_rope_head_dim": hf.qk_rope_head_dim,
        "compress_rates": dict(hf.compress_rates),
        "main_theta": rp["main"]["rope_theta"],
        "compress_theta": rp["compress"]["rope_theta"],
        "compress_type": rp["compress"]["rope_type"],
        "factor": rp["compress"].get("factor", 1.0),
    }


def _ours(cfg: ModelConfig) -> dict:
    return {
        "layer_types": cfg.layer_types,
        "mlp_layer_types": cfg.mlp_layer_types,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "compress_rates": dict(cfg.compress_rates),
        "main_theta": cfg.rope_main.theta,
        "compress_theta": cfg.rope_compress.theta,
        "compress_type": cfg.rope_compress.rope_type,
        "factor": cfg.rope_compress.factor,
    }


CASES = {
    "defaults": dict(num_hidden_layers=7),
    "legacy_released": dict(
        num_hidden_layers=5,
        compress_ratios=[0, 4, 128, 4, 128, 0],
        num_hash_layers=2,
        qk_rope_head_dim=64,
        head_dim=512,
        compress_rope_theta=40000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        max_position_embeddings=1048576,
    ),
    "legacy_scalar_rates": dict(
        num_hidden_layers=4,
        compress_rate_csa=8,
        compress_rate_hca=64,
        layer_types=[SLIDING, CSA, HCA, CSA],
    ),
    "explicit_nested_rope": dict(
        num_hidden_layers=3,
        partial_rotary_factor=0.25,
        head_dim=64,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        max_position_embeddings=256,
        mlp_layer_types=["moe", "hash_moe", "moe"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_derivations_match_transformers(name):
    kwargs = CASES[name]
    hf = DeepseekV4Config(**json.loads(json.dumps(kwargs)))
    ours_from_raw = ModelConfig.from_hf_dict(json.loads(json.dumps(kwargs)))
    ours_from_hf = ModelConfig.from_hf_dict(hf.to_dict())
    assert _ours(ours_from_raw) == _hf_derived(hf)
    assert _ours(ours_from_hf) == _hf_derived(hf)


def test_released_yarn_lands_in_compress_rope_only():
    cfg = ModelConfig.from_hf_dict(CASES["legacy_released"])
    assert cfg.rope_main.rope_type == "default" and cfg.rope_main.theta == 10000.0
    assert cfg.rope_compress.rope_type == "yarn"
    assert cfg.rope_compress.original_max_position_embeddings == 65536
    assert cfg.rope_compress.attention_factor == 1.0
    # the extra compress_ratios entry (the MTP layer) is dropped
    assert len(cfg.layer_types) == 5 and cfg.compress_ratios == (0, 4, 128, 4, 128)


def test_record_is_frozen_and_typed():
    cfg = ModelConfig.from_hf_dict({"num_hidden_layers": 2})
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1  # type: ignore[misc]
    assert isinstance(cfg.layer_types, tuple) and isinstance(cfg.eos_token_ids, tuple)


def test_text_config_is_flattened():
    cfg = ModelConfig.from_hf_dict(
        {
            "model_type": "deepseek_v41",
            "architectures": ["DeepseekV41ForConditionalGeneration"],
            "vision_config": {"depth": 2},
            "text_config": {
                "model_type": "deepseek_v41_text",
                "hidden_size": 256,
                "num_hidden_layers": 2,
                "compress_ratios": [0, 0],
            },
        }
    )
    assert cfg.hidden_size == 256 and cfg.q_head_norm is False
    assert cfg.hc_pre_from_prev_sublayer is True
    assert cfg.architectures == ("DeepseekV41ForCausalLM",)
    assert cfg.v41 is not None and cfg.v41.has_vision_tower


@pytest.mark.parametrize(
    "field,value",
    [
        ("engram_layer_ids", [3]),
        ("kv_source_layer_ids", [1]),
        ("index_source_layer_ids", [1]),
        ("candidate_source_layer_id", 2),
        ("candidate_topk_blocks", 8),
        ("vision_config", {"depth": 2}),
        ("image_token_id", 129264),
        ("hc_pre_from_prev_sublayer", True),
        ("compress_ratios", [0, 1, 4]),
        ("compress_ratios", [2, 4]),
        ("model_type", "llama"),
        ("scoring_func", "softmax"),
        ("num_key_value_heads", 2),
        ("n_shared_experts", 2),
    ],
)
def test_unsupported_fields_are_rejected_by_name(field, value):
    raw = {"num_hidden_layers": 3, field: value}
    with pytest.raises(UnsupportedConfigError) as e:
        ModelConfig.from_hf_dict(raw)
    assert field.split("_")[0] in str(e.value)


def test_v41_single_pass_mhc_is_required():
    raw = {"model_type": "deepseek_v41", "num_hidden_layers": 2, "compress_ratios": [0, 0]}
    assert ModelConfig.from_hf_dict(raw).hc_pre_from_prev_sublayer
    with pytest.raises(UnsupportedConfigError, match="hc_pre_from_prev_sublayer"):
        ModelConfig.from_hf_dict({**raw, "hc_pre_from_prev_sublayer": False})


@pytest.mark.parametrize(
    "raw,needle",
    [
        ({"num_hidden_layers": 3, "layer_types": [SLIDING, CSA]}, "layer_types"),
        ({"num_hidden_layers": 2, "layer_types": [SLIDING, "full_attention"]}, "layer_types"),
        ({"num_hidden_layers": 2, "mlp_layer_types": ["moe", "dense"]}, "mlp_layer_types"),
        ({"num_attention_heads": 6, "o_groups": 4}, "o_groups"),
        ({"num_experts_per_tok": 9, "n_routed_experts": 8}, "num_experts_per_tok"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "original_max_position"),
        ({"compress_rates": {CSA: 0}}, "compress_rates"),
    ],
)
def test_malformed_values_raise_value_error_naming_field(raw, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf_dict(raw)


def test_quantization_config_and_expert_dtype(tmp_path):
    raw = {
        "num_hidden_layers": 2,
        "expert_dtype": "fp4",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "scale_fmt": "ue8m0",
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.quantization is not None
    assert cfg.quantization.expert_dtype == "fp4"
    assert cfg.quantization.weight_block_size == (128, 128)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed JSON"):
        ModelConfig.from_pretrained(str(tmp_path))
