"""The demo DeepSeek-V4.1 target: about 19M parameters, power-of-two widths, every V4.1 layer
role, trained here on the demo corpus (`tools/build_demo_corpus.py`).

Layers: 0 window-only (+ Engram), 1 ratio-2 kv source, 2 ratio-2 Reuse, 3 ratio-1 kv source and
candidate source (+ Engram), 4 Reindex (restricted by 3's candidate blocks), 5 and 6 Reuse of
4's top-k, 7 window-only; the three trailing ratios are the DSpark draft stages.

The indexer's top-k is not differentiable, so training gives the indexer no signal. The config
makes the selection cover every visible group of a context of up to `SELECTION_COVERS` tokens
(`index_topk` and the candidate blocks reach all ratio-1 groups); the roles, caches and
quantisers all run, and the trained model does not depend on an untrained ranking there.
Beyond that length the selection drops groups by the untrained indexer's scores.
"""

from __future__ import annotations

import copy
from typing import Any

from sgl_dspark.srt.configs.engram_layout import engram_primes
from sgl_dspark.tools.demo_corpus.tokenizer import SPECIAL_TOKENS

SELECTION_COVERS = 512
BOS_ID, EOS_ID, PAD_ID, MASK_ID = range(len(SPECIAL_TOKENS))

_ENGRAM_LAYERS = (0, 3)
_ENGRAM_NGRAM = 3
_ENGRAM_HEADS = 2
_ENGRAM_VOCAB = 4096

_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "hidden_size": 256,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": SELECTION_COVERS,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "sliding_window": 64,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 4],
    "candidate_source_layer_id": 3,
    "candidate_topk_blocks": SELECTION_COVERS // 64,
    "candidate_block_size": 64,
    "engram_layer_ids": list(_ENGRAM_LAYERS),
    "engram_max_ngram_size": _ENGRAM_NGRAM,
    "engram_n_heads": _ENGRAM_HEADS,
    "engram_head_dim": 32,
    "engram_vocab_size": _ENGRAM_VOCAB,
    "engram_pad_id": PAD_ID,
    "gate_temp": 1.0,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 1024,
    "num_nextn_predict_layers": 3,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "torch_dtype": "bfloat16",
}


def demo_target_hf_config(vocab_size: int, compressed_vocab_size: int) -> dict[str, Any]:
    """The composite `config.json` of the demo target for a tokenizer of `vocab_size` ids whose
    compressed token map has `compressed_vocab_size` entries."""
    text = copy.deepcopy(_TEXT_CONFIG)
    text["vocab_size"] = vocab_size
    primes = engram_primes(_ENGRAM_LAYERS, _ENGRAM_NGRAM, _ENGRAM_HEADS, _ENGRAM_VOCAB)
    text["engram_num_embeddings"] = [sum(sum(heads) for heads in layer) for layer in primes]
    text["engram_compressed_vocab_size"] = compressed_vocab_size
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": text,
        "torch_dtype": "bfloat16",
    }


__all__ = ["BOS_ID", "EOS_ID", "MASK_ID", "PAD_ID", "SELECTION_COVERS", "demo_target_hf_config"]
