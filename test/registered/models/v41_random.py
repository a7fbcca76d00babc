"""Small random DeepSeek-V4.1 checkpoints built like the fixtures (composite config.json, released
tensor names, fp32 weights drawn by the fixtures' init rules), for engine-vs-reference tests of
the state machinery (chunks, decode, verify, rollback) across every layer role.

Their head dims (40, index 24) are not multiples of the quantisers' blocks, so the QAT
quantisers leave them unquantised: the model is then continuous, and two correct fp32
implementations agree to rounding noise on every sequence. With quantisers active, rounding
noise (~1e-7 relative) moves a value across a rounding boundary now and then, shifting later
logits by ~1e-2 in a correct implementation; the quantised paths are compared on the fixtures'
sequences instead, whose margins to every boundary were checked when they were made.
"""

from __future__ import annotations

import copy
import json
import pathlib
import shutil

import torch
from safetensors.torch import save_file
from v41_reference import _primes

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "deepseek_v41"
# The byte-level BPE tokenizer of the Engram fixture: 320 ids, 281 compressed ids.
ENGRAM_TOKENIZER = FIXTURES / "c2_hc4_sigmoid_engram" / "tokenizer.json"

_BASE = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 320,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "head_dim": 40,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 16,
    "index_head_dim": 24,
    "n_routed_experts": 6,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 24,
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "hc_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 256,
    "num_nextn_predict_layers": 0,
    "eos_token_id": None,
    "bos_token_id": 0,
}
_ENGRAM = {
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 37,
    "engram_pad_id": 2,
    "engram_compressed_vocab_size": 281,
}

# Every layer role: window-only, ratio-2 and ratio-1 Full, Reuse of a Full and of a Reindex
# layer, Reindex with and without candidate blocks, candidate sources of both ratios, Engram on
# a window-only layer, a ratio-2 Full layer and a ratio-1 Full layer.
RANDOM_CONFIGS: dict[str, dict] = {
    # ratio-2 candidate source: its newest-block pin starts at position 1 (no group before)
    "r2_candidates_hc3_engram": {
        **_ENGRAM,
        "num_hidden_layers": 5,
        "compress_ratios": [0, 2, 2, 2, 2],
        "kv_source_layer_ids": [1],
        "index_source_layer_ids": [1, 3],
        "candidate_source_layer_id": 1,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 3,
        "index_topk": 4,
        "engram_layer_ids": [0, 1],
        "hc_mult": 3,
        "hc_sinkhorn_iters": 7,
        "sliding_window": 5,
        "scoring_func": "sigmoid",
        "gate_temp": 0.6,
    },
    # like the released schedule: ratio 2 then ratio 1 with candidates, one route per token
    "r2_r1_yarn_hc2_single_route": {
        **_ENGRAM,
        "num_hidden_layers": 7,
        "compress_ratios": [0, 2, 2, 1, 1, 1, 1],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 2, 3, 5],
        "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 4,
        "index_topk": 3,
        "engram_layer_ids": [3],
        "hc_mult": 2,
        "hc_sinkhorn_iters": 4,
        "sliding_window": 4,
        "scoring_func": "sqrtsoftplus",
        "gate_temp": 1.3,
        "num_experts_per_tok": 1,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
}


