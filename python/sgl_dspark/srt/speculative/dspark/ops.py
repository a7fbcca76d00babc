"""The "spec" kernel family of the DSpark step: acceptance and draft input staging.

`create_accept_fn` / `create_draft_inputs_fn` are called once, when the worker is built
(style R11); both implementations of each op take the same arguments and return the same values:

* acceptance: torch = `accept.accept_step`; triton = K14 `vocab_argmax` for the target argmax
  chain + K15 `spec_accept` (greedy, sampled and mixed rows in one launch). Cap-accept mode
  trims the kernel's result with `accept.apply_cap`. Both draw the bonus/correction token with
  the same fixed-point inverse CDF, so identical uniforms give identical tokens (X0).
* draft inputs: torch = a few indexing ops; triton = two K16 `prepare_draft_inputs` launches
  (the draft block rows at [s, s + gamma), then the context window at [s - window, s), planned
  as a "verify window" that starts at s - window). Context slots of positions < 0 differ
  (the kernel writes the dummy slot 0, torch reads column 0 of the request's row) but those
  rows are masked by `ctx_valid`, so the draft's output is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.speculative.dspark.accept import (
    AcceptOutput,
    accept_step,
    apply_cap,
    finalize_accept,
)
from sgl_dspark.srt.speculative.dspark.sampling import MarkovSampleOutput, markov_sample


class AcceptFn(Protocol):
    def __call__(
        self,
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
    ) -> AcceptOutput: ...


class DraftBlockInputs(NamedTuple):
    input_ids: torch.Tensor  # [B, gamma] int64: anchor, then the mask token
    positions: torch.Tensor  # [B, gamma] int64: s .. s + gamma - 1
    ctx_slots: torch.Tensor  # [B, window] int64: KV slots of positions s - window .. s - 1
    ctx_valid: torch.Tensor  # [B, window] bool: position >= 0


# (anchors [B], seq_lens [B], req pool rows [B], req_to_token, gamma, window, mask token id)
DraftInputsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int], DraftBlockInputs
]


def create_accept_fn(kernels: KernelChoice) -> AcceptFn:
    """The acceptance implementation of the "spec" family (signature of `accept.accept_step`)."""
    if kernels.of("spec") == "torch":
        return accept_step
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.sampling.vocab_argmax import vocab_argmax
    from sgl_dspark.kernels.spec.accept import spec_accept

    def accept_triton(
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
        batch, width, vocab = target_logits.shape
        verify_ids = verify_ids.contiguous()
        target_ids = vocab_argmax(target_logits.reshape(batch * width, vocab)).view(batch, width)
        if forced_accept is not None:  # simulation: the greedy launch with forced counts
            out = spec_accept(
                verify_ids,
                verify_lens.contiguous(),
                seq_lens.contiguous(),
                target_ids=target_ids,
                forced_accept=forced_accept.contiguous(),
            )
        elif target_probs is None:
            out = spec_accept(
                verify_ids, verify_lens.contiguous(), seq_lens.contiguous(), target_ids=target_ids
            )
        else:
            if draft_probs is None or coins is None or bonus_uniforms is None:
                raise ValueError("sampled acceptance needs draft_probs, coins and bonus_uniforms")
            # accept_step allows Q / coins wider than W - 1; the kernel takes exactly W - 1.
            out = spec_accept(
                verify_ids,
                verify_lens.contiguous(),
                seq_lens.contiguous(),
                target_ids=target_ids,
                target_probs=target_probs.float().contiguous(),
                draft_probs=draft_probs[:, : width - 1].float().contiguous(),
                accept_uniforms=coins[:, : width - 1].float().contiguous(),
                sample_uniforms=bonus_uniforms.float().contiguous(),
                greedy_mask=greedy.contiguous(),
            )
        accept_len = out.accept_lens.to(torch.int64)
        if cap_lens is not None and forced_accept is None:
            # Padding rows: the kernel's bonus is the anchor; finalize_accept ignores it there.
            capped, bonus, cap_trim = apply_cap(verify_ids, accept_len, out.next_anchors, cap_lens)
            return finalize_accept(verify_ids, verify_lens, seq_lens, capped, bonus, cap_trim)
        return AcceptOutput(
            accept_len=accept_len,
            commit_len=out.commit_lens.to(torch.int64),
            out_tokens=out.out_tokens,
            next_anchor=out.next_anchors,
            new_seq_lens=out.new_seq_lens,
            bonus=out.next_anchors,
            cap_trim=torch.zeros_like(accept_len),
        )

    return accept_triton


def draft_inputs_torch(
    anchors: torch.Tensor,
    seq_lens: torch.Tensor,
    pool_rows: torch.Tensor,
    req_to_token: torch.Tensor,
    gamma: int,
    window: int,
    mask_token_id: int,
) -> DraftBlockInputs:
    dev = anchors.device
    ids = torch.full((anchors.shape[0], gamma), mask_token_id, dtype=torch.int64, device=dev)
    ids[:, 0] = anchors
    pos = seq_lens[:, None] + torch.arange(gamma, device=dev)[None, :]
    ctx_pos = seq_lens[:, None] - window + torch.arange(window, device=dev)[None, :]
    ctx_slots = req_to_token[pool_rows[:, None], ctx_pos.clamp(min=0)]
    return DraftBlockInputs(ids, pos, ctx_slots, ctx_pos >= 0)


def create_draft_inputs_fn(kernels: KernelChoice) -> DraftInputsFn:
    """The draft input staging of the "spec" family (see the module doc)."""
    if kernels.of("spec") == "torch":
        return draft_inputs_torch
    from sgl_dspark.kernels.spec.draft_inputs import prepare_draft_inputs

    def draft_inputs_triton(
        anchors: torch.Tensor,
        seq_lens: torch.Tensor,
        pool_rows: torch.Tensor,
        req_to_token: torch.Tensor,
        gamma: int,
        window: int,
        mask_token_id: int,
    ) -> DraftBlockInputs:
        n_valid = torch.full((1,), anchors.shape[0], dtype=torch.int64, device=anchors.device)
        block = prepare_draft_inputs(
            anchors,
            seq_lens,
            pool_rows,
            req_to_token,
            n_valid,
            draft_len=gamma,
            verify_width=1,
            mask_token_id=mask_token_id,
        )
        ctx = prepare_draft_inputs(
            anchors,
            seq_lens - window,
            pool_rows,
            req_to_token,
            n_valid,
            draft_len=1,
            verify_width=window,
            mask_token_id=mask_token_id,
        )
        return DraftBlockInputs(
            block.input_ids, block.draft_positions, ctx.verify_slots, ctx.verify_positions >= 0
        )

    return draft_inputs_triton


# (base_logits [B, gamma, V], w1 [V, r], w2 [V, r], anchors [B]) -> MarkovSampleOutput
MarkovGreedyFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], MarkovSampleOutput
]


def create_markov_greedy_fn(kernels: KernelChoice) -> MarkovGreedyFn:
    """The all-greedy Markov draft loop of the "spec" family. torch: `markov_sample` (about 8
    small kernels per draft position). triton: `kernels/spec/markov.py::markov_greedy`, one
    launch per position plus one (X2: the W2 dot product is summed in another order; drafts are the argmax
    of the kernel's own step logits, ties to the first index as torch.argmax)."""
    if kernels.of("spec") == "torch":

        def greedy_torch(
            base_logits: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, anchors: torch.Tensor
        ) -> MarkovSampleOutput:
            ones = torch.ones(anchors.shape[0], dtype=torch.bool, device=anchors.device)
            return markov_sample(base_logits, w1, w2, anchors, ones.float(), ones, all_greedy=True)

        return greedy_torch
    from sgl_dspark.kernels.spec.markov import markov_greedy

    def greedy_triton(
        base_logits: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, anchors: torch.Tensor
    ) -> MarkovSampleOutput:
        out = markov_greedy(base_logits, w1, w2, anchors)
        return MarkovSampleOutput(out.drafts, out.step_logits, out.embeds)

    return greedy_triton
