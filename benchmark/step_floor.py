"""The memory floor of an engine step: the bytes a decode or DSpark step reads (weights, the
expected distinct routed experts of a batch under uniform routing, embedding and Engram rows,
the attention caches) and the device's copy bandwidth to divide them by."""

from __future__ import annotations

import time

import torch
from sgl_dspark import Engine
from sgl_dspark.srt.configs.deepseek_v41 import LayerRole
from sgl_dspark.srt.configs.model_config import CSA, HCA, ModelConfig


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second)."""
    if not device.startswith("cuda"):
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (time.perf_counter() - t0)


def _routed_bytes(p: torch.Tensor, experts: int, top_k: int, tokens: int) -> float:
    """Bytes of a routed-expert tensor that `tokens` tokens read: the expected number of
    distinct experts under uniform routing."""
    distinct = experts * (1 - (1 - top_k / experts) ** tokens)
    return p.numel() * p.element_size() * distinct / experts


def weight_bytes(model: torch.nn.Module, experts: int, top_k: int, tokens: int) -> float:
    """Weight bytes of one forward of `tokens` tokens: every non-expert weight, embedding and
    Engram table rows only, the expected distinct routed experts."""
    total = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if "experts." in name and "shared" not in name:
            nbytes = _routed_bytes(p, experts, top_k, tokens)
        elif name.endswith("embed_tokens.weight"):
            nbytes = tokens * p.shape[1] * p.element_size()
        elif name.endswith("engram.embed.weight"):
            nbytes = 0.0  # counted with the KV (rows per token)
        total += nbytes
    return total


def v41_kv_bytes(cfg: ModelConfig, context: int) -> float:
    """Cache bytes one V4.1 request's step reads: per layer its FP8 window rows, per compressed
    layer the packed FP4 latents of its top-k, per index source every packed index key, and the
    Engram rows of the token."""
    from sgl_dspark.srt.mem_cache.v41_pool import QuantizedRows

    v41 = cfg.v41
    assert v41 is not None
    act = torch.bfloat16
    window = QuantizedRows.bytes_per_row(cfg.head_dim, "fp8_window", act)
    latent = QuantizedRows.bytes_per_row(cfg.head_dim, "fp4_latent", act)
    key = QuantizedRows.bytes_per_row(cfg.index_head_dim, "fp4_index", act)
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        total += min(context, cfg.sliding_window) * window
        m = v41.compress_ratios[i]
        if m > 0:
            total += min(context // m, cfg.index_topk) * latent
        if v41.role(i) in (LayerRole.FULL, LayerRole.REINDEX):
            total += (context // m) * key
    if v41.engram is not None:
        rows = len(v41.engram.layer_ids) * v41.engram.ids_per_token
        total += rows * v41.engram.head_dim * 2
    return total


def step_bytes(engine: Engine, bs: int, context: int) -> float:
    """Bytes one step of bs requests reads. Plain decode: the target's weights for bs tokens
    (`weight_bytes`) and the attention KV (window + compressed entries + indexer keys) of each
    request. DSpark: the target verifies bs x (gamma + 1) tokens and the draft reads its own
    weights for bs x gamma tokens (its context KV is small and left out)."""
    cfg: ModelConfig = engine.runner.model_cfg
    spec = engine.spec
    width = 1 if spec is None else spec.worker.gamma + 1
    total = weight_bytes(
        engine.runner.model, cfg.n_routed_experts, cfg.num_experts_per_tok, bs * width
    )
    if spec is not None:
        d = spec.worker.draft.cfg
        total += weight_bytes(
            spec.worker.draft,
            d.n_routed_experts,
            d.num_experts_per_tok,
            bs * spec.worker.gamma,
        )
    if cfg.v41 is not None:
        return total + bs * v41_kv_bytes(cfg, context)
    el = torch.finfo(engine.runner.dtype).bits // 8
    for i, lt in enumerate(cfg.layer_types):
        kv = min(context, cfg.sliding_window) * cfg.head_dim
        if lt in (CSA, HCA):
            m = cfg.compress_ratio(i)
            kv += (min(context // m, cfg.index_topk) if lt == CSA else context // m) * cfg.head_dim
            if lt == CSA:
                kv += (context // m) * cfg.index_head_dim
        total += bs * kv * el
    return total
