"""DeepSeek-V4.1 configs: the composite config.json, aliases, the derived per-layer roles, Engram
constants and validation errors that name the field. Expected roles and sizes come from the test
vectors' READMEs and the released Flash schedule, not from the code under test."""

from __future__ import annotations

import pathlib

import pytest
from sgl_dspark.srt.configs.deepseek_v41 import LayerRole
from sgl_dspark.srt.configs.model_config import CSA2, SLIDING, ModelConfig, UnsupportedConfigError

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "models" / "fixtures" / "deepseek_v41"
W, F, RI, RU = LayerRole.WINDOW, LayerRole.FULL, LayerRole.REINDEX, LayerRole.REUSE


def _v41(**fields) -> dict:
    base = {
        "model_type": "deepseek_v41",
        "num_hidden_layers": 5,
        "hidden_size": 64,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "num_attention_heads": 4,
        "o_groups": 2,
        "index_head_dim": 32,
        "compress_ratios": [0, 2, 2, 1, 1],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3],
        "candidate_source_layer_id": -1,
    }
    return {**base, **fields}


@pytest.mark.parametrize(
    "case,roles,sources,topk_sources,candidates",
    [
        (
            "c1_hc2_sqrtsoftplus",
            [W, F, RU, F, RU, RI, RU],
            [None, 1, 1, 3, 3, 3, 3],
            [None, 1, 1, 3, 3, 5, 5],
            [None, None, None, None, None, 3, None],
        ),
        (
            "c2_hc4_sigmoid_engram",
            [W, W, F, F, RI, RU],
            [None, None, 2, 3, 3, 3],
            [None, None, 2, 3, 4, 4],
            [None, None, None, None, 3, None],
        ),
    ],
)
def test_fixture_configs_and_their_roles(case, roles, sources, topk_sources, candidates):
    cfg = ModelConfig.from_pretrained(str(FIXTURES / case))
    v = cfg.v41
    assert v is not None and cfg.model_type == "deepseek_v41_text"
    n = cfg.num_hidden_layers
    assert [v.role(i) for i in range(n)] == roles
    assert [v.source_of(i) for i in range(n)] == sources
    assert [v.topk_source_of(i) for i in range(n)] == topk_sources
    assert [v.candidates_of(i) for i in range(n)] == candidates
    assert cfg.layer_types == tuple(SLIDING if r == 0 else CSA2 for r in v.compress_ratios)
    assert cfg.rms_norm_eps == 1e-20 and not cfg.q_head_norm and cfg.hc_pre_from_prev_sublayer
    assert cfg.eos_token_ids == () and cfg.mlp_layer_types == ("moe",) * n
    assert v.image_token_id == 129264 and not v.has_vision_tower


def test_engram_fields_of_the_engram_fixture():
    cfg = ModelConfig.from_pretrained(str(FIXTURES / "c2_hc4_sigmoid_engram"))
    e = cfg.v41.engram
    assert e is not None and e.layer_ids == (1, 2) and e.pad_id == 2
    # From the fixture's README ("Engram specifics").
    assert e.primes == (((53, 59), (61, 67), (71, 73)), ((79, 83), (89, 97), (101, 103)))
    assert e.offsets(0) == (0, 53, 112, 173, 240, 311)
    assert e.offsets(1) == (0, 79, 162, 251, 348, 449)
    assert e.multipliers[0] == (
        27023585983681967,
        1706736661347413,
        12680839321953607,
        26090936809348843,
    )
    assert cfg.v41.gate_temp == 1.7


def test_released_flash_schedule_is_the_default_for_40_layers():
    cfg = ModelConfig.from_hf_dict(
        {
            "model_type": "deepseek_v41",
            "candidate_source_layer_id": 20,
            "candidate_topk_blocks": 2048,
            "candidate_block_size": 8,
            "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384006168, 384016682],
            "engram_max_ngram_size": 4,
            "engram_n_heads": 8,
            "engram_head_dim": 256,
            "engram_vocab_size": 16000000,
            "engram_compressed_vocab_size": 99092,
        }
    )
    v = cfg.v41
    assert cfg.num_hidden_layers == 40 and cfg.hidden_size == 5120 and cfg.index_n_heads == 32
    assert v.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert v.draft_compress_ratios == (0, 0, 0)
    assert v.kv_source_layer_ids == (2, 8, 14, 20)
    assert v.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    roles = {i: v.role(i) for i in range(40)}
    assert [i for i, r in roles.items() if r is F] == [2, 8, 14, 20]
    assert [i for i, r in roles.items() if r is RI] == [24, 28, 32, 36]
    assert [i for i, r in roles.items() if r is W] == [0, 1]
    assert v.source_of(7) == 2 and v.source_of(19) == 14 and v.source_of(39) == 20
    assert v.topk_source_of(27) == 24 and v.candidates_of(24) == 20 and v.candidates_of(8) is None
    assert cfg.rms_norm_eps == 1e-20
    # Flash: every table has exactly the rows its primes need.
    assert sum(sum(h) for h in v.engram.primes[0]) == 384006168
    assert sum(sum(h) for h in v.engram.primes[1]) == 384016682


