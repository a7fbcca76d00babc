"""Acceptance of a verified DSpark window, on the device and without host syncs: the "spec"
family's dispatch point (`create_accept_fn`, bound once when the executor is built).

Per request r: `verify_ids[r] = [a_r, d_1, ..., d_{W-1}]` and a verify length `verify_lens[r]`
in [1, W] (anchor + drafts actually verified; 0 marks a padding row). Target row j scores draft
d_{j+1}; the row at the accept length supplies the bonus token. Greedy rows accept the longest
prefix equal to the target's argmax chain; sampled rows run speculative rejection sampling with
the caller's uniforms, drawing the bonus / correction token by the fixed-point inverse CDF, so the
same uniforms give the same tokens on every backend. The rules are `spec_accept_ref`'s, which is
the torch backend itself; the triton backend launches `spec_accept` with the same arguments.
Cap-accept mode (the async confidence policy) and the final bookkeeping are host-free torch shared
by both (`apply_cap`, `finalize_accept`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from sgl_dspark.srt.core.kernel_choice import KernelChoice


class AcceptOutput(NamedTuple):
    accept_len: torch.Tensor  # [B] int64, n: accepted drafts (0 for padding rows)
    commit_len: torch.Tensor  # [B] int64, n + 1 (0 for padding rows)
    out_tokens: torch.Tensor  # [B, W] int64, d_1..d_n, bonus at column n, -1 after
    next_anchor: torch.Tensor  # [B] int64, bonus (padding rows keep their anchor)
    new_seq_lens: torch.Tensor  # [B] int64, seq_lens + commit_len
    bonus: torch.Tensor  # [B] int64
    cap_trim: torch.Tensor  # [B] int64, drafts removed by the cap (0 without a cap)


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


class AcceptFn(Protocol):
    def __call__(
        self,
        verify_ids: torch.Tensor,
        verify_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        target_logits: torch.Tensor | None,
        greedy: torch.Tensor,
        target_probs: torch.Tensor | None = None,
        draft_probs: torch.Tensor | None = None,
        coins: torch.Tensor | None = None,
        bonus_uniforms: torch.Tensor | None = None,
        cap_lens: torch.Tensor | None = None,
        forced_accept: torch.Tensor | None = None,
        target_ids: torch.Tensor | None = None,
    ) -> AcceptOutput:
        """Acceptance for a (possibly mixed) batch, selected per row by `greedy` [B] bool.

        Args:
            verify_ids: [B, W] int64 anchor + drafts; verify_lens: [B] int64 in [0, W];
            seq_lens: [B] int64 committed lengths before this step;
            target_logits: [B, W, V] verify logits (greedy rows use their argmax chain), or
                None with `target_ids`.
            target_probs: P [B, W, V] (row j: the target distribution after verify row j);
            draft_probs: Q [B, >= W-1, V] (Q[:, j-1] generated d_j; one-hot for argmax drafts);
            coins: [B, >= W-1] uniforms (d_j accepted iff coins[:, j-1] * Q_j(d_j) < P_j(d_j));
            bonus_uniforms: [B]. Pass None for all four when every row is greedy.
            cap_lens: optional [B] cap-accept limits on accepted drafts.
            forced_accept: optional [B] int64, simulated acceptance (benchmarks only): every row
                accepts min(max(forced, 0), verify_len - 1) drafts whatever the target says; its
                bonus is the target argmax at that row.
            target_ids: optional [B, W] int64, the argmax of every verify row computed by the
                caller (vocab-parallel logits: `LogitsReader.greedy`); replaces the argmax of
                `target_logits`.
        """
        ...


def create_accept_fn(kernels: KernelChoice) -> AcceptFn:
    """The acceptance of the "spec" family: torch = `spec_accept_ref`, triton = `spec_accept`
    (with `vocab_argmax` for the target's argmax chain)."""
    impl: Callable[..., object]
    argmax: Callable[[torch.Tensor], torch.Tensor]
    if kernels.of("spec") == "torch":
        from sgl_dspark.kernels.spec.reference import spec_accept_ref

        impl, argmax = spec_accept_ref, lambda logits: torch.argmax(logits, dim=-1)
    else:
        # Imported only when chosen: the torch path never loads Triton.
        from sgl_dspark.kernels.sampling.vocab_argmax import vocab_argmax
        from sgl_dspark.kernels.spec.accept import spec_accept

        impl, argmax = spec_accept, vocab_argmax

    def accept(
        verify_ids: torch.Tensor,
        verify_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        target_logits: torch.Tensor | None,
        greedy: torch.Tensor,
        target_probs: torch.Tensor | None = None,
        draft_probs: torch.Tensor | None = None,
        coins: torch.Tensor | None = None,
        bonus_uniforms: torch.Tensor | None = None,
        cap_lens: torch.Tensor | None = None,
        forced_accept: torch.Tensor | None = None,
        target_ids: torch.Tensor | None = None,
    ) -> AcceptOutput:
        batch, width = verify_ids.shape
        verify_ids = verify_ids.contiguous()
        lens, seqs = verify_lens.contiguous(), seq_lens.contiguous()
        if target_ids is None:
            if target_logits is None:
                raise ValueError("acceptance needs target_logits or target_ids")
            rows = target_logits.reshape(batch * width, target_logits.shape[-1])
            target_ids = argmax(rows).view(batch, width)
        target_ids = target_ids.contiguous()
        sampled: dict[str, Any] = {}
        if forced_accept is not None:  # simulation: the greedy rule with forced counts
            sampled = {"forced_accept": forced_accept.contiguous()}
        elif target_probs is not None:
            if draft_probs is None or coins is None or bonus_uniforms is None:
                raise ValueError("sampled acceptance needs draft_probs, coins and bonus_uniforms")
            sampled = {
                "target_probs": target_probs.float().contiguous(),
                "draft_probs": draft_probs[:, : width - 1].float().contiguous(),
                "accept_uniforms": coins[:, : width - 1].float().contiguous(),
                "sample_uniforms": bonus_uniforms.float().contiguous(),
                "greedy_mask": greedy.contiguous(),
            }
        out: Any = impl(verify_ids, lens, seqs, target_ids=target_ids, **sampled)
        accept_len = out.accept_lens.to(torch.int64)
        bonus = out.next_anchors
        if cap_lens is not None and forced_accept is None:
            # Padding rows: the bonus is the anchor; finalize_accept ignores it there.
            capped, bonus, cap_trim = apply_cap(verify_ids, accept_len, bonus, cap_lens)
            return finalize_accept(verify_ids, verify_lens, seq_lens, capped, bonus, cap_trim)
        return AcceptOutput(
            accept_len=accept_len,
            commit_len=out.commit_lens.to(torch.int64),
            out_tokens=out.out_tokens,
            next_anchor=bonus,
            new_seq_lens=out.new_seq_lens,
            bonus=bonus,
            cap_trim=torch.zeros_like(accept_len),
        )

    accept.__name__ = f"accept_{kernels.of('spec')}"
    return accept
