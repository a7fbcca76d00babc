"""DSpark's speculative step in torch: the reference of the "spec" kernel family (`accept.py`,
`draft_inputs.py`, `markov.py`).

Acceptance (`spec_accept_ref`). A verify batch has B requests; row r verifies
``L_r = verify_lens[r]`` tokens (0 = padding row, 1..W otherwise) of
``verify_ids[r] = [anchor, d_1, ..., d_{W-1}]``. Target row j scores draft j+1; the target row
at the accept length n_r supplies the bonus token.
  * Greedy rule: n_r = length of the longest prefix with ``d_{j+1} == target_ids[r, j]``
    (j < L_r-1), bonus = ``target_ids[r, n_r]``. Simulated acceptance (benchmarks,
    ``forced_accept``) replaces n_r by min(max(forced_r, 0), L_r - 1) and keeps that bonus rule.
  * Sampled rule (standard speculative rejection sampling): draft j is accepted iff
    ``accept_uniforms[r, j-1] * Q[r, j-1, d_j] < P[r, j-1, d_j]`` (fp32 product, then compare),
    stopping at the first rejection. Rejected at draft n+1 -> the bonus is drawn from
    normalize(max(P_n - Q_n, 0)), or from P_n when that residual holds no mass; all L_r-1 drafts
    accepted -> drawn from P_{L_r-1}. Draft ids outside [0, V) count as P = Q = 0 (always
    rejected). Tokens are drawn with the fixed-point inverse CDF (`sample_inverse_cdf_ref`); the
    residual is used iff its fixed-point mass exceeds ``MIN_RESIDUAL_MASS`` (probability 2**-24,
    below fp32 resolution of a normalised row), otherwise P is used.
Outputs (``AcceptOutput``): accept_lens int32 [B] (n), commit_lens int32 [B] (n+1), out_tokens
int64 [B, W] (drafts d_1..d_n in columns 0..n-1, bonus at column n, ``fill_token`` after),
next_anchors int64 [B] (the bonus), new_seq_lens [B] (seq_lens + commit, seq_lens' dtype).
Padding rows (L_r = 0) commit nothing (n = c = 0, all fill, anchor and seq_len kept).
``verify_lens`` is clamped to [0, W].

Draft inputs (`prepare_draft_inputs_ref`), for request row r (committed length s_r, anchor a_r,
req-pool row p_r) and padded batch rows B:
    input_ids[r]        = [a_r, m, m, ..., m]                      [B, Q]      (m = mask token)
    draft_positions[r]  = s_r + j                  (j < Q)         [B, Q]
    draft_slots[r]      = req_to_token[p_r, s_r + j]  (j < Q)      [B, Q]
    verify_positions[r] = s_r + j                  (j < W_full)    [B, W_full]
    verify_slots[r]     = req_to_token[p_r, s_r + j]  (j < W_full) [B, W_full]
all int64. Rows r >= n_valid (a device int32 scalar) are padding: ids = m, positions =
``pad_position``, slots = ``pad_slot`` (the dummy KV page). A slot whose table read would fall
outside ``req_to_token`` (s_r + j >= its width, or p_r outside its rows) is also ``pad_slot``: the
pool reserves every verified position before the step, and the guard keeps a violated
reservation from turning into an out-of-bounds read.

Greedy Markov draft (`markov_greedy_ref`), for every draft position k (``prev_0 = anchors``):
    e_k = W1[prev_k]                                               # [B, r]
    z_k = U[:, k].float() + (e_k.to(W2.dtype) @ W2.T).float()     # [B, V] fp32
    x_k = argmax(z_k)        prev_{k+1} = x_k
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_dspark.kernels.sampling.reference import (
    FIXED_POINT_BITS,
    UNIFORM_BITS,
    sample_inverse_cdf_ref,
    to_fixed_point,
)

# Residual mass at or below this (fixed point; = probability 2**-24) falls back to P.
MIN_RESIDUAL_MASS = 1 << (FIXED_POINT_BITS - UNIFORM_BITS)


class AcceptOutput(NamedTuple):
    accept_lens: torch.Tensor  # int32 [B]
    commit_lens: torch.Tensor  # int32 [B]
    out_tokens: torch.Tensor  # int64 [B, W]
    next_anchors: torch.Tensor  # int64 [B]
    new_seq_lens: torch.Tensor  # seq_lens.dtype [B]


def sample_residual_ref(
    p_rows: torch.Tensor, q_rows: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Token ~ normalize(max(P - Q, 0)), or ~ P when the residual has no mass. fp32 [N, V] -> [N]."""
    p = p_rows.float().clamp_min(0.0)
    residual = to_fixed_point((p - q_rows.float()).clamp_min(0.0))
    use_residual = residual.sum(-1) > MIN_RESIDUAL_MASS
    weights = torch.where(use_residual[:, None], residual, to_fixed_point(p))
    return sample_inverse_cdf_ref(weights, uniforms)