def test_aliases_and_model_type_variants():
    raw = _v41(
        kv_source_layers=[1, 3],
        index_source_layers=[1, 3],
        window_size=7,
        intermediate_size=48,
        num_local_experts=6,
    )
    del raw["kv_source_layer_ids"], raw["index_source_layer_ids"]
    for model_type in ("deepseek_v41", "deepseek_v41_text", "deepseek_v4.1", "deepseek_v4.1_text"):
        cfg = ModelConfig.from_hf_dict({**raw, "model_type": model_type})
        assert cfg.v41.kv_source_layer_ids == (1, 3) and cfg.sliding_window == 7
        assert cfg.moe_intermediate_size == 48 and cfg.n_routed_experts == 6
    with pytest.raises(ValueError, match="kv_source_layers.*kv_source_layer_ids"):
        ModelConfig.from_hf_dict(_v41(kv_source_layers=[1]))


def test_derived_sources_and_draft_ratios():
    raw = _v41(compress_ratios=[0, 2, 2, 1, 1, 0, 2])  # two draft entries, one missing
    del raw["kv_source_layer_ids"], raw["index_source_layer_ids"]
    cfg = ModelConfig.from_hf_dict({**raw, "num_nextn_predict_layers": 3})
    # HF: the first layer of each run of equal ratios; index sources = kv sources
    assert cfg.v41.kv_source_layer_ids == (1, 3) == cfg.v41.index_source_layer_ids
    assert cfg.v41.draft_compress_ratios == (0, 2, 0)
    explicit = ModelConfig.from_hf_dict({**raw, "rms_norm_eps": 1e-6})
    assert explicit.rms_norm_eps == 1e-6


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"compress_ratios": [0, 4, 4, 1, 1]}, "compress_ratios"),
        ({"compress_ratios": [0, 2, 2]}, "compress_ratios"),
        ({"num_hidden_layers": 6, "compress_ratios": None}, "compress_ratios"),
        ({"kv_source_layer_ids": [0, 3]}, "kv_source_layer_ids"),
        ({"kv_source_layer_ids": [1, 9]}, "kv_source_layer_ids"),
        ({"kv_source_layer_ids": [3]}, "kv_source_layer_ids"),
        ({"index_source_layer_ids": [1]}, "index_source_layer_ids"),
        ({"index_source_layer_ids": [1, 3, 3]}, "index_source_layer_ids"),
        ({"compress_ratios": [0, 2, 2, 1, 2]}, "kv_source_layer_ids"),
        ({"candidate_source_layer_id": 2}, "candidate_source_layer_id"),
        ({"candidate_source_layer_id": None}, "candidate_source_layer_id"),
        ({"candidate_source_layer_id": 1}, "candidate_topk_blocks"),
        (
            {
                "candidate_source_layer_id": 1,
                "candidate_topk_blocks": 2,
                "candidate_block_size": 4,
            },
            "candidate_source_layer_id",
        ),
        ({"gate_temp": 0.0}, "gate_temp"),
        ({"num_hash_layers": 2}, "num_hash_layers"),
        ({"mlp_layer_types": ["hash_moe"] + ["moe"] * 4}, "mlp_layer_types"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"engram_layer_ids": [1], "engram_max_ngram_size": 3}, "engram_num_embeddings"),
        (
            {
                "engram_layer_ids": [1],
                "engram_num_embeddings": [10, 20],
                "engram_max_ngram_size": 2,
                "engram_n_heads": 1,
                "engram_head_dim": 8,
                "engram_vocab_size": 10,
                "engram_compressed_vocab_size": 10,
            },
            "engram_num_embeddings",
        ),
        (
            {
                "engram_layer_ids": [1],
                "engram_num_embeddings": [10],
                "engram_max_ngram_size": 2,
                "engram_n_heads": 1,
                "engram_head_dim": 8,
                "engram_vocab_size": 10,
                "engram_compressed_vocab_size": 10,
            },
            "engram_num_embeddings",  # one head of 2-grams needs the 11 rows of prime 11
        ),
        (
            {
                "engram_layer_ids": [7],
                "engram_num_embeddings": [20],
                "engram_max_ngram_size": 2,
                "engram_n_heads": 1,
                "engram_head_dim": 8,
                "engram_vocab_size": 10,
                "engram_compressed_vocab_size": 10,
            },
            "engram_layer_ids",
        ),
    ],
)
def test_invalid_v41_configs_name_the_field(fields, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf_dict(_v41(**fields))


def test_unsupported_ratios_are_unsupported_config_errors():
    with pytest.raises(UnsupportedConfigError, match="compress_ratios"):
        ModelConfig.from_hf_dict(_v41(compress_ratios=[0, 128, 128, 1, 1]))
