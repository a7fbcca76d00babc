"""The built-in tiny DeepSeek-V4.1 (`--model-path tiny-v41`) and its DSpark draft
(`tiny-v41-dspark`): every layer role (window-only, ratio-2 and ratio-1 kv sources, Reuse of
both, a Reindex layer restricted by the candidate blocks of the ratio-1 source), Engram on a
window-only and a kv-source layer, the QAT quantisers active (head and index dims are multiples
of their blocks), a router temperature, YaRN on the compress rope. Deterministic seeded weights;
the byte tokenizer's vocabulary, whose compressed token map (Engram) is derived from the
tokenizer itself (`tokenizer/engram_map.py`). Needs no download.
"""

from __future__ import annotations

import copy
import functools

import torch

from sgl_dspark.srt.configs.engram_layout import engram_primes
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.models.tiny import tiny_weights
from sgl_dspark.srt.tokenizer.byte_tokenizer import BYTE_VOCAB_SIZE, MASK_ID, PAD_ID
from sgl_dspark.srt.tokenizer.engram_map import (
    byte_tokenizer_compressed_size,
    byte_tokenizer_token_map,
)

TINY_V41_MODEL_NAME = "tiny-v41"
TINY_V41_DSPARK_NAME = "tiny-v41-dspark"

_ENGRAM_LAYERS = [0, 3]
_ENGRAM_NGRAM = 3
_ENGRAM_HEADS = 2
_ENGRAM_VOCAB = 1000

# Layer roles: 0 window-only (+Engram), 1 ratio-2 kv source, 2 ratio-2 Reuse, 3 ratio-1 kv source
# and candidate source (+Engram), 4 Reindex (restricted by 3's candidate blocks), 5 Reuse of 4's
# top-k; the three trailing ratios are the draft layers (window-only).
_TEXT_CONFIG: dict = {
    "model_type": "deepseek_v41_text",
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "sliding_window": 32,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 4],
    "candidate_source_layer_id": 3,
    "candidate_topk_blocks": 2,
    "candidate_block_size": 4,
    "engram_layer_ids": _ENGRAM_LAYERS,
    "engram_max_ngram_size": _ENGRAM_NGRAM,
    "engram_n_heads": _ENGRAM_HEADS,
    "engram_head_dim": 32,
    "engram_vocab_size": _ENGRAM_VOCAB,
    "engram_pad_id": PAD_ID,
    "gate_temp": 1.25,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 8192,
    "num_nextn_predict_layers": 3,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": PAD_ID,
    "torch_dtype": "float32",
}

# The draft reads the V4.1 default taps (the last three layers that are not kv sources) and has
# its own expert count and top-k.
TINY_V41_DSPARK_CONFIG: dict = {
    "dspark_block_size": 5,
    "dspark_markov_rank": 32,
    "dspark_noise_token_id": MASK_ID,
    "dspark_target_layer_ids": [2, 4, 5],
    "dspark_n_routed_experts": 6,
    "dspark_num_experts_per_tok": 3,
    "sliding_window": 32,
    "enable_confidence_head": True,
}


@functools.cache
def _compressed_vocab_size() -> int:
    return byte_tokenizer_compressed_size()


def tiny_v41_hf_config() -> dict:
    """The composite `config.json` of tiny-v41 (the text model under `text_config`), with the
    Engram table sizes and the compressed vocabulary size derived as a release states them."""
    text = copy.deepcopy(_TEXT_CONFIG)
    primes = engram_primes(tuple(_ENGRAM_LAYERS), _ENGRAM_NGRAM, _ENGRAM_HEADS, _ENGRAM_VOCAB)
    text["engram_num_embeddings"] = [sum(sum(heads) for heads in layer) for layer in primes]
    text["engram_compressed_vocab_size"] = _compressed_vocab_size()
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": text,
        "torch_dtype": "float32",
    }


def tiny_v41_config() -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_v41_hf_config())


def tiny_v41_weights(
    cfg: ModelConfig, names_and_shapes: list[tuple[str, tuple[int, ...]]], seed: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """`tiny_weights` (wide lm_head rows, randomised norms and mHC constants), with the Engram
    gate's q/k weights around 1 (so the gates spread over (0, 1)) and the Engram token map the
    byte tokenizer's own."""
    g = torch.Generator().manual_seed(seed + 7)
    out = []
    for name, t in tiny_weights(cfg, names_and_shapes, seed=seed):
        if name.endswith(("engram.q_weight", "engram.k_weight")):
            t = 1 + 0.5 * torch.randn(t.shape, generator=g)
        elif name == "model.engram_token_map":
            engram = cfg.v41.engram if cfg.v41 is not None else None
            assert engram is not None
            t = byte_tokenizer_token_map(cfg.vocab_size, engram.compressed_vocab_size, PAD_ID)
        out.append((name, t))
    return out


__all__ = [
    "TINY_V41_DSPARK_CONFIG",
    "TINY_V41_DSPARK_NAME",
    "TINY_V41_MODEL_NAME",
    "tiny_v41_config",
    "tiny_v41_hf_config",
    "tiny_v41_weights",
]