def _leading_true(ok: torch.Tensor) -> torch.Tensor:
    return ok.long().cumprod(-1).sum(-1)


def spec_accept_ref(
    verify_ids: torch.Tensor,
    verify_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    target_ids: torch.Tensor | None = None,
    target_probs: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    accept_uniforms: torch.Tensor | None = None,
    sample_uniforms: torch.Tensor | None = None,
    greedy_mask: torch.Tensor | None = None,
    fill_token: int = -1,
    forced_accept: torch.Tensor | None = None,
) -> AcceptOutput:
    """Speculative acceptance (module doc); same arguments and outputs as ``spec_accept``."""
    num_rows, width = verify_ids.shape
    device = verify_ids.device
    lens = verify_lens.long().clamp(0, width)
    drafts = verify_ids[:, 1:].long()
    in_window = torch.arange(1, width, device=device)[None, :] < lens[:, None]
    rows = torch.arange(num_rows, device=device)
    zeros = torch.zeros(num_rows, dtype=torch.long, device=device)
    accept_g = bonus_g = accept_s = bonus_s = zeros
    if target_ids is not None:
        accept_g = _leading_true(in_window & (drafts == target_ids[:, :-1].long()))
        if forced_accept is not None:
            accept_g = torch.minimum(forced_accept.long().clamp(min=0), (lens - 1).clamp(min=0))
        bonus_g = target_ids.long()[rows, accept_g]
    if target_probs is not None:
        assert draft_probs is not None and accept_uniforms is not None
        assert sample_uniforms is not None
        vocab = target_probs.shape[-1]
        valid_id = in_window & (drafts >= 0) & (drafts < vocab)
        safe_ids = drafts.clamp(0, vocab - 1)[..., None]
        p_draft = target_probs[:, : width - 1].float().gather(2, safe_ids)[..., 0]
        q_draft = draft_probs.float().gather(2, safe_ids)[..., 0]
        p_draft = torch.where(valid_id, p_draft, torch.zeros_like(p_draft))
        q_draft = torch.where(valid_id, q_draft, torch.zeros_like(q_draft))
        accept_s = _leading_true(in_window & (accept_uniforms.float() * q_draft < p_draft))
        rejected = accept_s < lens - 1
        q_rows = torch.zeros_like(target_probs[:, 0], dtype=torch.float32)
        if width > 1:
            q_pick = draft_probs[rows, accept_s.clamp(max=width - 2)].float()
            q_rows = torch.where(rejected[:, None], q_pick, q_rows)
        bonus_s = sample_residual_ref(target_probs[rows, accept_s], q_rows, sample_uniforms)
    if target_ids is not None and target_probs is not None:
        assert greedy_mask is not None, "greedy_mask selects the rule when both are given"
        accept = torch.where(greedy_mask, accept_g, accept_s)
        bonus = torch.where(greedy_mask, bonus_g, bonus_s)
    elif target_ids is not None:
        accept, bonus = accept_g, bonus_g
    else:
        accept, bonus = accept_s, bonus_s
    valid = lens > 0
    accept = torch.where(valid, accept, zeros)
    commit = torch.where(valid, accept + 1, zeros)
    cols = torch.arange(width, device=device)[None, :]
    fill = torch.full_like(verify_ids, fill_token, dtype=torch.long)
    shifted = torch.cat([drafts, fill[:, :1]], dim=1)
    out_tokens = torch.where(cols < accept[:, None], shifted, fill)
    out_tokens = torch.where(cols == accept[:, None], bonus[:, None], out_tokens)
    out_tokens = torch.where(valid[:, None], out_tokens, fill)
    next_anchors = torch.where(valid, bonus, verify_ids[:, 0].long())
    return AcceptOutput(
        accept.to(torch.int32),
        commit.to(torch.int32),
        out_tokens,
        next_anchors,
        (seq_lens.long() + commit).to(seq_lens.dtype),
    )


