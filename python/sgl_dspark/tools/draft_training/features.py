"""The draft's training inputs from the target, taken exactly as the serving engine takes them.

Sequences (prompt + the target's continuation) run through the serving `ModelRunner.forward` as
one prefill batch, with a `TapConsumer` on the draft's tap layers: the same forward and the same
consumer mechanism that writes the draft's context KV while serving, reading the features with
the serving worker's own `context_features`. The same forward's logits give the target's
next-token distribution at every position (the distillation target).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, TapConsumer
from sgl_dspark.srt.speculative.dspark.worker import context_features


@dataclass
class SequenceTaps:
    """One sequence's target-side training inputs (on the CPU, fp32 features as tapped)."""

    token_ids: torch.Tensor  # [L] int64
    features: torch.Tensor  # [L, n_f * D]: position t's context feature
    # the target's log-probabilities of the token at t + 1, at every position t, restricted to
    # its `top` most likely tokens (all of them when top >= vocab)
    top_logprobs: torch.Tensor  # [L, top] fp32
    top_ids: torch.Tensor  # [L, top] int64


class TargetTaps:
    """Runs the target's prefill forward on whole sequences with the draft's tap consumer."""

    def __init__(self, runner: ModelRunner, tap_layers: tuple[int, ...], top: int) -> None:
        self.runner = runner
        self.tap_layers = tuple(tap_layers)
        self.top = min(top, runner.model_cfg.vocab_size) if top > 0 else 0
        self._captured: list[torch.Tensor] = []
        self.consumer = TapConsumer(self.tap_layers, self._record)

    def _record(self, batch: ForwardBatch, taps: dict[int, torch.Tensor]) -> None:
        self._captured.append(context_features(taps, self.tap_layers).clone())

    def features_and_logits(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat features `[T, n_f * D]` (as the consumer received them) and fp32 logits `[T, V]`
        of one prefill batch of `sequences` (rows in order, prefix 0)."""
        pool = self.runner.req_pool
        slots = [pool.alloc_slot() for _ in sequences]
        try:
            for slot, seq in zip(slots, sequences):
                pool.reserve(slot, len(seq))
            batch = ForwardBatch.build(
                ForwardMode.EXTEND,
                sequences,
                [0] * len(sequences),
                slots,
                pool.req_to_token,
                logits_rows="all",
            )
            self._captured.clear()
            out = self.runner.forward(batch, consumer=self.consumer)
            assert len(self._captured) == 1, "the tap consumer runs once per forward"
            return self._captured.pop(), out.logits
        finally:
            for slot in slots:
                pool.free_slot(slot)

    def extract(self, sequences: list[list[int]], max_batch_tokens: int) -> list[SequenceTaps]:
        """Per sequence its taps, in prefill batches of at most `max_batch_tokens` tokens and
        no more sequences than the runner has free request slots."""
        max_seqs = self.runner.req_pool.num_free_slots
        out: list[SequenceTaps] = []
        group: list[list[int]] = []
        tokens = 0
        for seq in sequences:
            if group and (len(group) >= max_seqs or tokens + len(seq) > max_batch_tokens):
                out.extend(self._split(group))
                group, tokens = [], 0
            group.append(seq)
            tokens += len(seq)
        if group:
            out.extend(self._split(group))
        return out

    def _split(self, group: list[list[int]]) -> list[SequenceTaps]:
        feats, logits = self.features_and_logits(group)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if self.top:
            top_lp, top_ids = torch.topk(logprobs, self.top, dim=-1)
        else:
            top_lp = logprobs
            top_ids = torch.arange(logprobs.shape[1], device=logprobs.device).expand_as(logprobs)
        res, start = [], 0
        for seq in group:
            end = start + len(seq)
            res.append(
                SequenceTaps(
                    token_ids=torch.tensor(seq, dtype=torch.int64),
                    features=feats[start:end].float().cpu(),
                    top_logprobs=top_lp[start:end].cpu(),
                    top_ids=top_ids[start:end].cpu(),
                )
            )
            start = end
        return res
