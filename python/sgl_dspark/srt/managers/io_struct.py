"""Typed records exchanged between the HTTP layer and the scheduler thread.

HTTP -> scheduler (through `SchedulerLoop.submit_group` / `abort`): `GenerateReqInput`s (the
sub-requests of one HTTP request, queued together or refused together), `AbortReq`.
Scheduler -> HTTP (onto the asyncio queue given at submit), per request, in this order:
exactly one of `ReqAccepted` / `ReqFailed`; after `ReqAccepted`, `GenerateOutput` records (the
last one has `finish_reason` set) or a `ReqFailed` (an internal error while it ran, a queue
timeout, shutdown). An abort ends a request with a final `GenerateOutput` whose finish_reason is
`{"type": "abort"}`. When a group is refused, only the sub-request that caused it gets a
`ReqFailed` (the HTTP side stops at the first one and aborts the rest, a no-op).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sgl_dspark.srt.sampling.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerateReqInput:
    """One generation request. Exactly one of `text`, `input_ids`, `messages` is set; the
    scheduler thread tokenizes (`messages` through the tokenizer's chat template).

    `return_logprob` adds per-token logprobs and token strings to the outputs;
    `return_prompt_text` asks for the decoded prompt in `ReqAccepted` (OpenAI `echo`).
    `fill_context` replaces `sampling_params.max_new_tokens` by what the context length leaves
    after the prompt (OpenAI chat without `max_tokens`).
    """

    rid: str
    sampling_params: SamplingParams
    text: str | None = None
    input_ids: Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    return_logprob: bool = False
    # SGLang's logprob options (with return_logprob): prompt logprobs from this prompt index
    # (-1: none), the top-N tokens per position, the logprobs of these ids.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_prompt_text: bool = False
    fill_context: bool = False
    # Extra arguments of the chat template (`tools`, `thinking`, ...), with `messages` only.
    chat_template_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.text, self.input_ids, self.messages)]
        assert sum(given) == 1, f"exactly one prompt form must be set, got {given}"


@dataclass(frozen=True, slots=True)
class AbortReq:
    """Stop requests (client gone or cancelled); their KV pages return to the pool. With
    `notify`, each waiter gets a final output (finish_reason abort)."""

    rids: tuple[str, ...]
    notify: bool = True


@dataclass(frozen=True, slots=True)
class ReqAccepted:
    """The request passed validation and is queued. `prompt_text` only when asked for."""

    rid: str
    prompt_tokens: int
    prompt_text: str | None = None


@dataclass(frozen=True, slots=True)
class ReqFailed:
    """The request will produce nothing more: `status` 400 (it can never run, message says why),
    500 (an internal error while it ran) or 503 (it cannot be scheduled now: queue full, queue
    timeout, shutting down; `retry_after` seconds is a hint for the client)."""

    rid: str
    status: int
    message: str
    param: str | None = None
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class PromptLogprobsOut:
    """Prompt logprobs of a request, sent once when its prompt is done: the prompt tokens from
    `logprob_start_len` and their logprobs (the first None, as in SGLang), with the top-N rows
    and the token-id values when asked (same length, first None)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top: tuple[tuple[tuple[int, float], ...] | None, ...] = ()
    token_ids_values: tuple[tuple[float, ...] | None, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerateOutput:
    """Newly produced output of one request.

    `text` is the new safe text (stop strings trimmed, incomplete UTF-8 held back); `token_ids`,
    `logprobs` and `token_texts` are the new tokens (the last two only with `return_logprob`).
    `completion_tokens` counts every output token so far. `finish_reason` is SGLang's dict
    (`{"type": "length"|"stop"|"abort", ...}`) on the final record, else None.
    """

    rid: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    token_texts: tuple[str, ...]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None = None
    # DSpark only: verify steps so far and tokens they committed (SGLang's meta_info keys are
    # derived from these: spec_verify_ct and spec_accept_length = committed / verify steps).
    spec_verify_ct: int | None = None
    spec_committed: int | None = None
    # With return_logprob and the request's top_logprobs_num / token_ids_logprob: per new token
    # its ((id, logprob), ...) best first and the values at those ids; the prompt's logprobs
    # once; `id_texts` the texts of the ids these name (besides `token_texts`).
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    token_ids_logprobs: tuple[tuple[float, ...], ...] = ()
    prompt_logprobs: PromptLogprobsOut | None = None
    id_texts: Mapping[int, str] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


SchedulerOutput = ReqAccepted | ReqFailed | GenerateOutput


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Snapshot of scheduler state, published by the scheduler thread after each iteration."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_free_pages: int
    kv_total_pages: int  # pages a request can ever hold (the dummy page excluded)
    page_size: int
    free_req_slots: int
    total_steps: int
    # DSpark acceptance since start (None without speculative decoding or before its first step).
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None
    spec_acceptance_by_position: tuple[float | None, ...] = ()

    @property
    def token_usage(self) -> float:
        if self.kv_total_pages == 0:
            return 0.0
        return 1.0 - self.kv_free_pages / self.kv_total_pages
