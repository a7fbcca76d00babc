"""Draft-side sampling (Markov head, confidence head) and the target / draft distributions that
DSpark's acceptance compares.

All functions are plain torch, batched and free of host syncs, so they serve as the runtime path
on any device and as the reference for the fused kernels. Sampled draws go through the one
sampler's rules (`srt/layers/sampler.py`): the target distribution of a verify row is
`processed_probs` with the request's parameters, and a sampled draft is drawn from
softmax(z / T) by `sample_from_probs` with the request's counter-based uniforms, so a seeded
request proposes the same drafts whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sgl_dspark.srt.layers.sampler import SamplingBatchInfo, processed_probs, sample_from_probs

MIN_TEMPERATURE = 1e-5


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
    uniforms: torch.Tensor | None = None,
    step_logits_out: torch.Tensor | None = None,
) -> MarkovSampleOutput:
    """Sequential Markov-head sampling of gamma drafts per request.

    Args:
        base_logits: U [B, gamma, V] backbone logits (any float dtype; added in fp32).
        w1: [V, r] Markov embedding table; w2: [V, r] output weight (bias = W2 @ W1[prev]).
        anchors: [B] int64, prev_1 (the last committed-but-unverified token).
        temperature: [B] per-row temperature (clamped >= 1e-5); greedy: [B] bool.
        uniforms: [B, gamma] uniforms of the sampled rows' draws (`DRAFT_STREAM`); None when
            every row is greedy.
        step_logits_out: optional [B, gamma, V] fp32 tensor (any strides) the step logits are
            written into and returned as (a CUDA graph's buffer shared by its consumers).
    Returns:
        drafts x [B, gamma] (x_k = argmax z_k for greedy rows, an exact sample of softmax(z_k / T)
        otherwise), step logits z [B, gamma, V] fp32 and the Markov embeddings e [B, gamma, r]
        the confidence head consumes.
    """
    batch, gamma, vocab = base_logits.shape
    temp = temperature.float().clamp(min=MIN_TEMPERATURE).view(batch, 1)
    drafts = torch.empty((batch, gamma), dtype=torch.int64, device=base_logits.device)
    if step_logits_out is None:
        step_logits = torch.empty(
            (batch, gamma, vocab), dtype=torch.float32, device=base_logits.device
        )
    else:
        if step_logits_out.shape != (batch, gamma, vocab) or step_logits_out.dtype != torch.float32:
            raise ValueError(
                f"step_logits_out must be fp32 {(batch, gamma, vocab)}, got "
                f"{step_logits_out.dtype} {tuple(step_logits_out.shape)}"
            )
        step_logits = step_logits_out
    embeds = torch.empty((batch, gamma, w1.shape[1]), dtype=w1.dtype, device=base_logits.device)
    prev = anchors.to(torch.int64)
    for k in range(gamma):
        e = w1[prev]
        z = base_logits[:, k].float() + torch.matmul(e.to(w2.dtype), w2.t()).float()
        x = torch.argmax(z, dim=-1)
        if uniforms is not None:
            sampled = sample_from_probs(torch.softmax(z / temp, dim=-1), uniforms[:, k])
            x = torch.where(greedy, x, sampled)
        drafts[:, k] = x
        step_logits[:, k] = z
        embeds[:, k] = e
        prev = x
    return MarkovSampleOutput(drafts, step_logits, embeds)


def markov_greedy_shard(
    base_logits: torch.Tensor,
    w1: torch.Tensor,
    w2_rows: torch.Tensor,
    anchors: torch.Tensor,
    argmax: Callable[[torch.Tensor], torch.Tensor],
) -> MarkovSampleOutput:
    """The greedy Markov loop of `markov_sample` over one rank's vocabulary shard (tensor
    parallelism): every rank computes only its columns of each step's logits, and the draft
    is the argmax of the whole row without any row crossing ranks.

    Per step k the same operations as `markov_sample` on this rank's columns: e = W1[prev]
    (W1 whole: prev is any token), z = U_k + e W2_s^T with W2_s the rows of W2 of this rank's
    columns (each column the whole-row product's, up to the GEMM's summation order), then
    `argmax(z)` combines every rank's (max, first index) pair (`LogitsReader.argmax`: ties to
    the smallest global index, the first NaN above every number, as `torch.argmax` of the
    whole row). Every rank gets the same draft, the next step's prev.

    Only greedy drafts can be made this way: a sampled draft (temperature > 0) draws from
    softmax(z / T) over the whole row, so a batch with sampled rows gathers its logits whole
    (`markov_sample`).

    Args:
        base_logits: U `[B, gamma, V_s]`, this rank's columns of the backbone logits.
        w1: `[V, r]` the whole Markov embedding table; w2_rows: `[V_s, r]` this rank's rows of
            the Markov output weight.
        anchors: `[B]` int64 prev_1; argmax: logits `[B, V_s]` -> global ids `[B]` (a
            collective under tensor parallelism: every rank calls it in the same order).
    Returns:
        drafts `[B, gamma]` (global ids), this rank's columns of the step logits
        `[B, gamma, V_s]` fp32 and the Markov embeddings `[B, gamma, r]`.
    """
    batch, gamma, width = base_logits.shape
    device = base_logits.device
    drafts = torch.empty((batch, gamma), dtype=torch.int64, device=device)
    step_logits = torch.empty((batch, gamma, width), dtype=torch.float32, device=device)
    embeds = torch.empty((batch, gamma, w1.shape[1]), dtype=w1.dtype, device=device)
    prev = anchors.to(torch.int64)
    for k in range(gamma):
        e = w1[prev]
        z = base_logits[:, k].float() + torch.matmul(e.to(w2_rows.dtype), w2_rows.t()).float()
        x = argmax(z)
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


def target_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Verify logits [B, W, V] -> target distributions P [B, W, V] fp32.

    Sampled rows: the sampler's `processed_probs` (temperature, top-k, top-p, min-p) of each
    verify row with its request's parameters. Greedy rows: one-hot at the argmax (first index on
    ties), the distribution argmax decoding samples from.
    """
    batch, width, vocab = logits.shape
    probs = processed_probs(logits.reshape(batch * width, vocab).float(), info.per_position(width))
    probs = probs.view(batch, width, vocab)
    one_hot = torch.zeros_like(probs).scatter_(-1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)
    return torch.where(info.is_greedy.view(batch, 1, 1), one_hot, probs)


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
