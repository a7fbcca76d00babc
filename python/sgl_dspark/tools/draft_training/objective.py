"""The draft's differentiable block forward and the DSpark training objective.

Training forward: the serving draft's own modules and staging, with autograd on. The context KV
of every tapped position is written by `DSparkDraftModel.write_context_kv` into fresh pools (one
row per token of the batch), the block inputs of each anchor come from the serving
`draft_inputs_torch` over a token table that maps (sequence, position) to those rows, and the
block runs through `DSparkDraftModel.forward` and the target's `compute_logits`. Only the
Markov loop differs from serving: its previous tokens are given (the anchor, then the target's
tokens), so every position's step logits come at once (`MarkovHead.teacher_forced_logits`).

Objective, per block row k = 1..gamma (the draft of position s + k for an anchor at s), weighted
by exp(-(k - 1) / decay):
  ce_weight * CE(z_k, target token)  +  tv_weight * TV(softmax(z_k), p_target)
  +  confidence_weight * BCE(sigmoid(confidence_k), 1 - TV)            (TV detached as a label)
where TV is the total variation distance, one half of the L1 distance, whose complement is the
probability that the verifier accepts a draft drawn from softmax(z_k). A target distribution
kept to its `top` most likely tokens counts the rest as one bucket (exact when top >= vocab).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_dspark.srt.models.base import BaseCausalLM
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.speculative.dspark.ops import draft_inputs_torch
from sgl_dspark.srt.speculative.dspark.sampling import confidence_head
from sgl_dspark.tools.draft_training.features import SequenceTaps


@dataclass(frozen=True)
class ObjectiveWeights:
    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0
    decay: float = 4.0  # position weight exp(-(k - 1) / decay)


@dataclass
class BlockBatch:
    """Blocks of a training step: anchors (sequence, position) over a group of sequences."""

    features: torch.Tensor  # [T, n_f * D] every token of the group, sequence after sequence
    positions: torch.Tensor  # [T] int64
    token_table: torch.Tensor  # [S, max_len] int64: feature row of (sequence, position)
    seq_index: torch.Tensor  # [B] int64
    anchor_pos: torch.Tensor  # [B] int64
    anchor_ids: torch.Tensor  # [B] int64
    prev_tokens: torch.Tensor  # [B, gamma] int64: the token before each block row's
    labels: torch.Tensor  # [B, gamma] int64 (-1 past the sequence's end)
    target_logprobs: torch.Tensor  # [B, gamma, top] fp32
    target_ids: torch.Tensor  # [B, gamma, top] int64

    def to(self, device: torch.device | str) -> BlockBatch:
        return BlockBatch(**{k: v.to(device) for k, v in self.__dict__.items()})


def make_block_batch(
    seqs: list[SequenceTaps], anchors: list[tuple[int, int]], gamma: int
) -> BlockBatch:
    """The blocks of `anchors` = [(index into seqs, anchor position)]: the anchor at s drafts
    positions s + 1 .. s + gamma from the context before s."""
    lens = [len(s.token_ids) for s in seqs]
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    table = torch.zeros(len(seqs), max(lens), dtype=torch.int64)
    for i, (st, n) in enumerate(zip(starts, lens)):
        table[i, :n] = torch.arange(st, st + n)
    top = seqs[0].top_ids.shape[1]
    b = len(anchors)
    prev = torch.zeros(b, gamma, dtype=torch.int64)
    labels = torch.full((b, gamma), -1, dtype=torch.int64)
    t_lp = torch.zeros(b, gamma, top)
    t_ids = torch.zeros(b, gamma, top, dtype=torch.int64)
    for j, (i, s) in enumerate(anchors):
        tok = seqs[i].token_ids
        n = min(gamma, lens[i] - 1 - s)  # rows with a target token
        prev[j, :n] = tok[s : s + n]
        labels[j, :n] = tok[s + 1 : s + 1 + n]
        t_lp[j, :n] = seqs[i].top_logprobs[s : s + n]
        t_ids[j, :n] = seqs[i].top_ids[s : s + n]
    return BlockBatch(
        features=torch.cat([s.features for s in seqs]),
        positions=torch.cat([torch.arange(n) for n in lens]),
        token_table=table,
        seq_index=torch.tensor([i for i, _ in anchors], dtype=torch.int64),
        anchor_pos=torch.tensor([s for _, s in anchors], dtype=torch.int64),
        anchor_ids=torch.stack([seqs[i].token_ids[s] for i, s in anchors]),
        prev_tokens=prev,
        labels=labels,
        target_logprobs=t_lp,
        target_ids=t_ids,
    )


def draft_block_forward(
    draft: DSparkDraftModel,
    target: BaseCausalLM,
    batch: BlockBatch,
    pool_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y `[B, gamma, D]`, base logits U `[B, gamma, V]` fp32) of every block, differentiable in
    the draft's parameters (the target's embedding and lm_head are used, not trained)."""
    dcfg = draft.dcfg
    gamma = dcfg.block_size
    dh = dcfg.stage_config.head_dim
    rows = batch.features.shape[0]
    pools = [
        torch.zeros(rows, dh, dtype=pool_dtype, device=batch.features.device)
        for _ in range(dcfg.num_stages)
    ]
    slots = torch.arange(rows, device=batch.features.device)
    draft.write_context_kv(batch.features, batch.positions, pools, slots)
    inputs = draft_inputs_torch(
        batch.anchor_ids,
        batch.anchor_pos,
        batch.seq_index,
        batch.token_table,
        gamma,
        dcfg.stage_config.sliding_window,
        dcfg.noise_token_id,
    )
    embeds = target.model.embed_tokens(inputs.input_ids)
    y, y_normed = draft(embeds, inputs.positions, pools, inputs.ctx_slots, inputs.ctx_valid)
    logits = target.compute_logits(y_normed)
    if y_normed.requires_grad and not logits.requires_grad:
        raise RuntimeError(
            "the target's logits kernel is not differentiable (a Triton linear): train with "
            '--engine-args \'{"kernel_backend": "torch"}\''
        )
    return y, logits


