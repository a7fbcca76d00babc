"""Scheduler-side request state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from sgl_dspark.srt.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    detok: IncrementalDetokenizer | None = None
    slot: int = -1  # request slot in ReqToTokenPool; -1 = not admitted
    kv_len: int = 0  # tokens whose KV state is committed
    reserved_tokens: int = 0  # KV budget promised at admission
    finish_reason: dict[str, Any] | None = None
    spec_verify_ct: int = 0  # DSpark verify steps this request took part in
    spec_committed: int = 0  # tokens committed by those steps (accepted drafts + bonus)
    error: str | None = None  # why the request failed (set with an abort finish reason)
    queued_at: float = 0.0  # when it was queued (monotonic seconds; for the queue timeout)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_done(self) -> bool:
        return self.kv_len >= len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def next_input(self, budget: int) -> list[int]:
        """Tokens to feed next: a prefill chunk of at most `budget`, or the last sampled token."""
        if not self.prefill_done:
            return self.prompt_ids[self.kv_len : self.kv_len + budget]
        return [self.output_ids[-1]]
