"""Random-weight DeepSeek-V4 configurations for benchmarks and GPU end-to-end checks.

* `dsv4_flash_slice`: DeepSeek-V4-Flash per-layer dimensions (D 4096, 64 heads x 512, q rank 1024,
  8 output groups of rank 1024, hc 4, window 128, CSA 4 with a 64x128 indexer (top-512), HCA 128,
  I 2048, top-6) with 4 layers and 96 routed experts (one EP4 rank's share of 384), V 129280:
  one GPU holds it in bf16.
* `dsv41_flash_rank`: DeepSeek-V4.1-Flash at full depth (40 backbone layers + 3 DSpark draft
  stages = 43) with one EP4 rank's share of routed experts (96 of 384; top-6 among them, so a
  step touches at least as many local experts as the rank would), experts MXFP4 and dense
  projections FP8 32 x 32 as released. Engram keeps its released layers, heads and widths with
  hash tables of a 100k base vocabulary (the released 16M-row-per-hash tables are ~200 GB a layer
  in bf16 and are read ~24 rows a token, so their size moves no step time). Random weights only
  (`--load-format dummy`): ~280 GB in bf16, ~80 GB as stored, so one H200 holds it only natively.
* `dsv41_flash_rank_ep8`: the same model with one EP8 rank's share (48 of 384 routed experts,
  16 of the draft's 128): ~48 GB as stored, so it also fits one 80 GB H100. At bs 1 a step reads
  the same bytes as `dsv41_flash_rank` (six local experts a token either way; the router reads
  48 gate rows instead of 96), so its bs 1 step measures the same kernels on a smaller GPU; at
  larger batches its experts saturate sooner.
* `dsv4_flash_rank`: the same shape of workload with DeepSeek-V4-Flash's dimensions (40 layers + 3
  draft stages, 96 routed experts as the V4.1 rank holds, FP8 128 x 128 + MXFP4): the V4
  counterpart of the headline model, and where the window KV dtype is a choice (V4.1's is FP8).
  ~200 GB in bf16, ~60 GB as stored.
* `mid_910m`: the 910M-parameter engine benchmark model (HF `generate` baseline).
* `toy`: the same layer pattern at toy sizes, for CPU smoke tests of the benchmark scripts.
* `v41_flash_slice` (DeepSeek-V4.1, a composite `config.json`): V4.1-Flash per-layer dimensions
  (D 5120, 64 heads x 512, q rank 1280, 8 output groups of rank 1024, hc 4, window 128, a 32x128
  indexer (top-512), candidate blocks 2048 x 8, I 2304, top-6 of 96 routed experts (one EP4
  rank's share of 384), Engram of 4-grams with 8 heads of 256, V 129280) with six layers, one of
  each role: window-only (+Engram), ratio-2 kv source, ratio-2 Reuse, ratio-1 kv source and
  candidate source (+Engram), Reindex, ratio-1 Reuse. The Engram tables are searched from 100k
  instead of 16M (the released tables hold 384M rows; a step gathers 24 rows per token and
  layer either way).
* `v41_toy`: the same roles at toy sizes, for CPU smoke tests.
"""

from __future__ import annotations

from sgl_dspark.srt.configs.engram_layout import engram_primes

_S, _C, _H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# DSpark draft of the rank models: 3 stages reading the last 3 backbone layers, V4.1's block and
# Markov rank, and one EP4 rank's share of its routed experts (32 of 128, top-3).
_RANK_DSPARK = {
    "dspark_block_size": 5,
    "dspark_markov_rank": 256,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_n_routed_experts": 32,
    "dspark_num_experts_per_tok": 3,
    "enable_confidence_head": True,
}
# One EP8 rank's share of the draft's routed experts (16 of 128).
_RANK_EP8_DSPARK = {**_RANK_DSPARK, "dspark_n_routed_experts": 16}
_ENGRAM_LAYERS = [1, 14]
_ENGRAM_VOCAB = 100_000


