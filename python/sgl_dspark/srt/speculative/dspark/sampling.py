"""Draft-side sampling (Markov head, confidence head) and target/draft probability processing.

Design `dspark.md` §1.7 (Markov loop), §1.8 (confidence head), §5 (sampling parameters). All
functions are plain torch, batched, and free of host syncs, so they serve both as the runtime
path on any device and as the reference for fused kernels.

Sampling-parameter conventions: ``temperature`` [B] float (clamped >= 1e-5 before dividing);
``top_k`` [B] int64 already normalised by the caller -- SGLang's "-1 = disabled" must arrive as a
value >= V (e.g. ``TOP_K_ALL``); a row is greedy iff top_k <= 1 or temperature <= 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MIN_TEMPERATURE = 1e-5
TOP_K_ALL = 1 << 30


def is_greedy(temperature: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[B] bool: greedy rows (top_k <= 1 or temperature <= 0)."""
    return (top_k <= 1) | (temperature <= 0)


def gumbel_noise(
    shape: tuple[int, ...],
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """i.i.d. standard Gumbel(0, 1) samples, fp32, via -log(-log(u)) with u clamped into (0, 1)."""
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    return -torch.log(-torch.log(u.clamp(min=tiny, max=1.0 - 2**-24)))


class MarkovSampleOutput(NamedTuple):
    drafts: torch.Tensor  # [B, gamma] int64
    step_logits: torch.Tensor  # [B, gamma, V] fp32, z_k = U_k + W2 W1[prev_k]
    markov_embeds: torch.Tensor  # [B, gamma, r] (W1 dtype), e_k = W1[prev_k]


def markov_sample(
    base_logits: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    anchors: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    all_greedy: bool = False,
) -> MarkovSampleOutput:
    """Sequential Markov-head sampling of gamma drafts per request.

    Args:
        base_logits: U [B, gamma, V] backbone logits (any float dtype; added in fp32).
        w1: [V, r] Markov embedding table; w2: [V, r] output weight (bias = W2 @ W1[prev]).
        anchors: [B] int64, prev_1 (the last committed-but-unverified token).
        temperature: [B] per-row temperature (clamped >= 1e-5); greedy: [B] bool.
        noise: optional Gumbel noise [B, gamma, V]; else drawn from ``generator``.
        all_greedy: host hint that every row is greedy (skips drawing and adding noise).
    Returns:
        drafts x [B, gamma] (x_k = argmax z_k for greedy rows, argmax z_k / T + G_k otherwise,
        an exact sample of softmax(z_k / T)), step logits z [B, gamma, V] fp32 and the Markov
        embeddings e [B, gamma, r] the confidence head consumes.
    """
    batch, gamma, vocab = base_logits.shape
    if noise is None and not all_greedy:
        noise = gumbel_noise((batch, gamma, vocab), generator, base_logits.device)
    temp = temperature.float().clamp(min=MIN_TEMPERATURE).view(batch, 1)
    drafts = torch.empty((batch, gamma), dtype=torch.int64, device=base_logits.device)
    step_logits = torch.empty((batch, gamma, vocab), dtype=torch.float32, device=base_logits.device)
    embeds = torch.empty((batch, gamma, w1.shape[1]), dtype=w1.dtype, device=base_logits.device)
    prev = anchors.to(torch.int64)
    for k in range(gamma):
        e = w1[prev]
        z = base_logits[:, k].float() + torch.matmul(e.to(w2.dtype), w2.t()).float()
        x = torch.argmax(z, dim=-1)
        if noise is not None:
            sampled = torch.argmax(z / temp + noise[:, k].float(), dim=-1)
            x = torch.where(greedy, x, sampled)
        drafts[:, k] = x
        step_logits[:, k] = z
        embeds[:, k] = e
        prev = x
    return MarkovSampleOutput(drafts, step_logits, embeds)


class ConfidenceOutput(NamedTuple):
    confidence: torch.Tensor  # [B, gamma] fp32, sigmoid(raw / T_k)
    raw: torch.Tensor  # [B, gamma] fp32, w . [y_k ; e_k] + b


def confidence_head(
    hidden: torch.Tensor,
    markov_embeds: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | float | None = None,
    temperatures: torch.Tensor | None = None,
) -> ConfidenceOutput:
    """c_k = sigmoid((w . [y_k ; W1[prev_k]] + b) / T_k), all in fp32.

    Args:
        hidden: y [B, gamma, d] (pre-norm collapsed draft hidden state).
        markov_embeds: [B, gamma, r] from ``markov_sample`` -- e_k = W1[prev_k], the embedding of
            the token *before* position k, which keeps scheduling causal (never W1[x_k]).
        weight: [d + r] or [1, d + r]; bias: optional scalar; temperatures: optional [gamma] STS.
    """
    d = hidden.shape[-1]
    w = weight.reshape(-1).float()
    if w.numel() != d + markov_embeds.shape[-1]:
        raise ValueError(
            f"confidence head weight has {w.numel()} entries, expected d + r = "
            f"{d} + {markov_embeds.shape[-1]}"
        )
    raw = torch.matmul(hidden.float(), w[:d]) + torch.matmul(markov_embeds.float(), w[d:])
    if bias is not None:
        raw = raw + torch.as_tensor(bias, dtype=torch.float32, device=raw.device).reshape(())
    scaled = raw if temperatures is None else raw / temperatures.float().view(1, -1)
    return ConfidenceOutput(torch.sigmoid(scaled), raw)


def _truncate_top_k_top_p(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask scaled logits [N, V] outside the per-row top-k set, then outside the top-p nucleus of
    the renormalised top-k distribution (always keeping the most likely token)."""
    vocab = scaled.shape[-1]
    sorted_vals, sorted_idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=scaled.device).view(1, vocab)
    keep = ranks < top_k.clamp(1, vocab).view(-1, 1)
    probs = torch.softmax(sorted_vals.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= (mass_before < top_p.view(-1, 1)) | (top_p.view(-1, 1) >= 1.0)
    keep[:, 0] = True
    keep_orig = torch.zeros_like(keep).scatter_(1, sorted_idx, keep)
    return scaled.masked_fill(~keep_orig, float("-inf"))


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    apply_top_k_top_p: bool = True,
) -> torch.Tensor:
    """Verify logits [B, W, V] -> target distributions P [B, W, V] fp32 (§5).

    Sampled rows: softmax(logits / T) restricted to top-k, then renormalised top-p. Greedy rows
    (top_k <= 1 or T <= 0): one-hot at the argmax (first index on ties). ``apply_top_k_top_p`` is a
    host-side hint: pass False when no request of the batch truncates, to skip the vocab sort.
    """
    batch, width, vocab = logits.shape
    temp = temperature.float().clamp(min=MIN_TEMPERATURE)
    scaled = logits.float() / temp.view(batch, 1, 1)
    if apply_top_k_top_p:
        scaled = _truncate_top_k_top_p(
            scaled.reshape(batch * width, vocab),
            top_k.repeat_interleave(width),
            top_p.float().repeat_interleave(width),
        ).view(batch, width, vocab)
    probs = torch.softmax(scaled, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)
    greedy = is_greedy(temperature, top_k).view(batch, 1, 1)
    return torch.where(greedy, one_hot, probs)


def draft_probs(
    step_logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, drafts: torch.Tensor
) -> torch.Tensor:
    """Draft step logits z [B, gamma, V] -> Q [B, gamma, V] fp32, the exact proposal used.

    softmax(z / T) for sampled rows (no top-k/top-p: the draft ignores them); one-hot at the
    draft token for greedy rows (argmax drafts)."""
    batch = step_logits.shape[0]
    temp = temperature.float().clamp(min=MIN_TEMPERATURE).view(batch, 1, 1)
    probs = torch.softmax(step_logits.float() / temp, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, drafts.unsqueeze(-1), 1.0)
    return torch.where(greedy.view(batch, 1, 1), one_hot, probs)
