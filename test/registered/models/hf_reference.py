"""Helpers for parity tests against HF transformers' DeepseekV4ForCausalLM (tests only)."""

from __future__ import annotations

import copy

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# A main config and its "sensitivity" variant (other hc_eps / Sinkhorn iterations);
# two more: other layer orders, hc_mult 2, CSA rate 8, sigmoid router, plain rope.
_BASE = dict(
    vocab_size=512,
    hidden_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    q_lora_rank=64,
    partial_rotary_factor=0.25,
    num_experts_per_tok=2,
    n_routed_experts=8,
    n_shared_experts=1,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    sliding_window=16,
    o_groups=2,
    o_lora_rank=32,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=4,
    max_position_embeddings=256,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    layer_types=[S, C, H, C, H, S],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    compress_rates={C: 4, H: 16},
    swiglu_limit=0.3,
    routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus",
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

PARITY_CONFIGS: dict[str, dict] = {
    "main": _BASE,
    "sensitivity": {**_BASE, "hc_eps": 1e-2, "hc_sinkhorn_iters": 3},
    "hc2_csa8": {
        **_BASE,
        "hc_mult": 2,
        "num_hidden_layers": 5,
        "layer_types": [C, C, S, H, C],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe", "moe"],
        "compress_rates": {C: 8, H: 16},
        "sliding_window": 12,
        "index_topk": 3,
        "scoring_func": "sigmoid",
        "o_groups": 4,
    },
    "hca_first": {
        **_BASE,
        "num_hidden_layers": 4,
        "layer_types": [H, S, C, H],
        "mlp_layer_types": ["moe", "hash_moe", "moe", "moe"],
        "compress_rates": {C: 4, H: 8},
        "rope_parameters": None,
        "hc_mult": 3,
        "sliding_window": 9,
        "index_topk": 5,
    },
}


def make_hf_model(name: str, seed: int = 0) -> DeepseekV4ForCausalLM:
    """HF model with every constant-initialised tensor randomised (`randomise_constants`)."""
    kwargs = copy.deepcopy(PARITY_CONFIGS[name])
    if kwargs.get("rope_parameters") is None:
        kwargs.pop("rope_parameters", None)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**kwargs)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    cfg = model.config
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or "layernorm" in pname:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif pname.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif pname.endswith(("scale", "hc_scale")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
            elif bname.endswith("tid2eid"):
                rows = [
                    torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                    for _ in range(cfg.vocab_size)
                ]
                b.copy_(torch.stack(rows))
    return model


@torch.no_grad()
def hf_logits(model: DeepseekV4ForCausalLM, ids: list[int]) -> torch.Tensor:
    """No-cache prefill logits `[S, V]` of one sequence."""
    out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()
