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
    # With return_logprob (SGLang's names): prompt logprobs from this prompt index (-1 or the
    # prompt's length: none),
    # the N most probable tokens per position, and the logprobs of these token ids.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # Per output token, with top_logprobs_num / token_ids_logprob: ((id, logprob), ...) best
    # first, and the logprob of each id of token_ids_logprob.
    output_top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    output_token_ids_logprobs: list[tuple[float, ...]] = field(default_factory=list)
    # Prompt logprobs, from prompt index max(logprob_start_len, 0) on; the prompt's first token
    # has none (None), as in SGLang.
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[tuple[tuple[int, float], ...] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[tuple[float, ...] | None] = field(default_factory=list)
    # The grammar state after the output so far (`srt/constrained`), when the request has one.
    grammar: Any = None
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
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.prompt_ids)

    @property
    def logprob_extras(self) -> bool:
        """Whether a step computes more than the chosen tokens' logprobs for this request."""
        return self.return_logprob and (
            self.top_logprobs_num > 0 or self.token_ids_logprob is not None
        )

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def next_input(self, budget: int) -> list[int]:
        """Tokens to feed next: a prefill chunk of at most `budget`, or the last sampled token."""
        if not self.prefill_done:
            return self.prompt_ids[self.kv_len : self.kv_len + budget]
        return [self.output_ids[-1]]
