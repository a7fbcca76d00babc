"""Torch acceptance of a verified draft window (design `dspark.md` §2.4, §2.3 step 9).

Inputs per request r: ``verify_ids[r] = [a_r, d_1, ..., d_{W-1}]`` and a verify length
``verify_lens[r]`` in [1, W] (anchor + drafts actually verified; 0 marks a padding row). Target
row j scores draft d_{j+1}; row ``verify_lens - 1`` is the bonus row.

Everything is vectorised with no host sync (no ``.item()``, ``.tolist()`` or Python branches on
device values); randomness enters only through the caller's uniforms, so results are reproducible
and a fused kernel with the same contract can be checked against this code exactly.

Drawing the bonus/correction token (``sample_inverse_cdf``) is integer arithmetic, so it gives the
same token on every device and for any reduction order (the rule the Triton accept kernel of the
"spec" family implements; both backends commit identical tokens on identical uniforms):
  1. weights ``w[k] = int64(trunc(x[k] * 2**40))`` of the non-negative fp32 mass x;
  2. ``S = sum(w)``, ``u24 = min(trunc(u * 2**24), 2**24 - 1)``, threshold ``t = floor(S * u24 /
     2**24)`` (computed exactly in int64);
  3. token = the first k whose integer CDF ``w[0] + ... + w[k]`` exceeds t (half-open intervals:
     a uniform on a boundary picks the upper token; a zero-weight token is never picked).
The residual ``max(P - Q, 0)`` is used iff its fixed-point mass exceeds ``MIN_RESIDUAL_MASS``
(probability 2**-24, below fp32 resolution of a normalised row); otherwise P is used.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FIXED_POINT_BITS = 40
UNIFORM_BITS = 24
# Residual mass at or below this (fixed point; probability 2**-24) is rounding noise: resample
# from P instead (any P-sample is exact then).
MIN_RESIDUAL_MASS = 1 << (FIXED_POINT_BITS - UNIFORM_BITS)


class AcceptOutput(NamedTuple):
    accept_len: torch.Tensor  # [B] int64, n: accepted drafts (0 for padding rows)
    commit_len: torch.Tensor  # [B] int64, n + 1 (0 for padding rows)
    out_tokens: torch.Tensor  # [B, W] int64, d_1..d_n, bonus at column n, -1 after
    next_anchor: torch.Tensor  # [B] int64, bonus (padding rows keep their anchor)
    new_seq_lens: torch.Tensor  # [B] int64, seq_lens + commit_len
    bonus: torch.Tensor  # [B] int64
    cap_trim: torch.Tensor  # [B] int64, drafts removed by the cap (0 without a cap)


def to_fixed_point(mass: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 mass -> int64 ``trunc(mass * 2**40)`` (an exact power-of-two scale)."""
    return (mass.float() * float(1 << FIXED_POINT_BITS)).to(torch.int64)


