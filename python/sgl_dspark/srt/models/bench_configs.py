"""Random-weight DeepSeek-V4 configurations for benchmarks and GPU end-to-end checks.

* `dsv4_flash_slice`: DeepSeek-V4-Flash per-layer dimensions (D 4096, 64 heads x 512, q rank 1024,
  8 output groups of rank 1024, hc 4, window 128, CSA 4 with a 64x128 indexer (top-512), HCA 128,
  I 2048, top-6) with 4 layers and 96 routed experts (one EP4 rank's share of 384), V 129280:
  one H200 holds it in bf16.
* `mid_910m`: the 910M-parameter model of the GPU-runtime issue (HF `generate` baseline).
* `toy`: the same layer pattern at toy sizes, for CPU smoke tests of the benchmark scripts.
"""

from __future__ import annotations

_S, _C, _H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

BENCH_CONFIGS: dict[str, dict] = {
    "dsv4_flash_slice": {
        "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
        "num_hidden_layers": 4, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "q_lora_rank": 1024, "qk_rope_head_dim": 64, "num_experts_per_tok": 6,
        "n_routed_experts": 96, "n_shared_experts": 1, "hc_mult": 4, "sliding_window": 128,
        "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "max_position_embeddings": 65536,
        "layer_types": [_S, _C, _H, _C], "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "compress_rates": {_C: 4, _H: 128}, "torch_dtype": "bfloat16",
    },
    "mid_910m": {
        "vocab_size": 32000, "hidden_size": 1024, "moe_intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 1,
        "head_dim": 128, "q_lora_rank": 256, "num_experts_per_tok": 6, "n_routed_experts": 64,
        "n_shared_experts": 1, "hc_mult": 4, "sliding_window": 128, "o_groups": 4,
        "o_lora_rank": 256, "index_n_heads": 8, "index_head_dim": 64, "index_topk": 64,
        "max_position_embeddings": 8192, "layer_types": [_S, _C, _H, _C] * 2,
        "compress_rates": {_C: 4, _H: 128}, "torch_dtype": "bfloat16",
    },
    "toy": {
        "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 32, "q_lora_rank": 32, "num_experts_per_tok": 2, "n_routed_experts": 8,
        "n_shared_experts": 1, "hc_mult": 4, "sliding_window": 16, "o_groups": 2,
        "o_lora_rank": 16, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4,
        "max_position_embeddings": 1024, "layer_types": [_S, _C, _H, _C],
        "compress_rates": {_C: 4, _H: 8}, "torch_dtype": "bfloat16",
    },
}