class DraftInputs(NamedTuple):
    input_ids: torch.Tensor  # int64 [B, Q]
    draft_positions: torch.Tensor  # int64 [B, Q]
    draft_slots: torch.Tensor  # int64 [B, Q]
    verify_positions: torch.Tensor  # int64 [B, W_full]
    verify_slots: torch.Tensor  # int64 [B, W_full]


def prepare_draft_inputs_ref(
    anchors: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    draft_len: int,
    verify_width: int,
    mask_token_id: int,
    pad_position: int = 0,
    pad_slot: int = 0,
) -> DraftInputs:
    """The draft inputs and the verify-window plan (module doc), no host sync; same arguments
    as ``prepare_draft_inputs``."""
    num_rows = anchors.shape[0]
    device = anchors.device
    valid = (torch.arange(num_rows, device=device) < n_valid.reshape(()).long())[:, None]
    seq = seq_lens.long()[:, None]
    pool = req_pool_indices.long()[:, None]
    pool_rows, table_width = req_to_token.shape

    def plan(width: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = seq + torch.arange(width, device=device)[None, :]
        readable = valid & (positions >= 0) & (positions < table_width)
        readable = readable & (pool >= 0) & (pool < pool_rows)
        slots = (
            req_to_token.long()[
                pool.clamp(0, max(pool_rows - 1, 0)), positions.clamp(0, max(table_width - 1, 0))
            ]
            if pool_rows > 0 and table_width > 0
            else torch.zeros_like(positions)
        )
        slots = torch.where(readable, slots, torch.full_like(slots, pad_slot))
        positions = torch.where(valid, positions, torch.full_like(positions, pad_position))
        return positions, slots

    ids = torch.full((num_rows, draft_len), mask_token_id, dtype=torch.long, device=device)
    ids[:, :1] = torch.where(valid, anchors.long()[:, None], ids[:, :1])
    draft_positions, draft_slots = plan(draft_len)
    verify_positions, verify_slots = plan(verify_width)
    return DraftInputs(ids, draft_positions, draft_slots, verify_positions, verify_slots)


class MarkovGreedyOutput(NamedTuple):
    drafts: torch.Tensor  # [B, G] int64, x_k = argmax z_k
    step_logits: torch.Tensor  # [B, G, V] fp32, z_k = U_k + W2 W1[prev_k]
    embeds: torch.Tensor  # [B, G, r] W1 dtype, e_k = W1[prev_k]


def markov_greedy_ref(
    base_logits: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, anchors: torch.Tensor
) -> MarkovGreedyOutput:
    """The greedy Markov loop (module doc).

    Args:
        base_logits: U [B, G, V] fp32/bf16/fp16; w1: [V, r] embedding table; w2: [V, r] head.
        anchors: [B] integer, prev_0 in [0, V).
    Returns:
        drafts [B, G] int64, step_logits [B, G, V] fp32, embeds [B, G, r] (w1.dtype).
    """
    batch, gamma, vocab = base_logits.shape
    device = base_logits.device
    drafts = torch.empty((batch, gamma), dtype=torch.int64, device=device)
    step_logits = torch.empty((batch, gamma, vocab), dtype=torch.float32, device=device)
    embeds = torch.empty((batch, gamma, w1.shape[1]), dtype=w1.dtype, device=device)
    prev = anchors.to(torch.int64)
    for k in range(gamma):
        e = w1[prev]
        z = base_logits[:, k].float() + torch.matmul(e.to(w2.dtype), w2.t()).float()
        x = torch.argmax(z, dim=-1)
        drafts[:, k] = x
        step_logits[:, k] = z
        embeds[:, k] = e
        prev = x
    return MarkovGreedyOutput(drafts, step_logits, embeds)