def _param_shapes(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Released name -> (shape, init rule) of every tensor of a config."""
    d, n, v = c["hidden_size"], c["hc_mult"], c["vocab_size"]
    heads, hd, rq = c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    groups, rank = c["o_groups"], c["o_lora_rank"]
    hi, di = c["index_n_heads"], c["index_head_dim"]
    e, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((v, d), "embed"),
        "norm.weight": ((d,), "norm"),
        "head.weight": ((v, d), "head"),
    }
    engram_layers = c.get("engram_layer_ids") or []
    primes = (
        _primes(
            engram_layers, c["engram_max_ngram_size"], c["engram_n_heads"], c["engram_vocab_size"]
        )
        if engram_layers
        else []
    )
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        m = c["compress_ratios"][i]
        for site in ("attn", "ffn"):
            out[f"{p}hc_{site}_fn"] = (((2 + n) * n, n * d), "hc_fn")
            out[f"{p}hc_{site}_base"] = (((2 + n) * n,), "hc_base")
            out[f"{p}hc_{site}_scale"] = ((3,), "hc_scale")
        out[p + "attn_norm.weight"] = ((d,), "norm")
        out[p + "ffn_norm.weight"] = ((d,), "norm")
        a = p + "attn."
        out[a + "wq_a.weight"] = ((rq, d), "linear")
        out[a + "q_norm.weight"] = ((rq,), "norm")
        out[a + "wq_b.weight"] = ((heads * hd, rq), "linear")
        out[a + "wkv.weight"] = ((hd, d), "linear")
        out[a + "kv_norm.weight"] = ((hd,), "norm")
        out[a + "wo_a.weight"] = ((groups * rank, heads * hd // groups), "linear")
        out[a + "wo_b.weight"] = ((d, groups * rank), "linear")
        out[a + "attn_sink"] = ((heads,), "sink")
        if i in c["kv_source_layer_ids"]:
            out[a + "compressor.wkv.weight"] = ((hd, d), "linear")
            if m > 1:
                out[a + "compressor.wgate.weight"] = ((hd, d), "linear")
            out[a + "compressor.norm.weight"] = ((hd,), "norm")
            out[a + "indexer.wk.weight"] = ((di, hd), "linear")
            out[a + "indexer.k_norm.weight"] = ((di,), "norm")
        if i in c["index_source_layer_ids"]:
            out[a + "indexer.wq_b.weight"] = ((hi * di, rq), "linear")
            out[a + "indexer.weights_proj.weight"] = ((hi, d), "linear")
        f = p + "ffn."
        out[f + "gate.weight"] = ((e, d), "router")
        out[f + "gate.bias"] = ((e,), "router_bias")
        out[f + "gate.bias_vl"] = ((e,), "router_bias")
        for name in [f"experts.{x}." for x in range(e)] + ["shared_experts."]:
            out[f + name + "w1.weight"] = ((inter, d), "linear")
            out[f + name + "w3.weight"] = ((inter, d), "linear")
            out[f + name + "w2.weight"] = ((d, inter), "linear")
        if i in engram_layers:
            rows = sum(sum(h) for h in primes[engram_layers.index(i)])
            dg = c["engram_head_dim"]
            ids = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"]
            g = p + "engram."
            out[g + "embed.weight"] = ((rows, dg), "embed")
            out[g + "embed.scale"] = ((rows, max(1, dg // 32)), "ones")
            out[g + "wkv.weight"] = (((n + 1) * d, ids * dg), "linear")
            out[g + "q_weight"] = ((n, d), "engram_qk")
            out[g + "k_weight"] = ((n, d), "engram_qk")
    return out


def _draw(shape: tuple[int, ...], rule: str, c: dict, g: torch.Generator) -> torch.Tensor:
    d, n = c["hidden_size"], c["hc_mult"]
    randn = torch.randn(shape, generator=g)
    if rule == "linear":
        return randn / shape[-1] ** 0.5
    scales = {"embed": 1.0, "sink": 1.0, "hc_base": 0.5, "router_bias": 0.1}
    if rule in scales:
        return scales[rule] * randn
    if rule == "norm":
        return 1 + 0.25 * randn
    if rule == "engram_qk":
        return 1 + 0.5 * randn
    if rule == "hc_fn":
        return randn * (0.25 / (n * d)) ** 0.5
    if rule == "hc_scale":
        return 0.5 + torch.rand(shape, generator=g)
    if rule == "router":
        return randn * (4.0 / d) ** 0.5
    if rule == "head":
        return randn * (16.0 / d) ** 0.5
    assert rule == "ones", rule
    return torch.ones(shape)


def text_config(name: str) -> dict:
    c = {**_BASE, **copy.deepcopy(RANDOM_CONFIGS[name])}
    if c.get("engram_layer_ids"):
        layers = c["engram_layer_ids"]
        primes = _primes(
            layers, c["engram_max_ngram_size"], c["engram_n_heads"], c["engram_vocab_size"]
        )
        c["engram_num_embeddings"] = [sum(sum(h) for h in p) for p in primes]
    return c


def write_random_v41(name: str, out_dir: pathlib.Path, seed: int) -> pathlib.Path:
    """Write config.json, model.safetensors (and the Engram tokenizer) of a random model."""
    c = text_config(name)
    g = torch.Generator().manual_seed(seed)
    tensors = {k: _draw(shape, rule, c, g) for k, (shape, rule) in _param_shapes(c).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": c,
        "vision_config": None,
        "image_token_id": 129264,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    if c.get("engram_layer_ids"):
        shutil.copy(ENGRAM_TOKENIZER, out_dir / "tokenizer.json")
    return out_dir
