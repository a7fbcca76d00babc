"""Helpers for end-to-end tests: small random targets on disk, drafts from the init tool,
policy configurations, random greedy request sets and their expected outputs, the exact
distribution of a target's first sampled tokens and the chi-square check against it."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare
from sgl_dspark import Engine
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.layers.sampler import SamplingBatchInfo, processed_probs
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sgl_dspark.srt.models.deepseek_v41 import DeepseekV41ForCausalLM
from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG, tiny_weights
from sgl_dspark.srt.models.tiny_v41 import tiny_v41_hf_config, tiny_v41_weights
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
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


def lossless_requests(count: int, seed: int, vocab: int) -> tuple[list[list[int]], list[dict]]:
    """`count` random greedy requests: prompts of 1 .. 23 tokens (ids from 7, below `vocab`),
    1 .. 13 new tokens each (many end inside a draft block)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(
            7, vocab, (int(torch.randint(1, 24, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(count)
    ]
    params = [
        {
            "temperature": 0.0,
            "ignore_eos": True,
            "max_new_tokens": int(torch.randint(1, 14, (1,), generator=g)),
        }
        for _ in range(count)
    ]
    return prompts, params


def cpu_engine(**engine_kwargs) -> Engine:
    return Engine(device="cpu", skip_tokenizer_init=True, context_length=256, **engine_kwargs)


def run_greedy(prompts: list[list[int]], params: list[dict], **engine_kwargs) -> list[list[int]]:
    """Output ids of the requests on a CPU engine; every KV page must come back."""
    engine = cpu_engine(**engine_kwargs)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        pages = engine.runner.allocator
        assert pages.num_free_pages == pages.num_usable_pages  # every page came back
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in outs]


def with_stop_tokens(reference: list[list[int]], params: list[dict]) -> list[dict]:
    """Every third request also stops on a token of its reference output (mid-block stop)."""
    out = []
    for i, (ref, p) in enumerate(zip(reference, params)):
        p = dict(p)
        if i % 3 == 0 and len(ref) > 2:
            p["stop_token_ids"] = [ref[len(ref) // 2]]
        out.append(p)
    return out


def expected_outputs(reference: list[list[int]], params: list[dict]) -> list[list[int]]:
    """The reference outputs cut after their first stop token."""
    exp = []
    for ref, p in zip(reference, params):
        stops = p.get("stop_token_ids", [])
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
        exp.append(ref[:cut])
    return exp


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
# Policies and batch sizes the tool-made drafts run with (each policy once, batch sizes mixed).
TOOL_DRAFT_POLICY_BATCHES = (
    ("full", 3),
    ("static_table", 8),
    ("confidence_sync", 1),
    ("confidence_async", 8),
    ("static_online", 3),
)


# ---- sampling ---------------------------------------------------------------------------------
def sharpen_markov_head(draft_dir: str, factor: float = 400.0) -> None:
    """Scale the draft's Markov head so that its proposals are confident and often wrong."""
    path = os.path.join(draft_dir, "model.safetensors")
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("markov_head.head.weight"))
    tensors[key] = tensors[key] * factor
    save_file(tensors, path)


def _processed_probs(engine: Engine, seqs: list[list[int]], sp: SamplingParams) -> np.ndarray:
    """The target's next-token distribution after each sequence, processed by the sampler's
    rule (temperature, top-k, top-p) as a non-speculative request would be."""
    runner = engine.runner
    slots = []
    try:
        for s in seqs:
            slots.append(runner.req_pool.alloc_slot())
            runner.req_pool.reserve(slots[-1], len(s))
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, seqs, [0] * len(seqs), slots, runner.req_pool.req_to_token
        )
        logits = runner.forward(batch).logits
    finally:
        for s in slots:
            runner.req_pool.free_slot(s)
    info = SamplingBatchInfo.from_params(
        [sp] * len(seqs), logits.shape[-1], logits.device, counters=[0] * len(seqs)
    )
    return processed_probs(logits, info).double().cpu().numpy()


def exact_joint(
    engine: Engine, prompt: list[int], sp: SamplingParams, depth: int = 3
) -> dict[tuple[int, ...], float]:
    """p(t1 .. t_depth) after `prompt` of every continuation the target gives a nonzero
    probability (one forward per depth over the continuations still possible)."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        prefixes = list(dist)
        p = _processed_probs(engine, [prompt + list(x) for x in prefixes], sp)
        dist = {
            x + (int(t),): dist[x] * float(p[i, t])
            for i, x in enumerate(prefixes)
            for t in np.flatnonzero(p[i])
        }
    return dist


def assert_first_three_tokens_follow_target(
    engine: Engine, prompt: list[int], sampling: dict, n_samples: int
) -> None:
    """`n_samples` requests of `prompt` generate 4 tokens each: their first three follow the
    target's joint distribution (chi-square over the cells expecting >= 5 samples, the rest
    pooled, p > 0.01). With a 3-token draft block, token 1 comes from prefill sampling and
    tokens 2 and 3 from one verify (accepted drafts, a correction, or the bonus). The draft
    must have been tried (>= 2 drafts verified per request) and rejected >= 25% of the time."""
    params = {**sampling, "max_new_tokens": 4, "ignore_eos": True}
    outs = engine.generate(input_ids=[prompt] * n_samples, sampling_params=params)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        t = o["output_ids"]
        assert len(t) == 4
        counts[tuple(t[:3])] = counts.get(tuple(t[:3]), 0) + 1
    summary = engine.spec.metrics.summary()
    assert summary.verified_drafts >= 2 * n_samples
    assert 0 < summary.correct_drafts < 0.75 * summary.verified_drafts
    joint = exact_joint(engine, prompt, SamplingParams.from_dict({**params, "max_new_tokens": 3}))
    impossible = {k: c for k, c in counts.items() if k not in joint}
    assert not impossible, f"sampled sequences the target gives probability 0: {impossible}"
    cells = list(joint)
    expected = np.array([joint[k] * n_samples for k in cells])
    observed = np.array([counts.get(k, 0) for k in cells], dtype=np.float64)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    p = chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue
    assert p > 0.01, f"chi-square p={p:.2e}"