def _engram_rows() -> list[int]:
    """Rows of each Engram layer's table: the sum of its hash primes (8 heads x n-grams 2..4)."""
    primes = engram_primes(tuple(_ENGRAM_LAYERS), 4, 8, _ENGRAM_VOCAB)
    return [sum(sum(heads) for heads in layer) for layer in primes]


# Configs whose DSpark draft is described by these keys in a `dspark/config.json` (with the
# target's; the benchmarks write it beside the target's config.json). `toy`: for CPU smoke tests.
BENCH_DRAFT_KEYS: dict[str, dict] = {
    "dsv41_flash_rank": _RANK_DSPARK,
    "dsv41_flash_rank_ep8": _RANK_EP8_DSPARK,
    "dsv4_flash_rank": _RANK_DSPARK,
    "toy": {
        "dspark_block_size": 3,
        "dspark_markov_rank": 16,
        "dspark_noise_token_id": 511,
        "dspark_target_layer_ids": [1, 2, 3],
        "dspark_n_routed_experts": 8,
        "dspark_num_experts_per_tok": 2,
        "enable_confidence_head": True,
    },
}


def released_quantization(block: int) -> dict:
    """The `quantization_config` of the released checkpoints: FP8 E4M3 projections in
    `block` x `block` tiles with E8M0 scales (128 for V4, 32 for V4.1), MXFP4 routed experts."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [block, block],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    }


# DeepSeek-V4-Flash's per-layer dimensions with one EP4 rank's share of its routed experts (96 of
# 384): the V4 rank and slice models differ only in depth, layer pattern and weight formats.
_V4_FLASH_DIMS: dict = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "num_experts_per_tok": 6,
    "n_routed_experts": 96,
    "n_shared_experts": 1,
    "hc_mult": 4,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "max_position_embeddings": 65536,
    "compress_rates": {_C: 4, _H: 128},
    "torch_dtype": "bfloat16",
}


# Layer roles of the V4.1 configs (see the module doc); the trailing zeros are the draft layers.
_V41_ROLES: dict = {
    "num_hidden_layers": 6,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 4],
    "candidate_source_layer_id": 3,
    "engram_layer_ids": [0, 3],
    "num_nextn_predict_layers": 3,
}


def _v41(text: dict) -> dict:
    """A composite V4.1 config.json: the text config with the V4.1 roles and the Engram table
    sizes derived from the prime search."""
    text = {"model_type": "deepseek_v41_text", **_V41_ROLES, **text}
    primes = engram_primes(
        tuple(text["engram_layer_ids"]),
        text["engram_max_ngram_size"],
        text["engram_n_heads"],
        text["engram_vocab_size"],
    )
    text["engram_num_embeddings"] = [sum(sum(heads) for heads in layer) for layer in primes]
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": text,
        "torch_dtype": text["torch_dtype"],
    }


# The released V4.1-Flash fields the V4.1 config does not default (config/deepseek_v41.py defaults
# the rest: D 5120, 64 heads x 512, q rank 1280, 8 x 1024 output groups, I 2304, indexer 32 x 128
# top-512, window 128), with one EP4 rank's share of the routed experts.
_V41_FLASH_RANK: dict = {
    "model_type": "deepseek_v41",
    "architectures": ["DeepseekV41ForCausalLM"],
    "vocab_size": 129280,
    "n_routed_experts": 96,
    "num_experts_per_tok": 6,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "num_nextn_predict_layers": 3,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "engram_layer_ids": _ENGRAM_LAYERS,
    "engram_num_embeddings": _engram_rows(),
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": _ENGRAM_VOCAB,
    "engram_compressed_vocab_size": 99092,
    "max_position_embeddings": 65536,
    "quantization_config": released_quantization(32),
    "torch_dtype": "bfloat16",
}


BENCH_CONFIGS: dict[str, dict] = {
    "dsv41_flash_rank": _V41_FLASH_RANK,
    "dsv41_flash_rank_ep8": {**_V41_FLASH_RANK, "n_routed_experts": 48},
    "dsv4_flash_rank": {
        **_V4_FLASH_DIMS,
        "num_hidden_layers": 40,
        "quantization_config": released_quantization(128),
    },
    "dsv4_flash_slice": {
        **_V4_FLASH_DIMS,
        "num_hidden_layers": 4,
        "layer_types": [_S, _C, _H, _C],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    },
    "mid_910m": {
        "vocab_size": 32000,
        "hidden_size": 1024,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "q_lora_rank": 256,
        "num_experts_per_tok": 6,
        "n_routed_experts": 64,
        "n_shared_experts": 1,
        "hc_mult": 4,
        "sliding_window": 128,
        "o_groups": 4,
        "o_lora_rank": 256,
        "index_n_heads": 8,
        "index_head_dim": 64,
        "index_topk": 64,
        "max_position_embeddings": 8192,
        "layer_types": [_S, _C, _H, _C] * 2,
        "compress_rates": {_C: 4, _H: 128},
        "torch_dtype": "bfloat16",
    },
    "toy": {
        "vocab_size": 512,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "q_lora_rank": 32,
        "num_experts_per_tok": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "hc_mult": 4,
        "sliding_window": 16,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 4,
        "index_head_dim": 16,
        "index_topk": 4,
        "max_position_embeddings": 1024,
        "layer_types": [_S, _C, _H, _C],
        "compress_rates": {_C: 4, _H: 8},
        "torch_dtype": "bfloat16",
    },
    "v41_flash_slice": _v41(
        {
            "vocab_size": 129280,
            "hidden_size": 5120,
            "moe_intermediate_size": 2304,
            "num_attention_heads": 64,
            "num_key_value_heads": 1,
            "head_dim": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 1280,
            "o_groups": 8,
            "o_lora_rank": 1024,
            "index_n_heads": 32,
            "index_head_dim": 128,
            "index_topk": 512,
            "candidate_topk_blocks": 2048,
            "candidate_block_size": 8,
            "n_routed_experts": 96,
            "num_experts_per_tok": 6,
            "n_shared_experts": 1,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "sliding_window": 128,
            "engram_max_ngram_size": 4,
            "engram_n_heads": 8,
            "engram_head_dim": 256,
            "engram_vocab_size": 100000,
            "engram_pad_id": 2,
            "engram_compressed_vocab_size": 99092,
            "gate_temp": 1.0,
            "scoring_func": "sqrtsoftplus",
            "routed_scaling_factor": 1.5,
            "norm_topk_prob": True,
            "swiglu_limit": 10.0,
            "rms_norm_eps": 1e-20,
            "rope_theta": 10000.0,
            "compress_rope_theta": 160000.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 16.0,
                "original_max_position_embeddings": 65536,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            "max_position_embeddings": 65536,
            "eos_token_id": 1,
            "torch_dtype": "bfloat16",
        }
    ),
    "v41_toy": _v41(
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "moe_intermediate_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "qk_rope_head_dim": 16,
            "q_lora_rank": 32,
            "o_groups": 2,
            "o_lora_rank": 16,
            "index_n_heads": 4,
            "index_head_dim": 32,
            "index_topk": 4,
            "candidate_topk_blocks": 2,
            "candidate_block_size": 4,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "sliding_window": 16,
            "engram_max_ngram_size": 3,
            "engram_n_heads": 2,
            "engram_head_dim": 16,
            "engram_vocab_size": 1000,
            "engram_pad_id": 2,
            "engram_compressed_vocab_size": 400,
            "gate_temp": 1.25,
            "scoring_func": "sqrtsoftplus",
            "routed_scaling_factor": 1.5,
            "norm_topk_prob": True,
            "swiglu_limit": 10.0,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "compress_rope_theta": 160000.0,
            "max_position_embeddings": 1024,
            "eos_token_id": 1,
            "torch_dtype": "bfloat16",
        }
    ),
}
