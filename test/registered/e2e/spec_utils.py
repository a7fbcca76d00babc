"""Helpers for end-to-end tests: small random targets on disk, drafts from the init tool,
policy configurations, random greedy request sets."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sgl_dspark.srt.models.deepseek_v41 import DeepseekV41ForCausalLM
from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG, tiny_weights
from sgl_dspark.srt.models.tiny_v41 import tiny_v41_hf_config, tiny_v41_weights
from sgl_dspark.srt.tokenizer import MARKER_FILE
from sgl_dspark.tools.init_dspark_draft import init_dspark_draft

_S, _C, _H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def greedy_requests(
    count: int,
    seed: int,
    max_prompt_len: int,
    first_new_tokens: int,
    new_tokens_step: int,
    vocab: int = 263,
) -> tuple[list[list[int]], list[dict]]:
    """`count` random prompts of 1 .. max_prompt_len - 1 tokens (ids from 7, below `vocab`),
    greedy, request i generating first_new_tokens + i * new_tokens_step tokens (different
    lengths, so a running batch shrinks through several sizes)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(
            7, vocab, (int(torch.randint(1, max_prompt_len, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(count)
    ]
    params = [
        {
            "temperature": 0.0,
            "ignore_eos": True,
            "max_new_tokens": first_new_tokens + new_tokens_step * i,
        }
        for i in range(count)
    ]
    return prompts, params


def write_random_target(out_dir: str, vocab_size: int = 512, seed: int = 0, **overrides) -> str:
    """A small DeepSeek-V4 target with HF names (as save_pretrained would write them)."""
    raw = {
        **TINY_HF_CONFIG,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "head_dim": 32,
        "q_lora_rank": 32,
        "o_lora_rank": 16,
        "moe_intermediate_size": 32,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "num_hidden_layers": 4,
        "layer_types": [_S, _C, _H, _C],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        **overrides,
    }
    cfg = ModelConfig.from_hf_dict(raw)
    shapes = [(k, tuple(v.shape)) for k, v in DeepseekV4ForCausalLM(cfg).state_dict().items()]
    weights = {k: v.contiguous() for k, v in tiny_weights(cfg, shapes, seed=seed)}
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f)
    return out_dir


def write_random_v41_target(out_dir: str, seed: int = 0, **text_overrides) -> str:
    """A DeepSeek-V4.1 target on disk shaped like the built-in tiny-v41 (every layer role), its
    text config's fields replaced by `text_overrides`: a composite config.json, weights under the
    model's module names, and the byte tokenizer's marker (the Engram token map is derived from
    it; a vocabulary other than the byte tokenizer's needs `engram_layer_ids=[]`)."""
    raw = tiny_v41_hf_config()
    raw["text_config"].update(text_overrides)
    cfg = ModelConfig.from_hf_dict(raw)
    model = DeepseekV41ForCausalLM(cfg)
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    weights = {
        k: v.contiguous()
        for k, v in tiny_v41_weights(cfg, shapes, seed=seed)
        if k != "model.engram_token_map"  # derived from the tokenizer at load
    }
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f)
    with open(os.path.join(out_dir, MARKER_FILE), "w") as f:
        json.dump({"type": "byte"}, f)
    return out_dir


def write_random_draft(target_dir: str, out_dir: str, block_size: int, seed: int = 1) -> str:
    init_dspark_draft(
        target_dir,
        out_dir,
        num_layers=2,
        block_size=block_size,
        markov_rank=16,
        seed=seed,
        noise_token_id=3,
    )
    return out_dir


def write_policy_tables(tmp_dir: str, gamma: int) -> dict[str, str]:
    """A width table keyed by batch size and a synthetic diagonal SPS table (10 ms + 0.4 ms per
    verify token), so every policy has something to decide."""
    widths = {"widths_by_batch_size": {"1": "full", "3": min(3, gamma + 1), "8": 2}}
    tokens = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    sps = {
        "sample_batch_tokens": tokens,
        "sample_steps_per_sec": [1000.0 / (10.0 + 0.4 * t) for t in tokens],
        "max_batch_tokens": 256,
    }
    paths = {
        "width": os.path.join(tmp_dir, "widths.json"),
        "sps": os.path.join(tmp_dir, "sps.json"),
    }
    with open(paths["width"], "w") as f:
        json.dump(widths, f)
    with open(paths["sps"], "w") as f:
        json.dump(sps, f)
    return paths


def policy_kwargs(name: str, tables: dict[str, str]) -> dict:
    return {
        "full": {"speculative_dspark_verify_policy": "full"},
        "static_table": {
            "speculative_dspark_verify_policy": "static",
            "speculative_dspark_width_table_path": tables["width"],
        },
        "static_online": {
            "speculative_dspark_verify_policy": "static",
            "speculative_dspark_online_width": True,
            "speculative_dspark_sps_table_path": tables["sps"],
        },
        "confidence_sync": {
            "speculative_dspark_verify_policy": "confidence",
            "speculative_dspark_confidence_mode": "sync",
            "speculative_dspark_sps_table_path": tables["sps"],
        },
        "confidence_async": {
            "speculative_dspark_verify_policy": "confidence",
            "speculative_dspark_confidence_mode": "async",
            "speculative_dspark_sps_table_path": tables["sps"],
        },
    }[name]


POLICIES = ("full", "static_table", "static_online", "confidence_sync", "confidence_async")
