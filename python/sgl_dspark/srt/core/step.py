"""The step contract between the host-only scheduler and the executors that run steps.

The scheduler plans a `StepWork` (which requests take part, which prompt chunk each prefilling
request feeds), hands it to an executor's `launch`, and later applies the `ReqUpdate`s that the
returned `InflightStep` yields from `wait()`. A `ReqUpdate` is the only way a step changes a
request: the scheduler applies it in one place (`Scheduler._apply`), so request state never moves
inside an executor.

Overlap: when the scheduler's next work can run on device state that the step in flight leaves
behind (`BaseStepExecutor.can_chain`), it launches the next step first, passing the step in flight
as `prev`, and only then waits for `prev`. The executor then reads what it needs from `prev`
(device tensors of sampled tokens, chained DSpark state) instead of from the requests, whose
host state lags by `prev`'s tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgl_dspark.srt.core.req import Req


TopLogprobs = tuple[tuple[int, float], ...]  # ((token id, logprob), ...), most probable first


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens scored by a prefill chunk: prompt indices `start`, `start + 1`,
    ... (each under the logits of the position before it); `top` / `token_ids` only when the
    request asks for them (else empty)."""

    start: int
    logprobs: tuple[float, ...]
    top: tuple[TopLogprobs, ...] = ()
    token_ids: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class ReqUpdate:
    """What one step did for one request.

    Attributes:
        req: the request.
        kv_committed: positions whose KV state the step committed (the prompt chunk's length, 1
            for a decode token, the committed tokens of a DSpark verify).
        tokens: output tokens the step produced, in order (empty for a prompt chunk that ends
            before the prompt does).
        logprobs: the target model's logprob of each token in `tokens` (under the distribution
            the token was sampled from before top-k/top-p/min-p: `srt/layers/logprobs.py`).
        top_logprobs, token_ids_logprobs: per token of `tokens`, when the request asks for them
            (`Req.top_logprobs_num`, `Req.token_ids_logprob`), else empty.
        prompt_logprobs: prompt tokens this step scored (a prefill chunk of a request that asks
            for prompt logprobs), else None.
        speculative: the tokens come from one DSpark verify step (counted in the request's
            `spec_verify_ct` / `spec_committed`).
    """

    req: Req
    kv_committed: int
    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    speculative: bool = False
    top_logprobs: tuple[TopLogprobs, ...] = ()
    token_ids_logprobs: tuple[tuple[float, ...], ...] = ()
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True, slots=True)
class StepWork:
    """One step's requests in batch order: prompt chunks first, then decoding requests.

    `prefill[i] = (req, chunk)`: `chunk` is the next slice of the request's prompt, starting at
    its committed length. `decode`: requests whose prompt is fully in the KV state; each feeds its
    last output token (or, with DSpark, a verify window that starts with it).
    """

    prefill: tuple[tuple[Req, tuple[int, ...]], ...] = ()
    decode: tuple[Req, ...] = ()

    @property
    def reqs(self) -> tuple[Req, ...]:
        return tuple(r for r, _ in self.prefill) + self.decode

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class InflightStep(ABC):
    """A launched step. `wait()` blocks until its results are on the host and returns one
    `ReqUpdate` per request that got state from the step; call it once."""

    # The executor-defined kind of the step ("decode", "spec", ...): chaining needs a match.
    kind: str = "done"
    # Whether a later step may chain onto this one while it runs (see the module doc).
    chainable: bool = False

    @property
    @abstractmethod
    def reqs(self) -> tuple[Req, ...]:
        """The requests of the step, in batch order."""

    @abstractmethod
    def wait(self) -> list[ReqUpdate]:
        """The step's updates, in batch order."""


class CompletedStep(InflightStep):
    """A step whose results are already on the host (eager steps, prefill forwards)."""

    def __init__(self, reqs: tuple[Req, ...], updates: list[ReqUpdate]) -> None:
        self._reqs = reqs
        self._updates = updates

    @property
    def reqs(self) -> tuple[Req, ...]:
        return self._reqs

    def wait(self) -> list[ReqUpdate]:
        return self._updates


class BaseStepExecutor(ABC):
    """Runs the steps the scheduler plans (model forwards, sampling, speculative decoding)."""

    @property
    @abstractmethod
    def step_window(self) -> int:
        """Most KV positions past a request's committed length that one step may write (1 for
        plain decoding, the widest verify window with DSpark); admission reserves them."""

    @abstractmethod
    def launch(self, work: StepWork, prev: InflightStep | None) -> InflightStep:
        """Start `work` on the device. `prev`: the step still in flight that `work` chains onto
        (only when `can_chain(work, prev)` was True), else None; the scheduler waits for `prev`
        after this returns."""

    @abstractmethod
    def can_chain(self, work: StepWork, prev: InflightStep) -> bool:
        """Whether `work` can launch before `prev`'s results are read."""

    def refuses(self, req: Req) -> str | None:
        """Why this executor cannot run `req` (checked before it is queued), or None."""
        return None

    def on_admit(self, req: Req) -> None:  # noqa: B027 - optional hook
        """Called when `req` gets its request slot."""

    def on_release(self, req: Req) -> None:  # noqa: B027 - optional hook
        """Called before `req`'s slot and pages are freed (finished or aborted)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush whatever the executor records (called once, at shutdown)."""
