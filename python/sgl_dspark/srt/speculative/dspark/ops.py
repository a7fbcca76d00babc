"""The "spec" kernel family's draft-side ops: draft input staging and the all-greedy Markov loop
(acceptance is `accept.create_accept_fn`). Each `create_*` is called once, when the executor is
built; both implementations of each op take the same arguments and return the same values.

* draft inputs: torch = a few indexing ops; triton = two `prepare_draft_inputs` launches (the
  draft block rows at [s, s + gamma), then the context window at [s - window, s), planned as a
  "verify window" that starts at s - window). Context slots of positions < 0 differ (the kernel
  writes the dummy slot 0, torch reads column 0 of the request's row) but those rows are masked
  by `ctx_valid`, so the draft's output is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.speculative.dspark.sampling import MarkovSampleOutput, markov_sample


class DraftBlockInputs(NamedTuple):
    input_ids: torch.Tensor  # [B, gamma] int64: anchor, then the mask token
    positions: torch.Tensor  # [B, gamma] int64: s .. s + gamma - 1
    ctx_slots: torch.Tensor  # [B, window] int64: KV slots of positions s - window .. s - 1
    ctx_valid: torch.Tensor  # [B, window] bool: position >= 0


# (anchors [B], seq_lens [B], req pool rows [B], req_to_token, gamma, window, mask token id)
DraftInputsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int], DraftBlockInputs
]


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
    """The all-greedy Markov draft loop of the "spec" family. torch: `markov_sample` (several
    small kernels per draft position). triton: `kernels/spec/markov.py::markov_greedy`, one launch
    per position plus one (its W2 dot product is summed in another order, so step logits agree to
    rounding; drafts are the argmax of the kernel's own step logits, ties to the first index as
    torch.argmax)."""
    if kernels.of("spec") == "torch":

        def greedy_torch(
            base_logits: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, anchors: torch.Tensor
        ) -> MarkovSampleOutput:
            ones = torch.ones(anchors.shape[0], dtype=torch.bool, device=anchors.device)
            return markov_sample(base_logits, w1, w2, anchors, ones.float(), ones)

        return greedy_torch
    from sgl_dspark.kernels.spec.markov import markov_greedy

    def greedy_triton(
        base_logits: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, anchors: torch.Tensor
    ) -> MarkovSampleOutput:
        out = markov_greedy(base_logits, w1, w2, anchors)
        return MarkovSampleOutput(out.drafts, out.step_logits, out.embeds)

    return greedy_triton