def sample_fixed_point(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample per row from int64 weights [N, V] (steps 2-3 of the module doc).

    uniforms [N] fp32 in [0, 1). Returns [N] int64; a row without mass gives token 0."""
    total = weights.sum(dim=-1)
    u24 = (uniforms.float() * float(1 << UNIFORM_BITS)).to(torch.int64)
    u24 = u24.clamp(0, (1 << UNIFORM_BITS) - 1)
    low_bits = (1 << UNIFORM_BITS) - 1
    # floor(S * u24 / 2**24) without overflow: split S into its high and low 24-bit parts.
    threshold = (total >> UNIFORM_BITS) * u24 + (((total & low_bits) * u24) >> UNIFORM_BITS)
    # Integer CDFs are exact and non-decreasing: count the entries <= t by binary search.
    cdf = torch.cumsum(weights, dim=-1)
    token = torch.searchsorted(cdf, threshold.view(-1, 1), right=True).view(-1)
    return torch.where(total > 0, token, torch.zeros_like(token))


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One categorical sample per row by the fixed-point inverse CDF of the module doc.

    probs [N, V] fp32 (negative entries count as 0; need not be normalised), uniforms [N] in
    [0, 1). Returns [N] int64; never a zero-mass token (a row without mass gives 0)."""
    return sample_fixed_point(to_fixed_point(probs.float().clamp(min=0.0)), uniforms)


def _leading_true_count(mask: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] int64 length of the all-true prefix."""
    return torch.cumprod(mask.to(torch.int64), dim=1).sum(dim=1)


def _draft_window(
    verify_ids: torch.Tensor, verify_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts d_1..d_{W-1} [B, W-1] and a mask of the ones inside each request's verify length."""
    width = verify_ids.shape[1]
    positions = torch.arange(1, width, device=verify_ids.device).view(1, -1)
    return verify_ids[:, 1:], positions < verify_lens.view(-1, 1)


def greedy_accept(
    verify_ids: torch.Tensor, verify_lens: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix of drafts equal to the target argmax chain, within each verify length.

    target_argmax [B, W] int64 (t_j = argmax of verify row j). Returns (n [B], bonus = t_n [B])."""
    drafts, in_window = _draft_window(verify_ids, verify_lens)
    match = (drafts == target_argmax[:, :-1]) & in_window
    accept_len = _leading_true_count(match)
    bonus = target_argmax.gather(1, accept_len.view(-1, 1)).view(-1)
    return accept_len, bonus


def sampled_accept(
    verify_ids: torch.Tensor,
    verify_lens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    coins: torch.Tensor,
    bonus_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling with exact target outputs.

    Args:
        target_probs: P [B, W, V]; row j is the target distribution after verify row j.
        draft_probs: Q [B, >= W-1, V]; Q[:, j-1] generated draft d_j (one-hot for argmax drafts).
        coins: [B, >= W-1] uniforms; d_j is accepted iff coins[:, j-1] * Q_j(d_j) < P_j(d_j).
        bonus_uniforms: [B] uniforms for the bonus sample.
    Returns:
        (n [B], bonus [B]): bonus ~ normalize(max(P_{n+1} - Q_{n+1}, 0)) after a rejection (P if
        that residual has ~no mass), else ~ P at the last verified row; drawn by the fixed-point
        inverse CDF of the module doc.
    """
    batch, width, _ = target_probs.shape
    drafts, in_window = _draft_window(verify_ids, verify_lens)
    rows = torch.arange(batch, device=verify_ids.device)
    if width == 1:
        accept_len = torch.zeros(batch, dtype=torch.int64, device=verify_ids.device)
        return accept_len, sample_inverse_cdf(target_probs[:, 0], bonus_uniforms)
    q = draft_probs[:, : width - 1]
    # Ids past a row's verify length may be fill values: clamp for the gathers, and never accept
    # an out-of-vocab id inside the window.
    vocab = target_probs.shape[-1]
    in_vocab = (drafts >= 0) & (drafts < vocab)
    safe = drafts.clamp(0, vocab - 1).unsqueeze(-1)
    p_draft = target_probs[:, : width - 1].gather(-1, safe).squeeze(-1)
    q_draft = q.gather(-1, safe).squeeze(-1)
    accepted = (coins[:, : width - 1].float() * q_draft < p_draft) & in_window & in_vocab
    accept_len = _leading_true_count(accepted)
    rejected = accept_len < verify_lens - 1
    p_row = target_probs[rows, accept_len].float().clamp(min=0.0)
    q_row = q[rows, accept_len.clamp(max=width - 2)].float()
    residual = to_fixed_point((p_row - q_row).clamp(min=0.0))
    use_residual = rejected & (residual.sum(dim=-1) > MIN_RESIDUAL_MASS)
    weights = torch.where(use_residual.view(-1, 1), residual, to_fixed_point(p_row))
    return accept_len, sample_fixed_point(weights, bonus_uniforms)


def apply_cap(
    verify_ids: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor, cap_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cap-accept mode: n <- min(n, cap). A trimmed row's bonus is the draft at the cap row, which
    the chain accepted and is therefore itself an exact target sample (greedy: equals t_cap).

    Returns (n [B], bonus [B], cap_trim [B])."""
    capped = torch.minimum(accept_len, cap_lens.to(torch.int64).clamp(min=0))
    trimmed = capped < accept_len
    at_cap = verify_ids.gather(1, (capped + 1).clamp(max=verify_ids.shape[1] - 1).view(-1, 1)).view(
        -1
    )
    return capped, torch.where(trimmed, at_cap, bonus), accept_len - capped


def finalize_accept(
    verify_ids: torch.Tensor,
    verify_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    accept_len: torch.Tensor,
    bonus: torch.Tensor,
    cap_trim: torch.Tensor | None = None,
) -> AcceptOutput:
    """Commit lengths, out tokens, next anchors and new sequence lengths; rows with
    verify_lens == 0 are padding and commit nothing."""
    batch, width = verify_ids.shape
    real = verify_lens > 0
    accept_len = torch.where(real, accept_len, torch.zeros_like(accept_len))
    commit_len = torch.where(real, accept_len + 1, torch.zeros_like(accept_len))
    cols = torch.arange(width, device=verify_ids.device).view(1, width)
    fill = torch.full((batch, 1), -1, dtype=verify_ids.dtype, device=verify_ids.device)
    drafts = torch.cat([verify_ids[:, 1:], fill], dim=1)  # column j holds d_{j+1}
    n = accept_len.view(-1, 1)
    out = torch.where(cols < n, drafts, torch.full_like(drafts, -1))
    out = torch.where((cols == n) & real.view(-1, 1), bonus.view(-1, 1).to(out.dtype), out)
    if cap_trim is None:
        cap_trim = torch.zeros_like(accept_len)
    return AcceptOutput(
        accept_len=accept_len,
        commit_len=commit_len,
        out_tokens=out,
        next_anchor=torch.where(real, bonus, verify_ids[:, 0]),
        new_seq_lens=seq_lens + commit_len.to(seq_lens.dtype),
        bonus=bonus,
        cap_trim=torch.where(real, cap_trim, torch.zeros_like(cap_trim)),
    )


def accept_step(
    verify_ids: torch.Tensor,
    verify_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    target_logits: torch.Tensor,
    greedy: torch.Tensor,
    target_probs: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    coins: torch.Tensor | None = None,
    bonus_uniforms: torch.Tensor | None = None,
    cap_lens: torch.Tensor | None = None,
    forced_accept: torch.Tensor | None = None,
) -> AcceptOutput:
    """Full acceptance for a (possibly mixed) batch, selected per row by ``greedy`` [B] bool.

    Args:
        verify_ids: [B, W] int64 anchor + drafts; verify_lens: [B] int64 in [0, W];
        seq_lens: [B] int64 committed lengths before this step;
        target_logits: [B, W, V] verify logits (greedy rows use their argmax chain).
        target_probs / draft_probs / coins / bonus_uniforms: see ``sampled_accept``; pass None
            for all of them when the host knows every row is greedy.
        cap_lens: optional [B] cap-accept limits l_r on accepted drafts.
        forced_accept: optional [B] int64, simulated acceptance (benchmarks only): every row
            accepts min(max(forced, 0), verify_len - 1) drafts whatever the target says; its bonus
            is the target argmax at that row; no other rule applies.
    """
    target_argmax = torch.argmax(target_logits, dim=-1)
    if forced_accept is not None:
        n = torch.minimum(forced_accept.clamp(min=0), (verify_lens - 1).clamp(min=0))
        bonus = target_argmax.gather(1, n[:, None]).squeeze(1)
        return finalize_accept(verify_ids, verify_lens, seq_lens, n, bonus)
    accept_len, bonus = greedy_accept(verify_ids, verify_lens, target_argmax)
    if target_probs is not None:
        if draft_probs is None or coins is None or bonus_uniforms is None:
            raise ValueError("sampled acceptance needs draft_probs, coins and bonus_uniforms")
        s_len, s_bonus = sampled_accept(
            verify_ids, verify_lens, target_probs, draft_probs, coins, bonus_uniforms
        )
        accept_len = torch.where(greedy, accept_len, s_len)
        bonus = torch.where(greedy, bonus, s_bonus)
    cap_trim = None
    if cap_lens is not None:
        accept_len, bonus, cap_trim = apply_cap(verify_ids, accept_len, bonus, cap_lens)
    return finalize_accept(verify_ids, verify_lens, seq_lens, accept_len, bonus, cap_trim)