@dataclass
class LossParts:
    total: torch.Tensor
    ce: float
    tv: float
    confidence: float
    # mean over rows of 1 - TV: the expected per-position acceptance under teacher forcing
    accept: float


def dspark_loss(
    draft: DSparkDraftModel,
    target: BaseCausalLM,
    batch: BlockBatch,
    weights: ObjectiveWeights,
    pool_dtype: torch.dtype,
) -> LossParts:
    y, base_logits = draft_block_forward(draft, target, batch, pool_dtype)
    z, markov_embeds = draft.markov_head.teacher_forced_logits(base_logits, batch.prev_tokens)
    valid = batch.labels >= 0
    gamma = z.shape[1]
    pos_w = torch.exp(-torch.arange(gamma, device=z.device, dtype=torch.float32) / weights.decay)
    w = valid.float() * pos_w[None, :]
    norm = w.sum().clamp(min=1.0)

    logp = torch.log_softmax(z.float(), dim=-1)
    ce = -logp.gather(-1, batch.labels.clamp(min=0)[..., None]).squeeze(-1)
    p_draft = logp.exp()
    p_target = batch.target_logprobs.exp()
    p_draft_top = p_draft.gather(-1, batch.target_ids)
    rest = ((1.0 - p_draft_top.sum(-1)) - (1.0 - p_target.sum(-1))).abs()
    tv = 0.5 * ((p_draft_top - p_target).abs().sum(-1) + rest)
    accept = (1.0 - tv).detach().clamp(0.0, 1.0)
    if draft.dcfg.enable_confidence_head:
        raw = confidence_head(y, markov_embeds, draft.confidence_head.proj.weight).raw
        bce = F.binary_cross_entropy_with_logits(raw, accept, reduction="none")
    else:
        bce = torch.zeros_like(tv)
    per_row = weights.ce * ce + weights.tv * tv + weights.confidence * bce
    total = (per_row * w).sum() / norm
    rows = valid.float().sum().clamp(min=1.0)

    def mean(x: torch.Tensor) -> float:
        return float((x.detach() * w).sum() / norm)

    return LossParts(
        total=total,
        ce=mean(ce),
        tv=mean(tv),
        confidence=mean(bce),
        accept=float((accept * valid.float()).sum() / rows),
    )


def cosine_lr(step: int, total: int, warmup: int, min_ratio: float = 0.1) -> float:
    """The learning-rate multiplier: linear warmup, then cosine decay to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))
