"""The built-in tiny DeepSeek-V4 (`--model-path tiny`): every layer type (sliding, CSA, HCA),
both MoE kinds (hash and learned top-k), YaRN on the compress rope, deterministic seeded weights
and the byte-level tokenizer's vocabulary. Needs no download."""

from __future__ import annotations

import torch

from sgl_dspark.srt.configs.model_config import ModelConfig

TINY_MODEL_NAME = "tiny"
_PRINTABLE = (7 + 32, 7 + 127)  # byte-tokenizer ids of bytes 0x20..0x7e
_S, _C, _H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

TINY_HF_CONFIG: dict = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "q_lora_rank": 64,
    "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "sliding_window": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "layer_types": [_S, _C, _H, _C, _S],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe", "moe"],
    "compress_rates": {_C: 4, _H: 16},
    "swiglu_limit": 10.0,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "float32",
}


def tiny_config() -> ModelConfig:
    return ModelConfig.from_hf_dict(TINY_HF_CONFIG)


def tiny_weights(
    cfg: ModelConfig, names_and_shapes: list[tuple[str, tuple[int, ...]]], seed: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Deterministic random weights by parameter name.

    Matrices ~ N(0, 0.02); constants that HF initialises to 0/1 are randomised (as in the parity
    recipe) so every path matters; the lm_head is wider (std 1.0) so greedy choices have clear
    margins and do not flip on float rounding between batch shapes.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in names_and_shapes:
        if name.endswith("tid2eid"):
            k, e = shape[1], cfg.n_routed_experts
            t = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(shape[0])])
        elif name.endswith("norm.weight") or "layernorm" in name:
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
            t = 0.5 * torch.randn(shape, generator=g)
        elif name.endswith(("scale", "hc_scale")):
            t = 1 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            t = 0.05 * torch.randn(shape, generator=g)
        elif name == "lm_head.weight":
            # Printable ASCII bytes (ids 39..133 in the byte tokenizer) get the widest rows so the
            # demo prints readable (if meaningless) text.
            t = torch.randn(shape, generator=g)
            t[: _PRINTABLE[0]] *= 0.3
            t[_PRINTABLE[1] :] *= 0.3
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        out.append((name, t))
    return out
