"""Continuous-batching scheduler: host-only policy (admission, chunked prefill, overlap, aborts,
stop conditions, KV accounting) over an executor that runs the steps (`srt/core/step.py`).

Admission reserves the KV a request can ever need (prompt + max_new_tokens + the executor's step
window) and maps its pages at once, so a running request never runs out of pages and nothing
needs preempting; a request that could never fit is rejected before it is queued. Requests are
served first come, first served: a request that does not fit yet holds back the ones behind it.
Every queue operation is O(1) per request (dicts keyed by rid in arrival order).

Failure isolation. Validation at admission (`SamplingParams`, `validate`) keeps every value a
step sees inside the ranges the sampler and the acceptance kernels are total over, so a step does
not fail because of what one request carries, and the step path itself checks nothing (no host
syncs). Two kinds of failure remain, and each ends only the request it can be attributed to:
- applying one request's update on the host (stop strings, detokenization): caught per update,
  that request fails;
- the step itself raising (a device error, a bug at one batch shape): the results in flight are
  dropped (request state only moves through `_apply`, so nothing is half-applied) and every
  request of the step is retried alone, from its host state, in a step of its own; a request that
  fails alone fails, the others continue. Greedy and seeded requests redo exactly the tokens
  they would have produced (counter-based uniforms). Retrying costs one step per request, paid
  only after a failure.
A failed request gets `error` and an abort finish reason and is released like an abort; it is
reported in `StepResult.failed`.

This module imports no torch: it sees the device only through the executor's step contract.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from sgl_dspark.srt.core.step import StepWork

if TYPE_CHECKING:
    from sgl_dspark.srt.core.req import Req
    from sgl_dspark.srt.core.step import BaseStepExecutor, InflightStep, ReqUpdate
    from sgl_dspark.srt.mem_cache.allocator import PagedTokenAllocator, ReqToTokenPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    chunked_prefill_size: int = 512  # most prompt tokens per step over all requests; <= 0: no limit
    max_running_requests: int = 64
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # prompt token ids must lie in [0, vocab_size)
    # Launch the next step before reading the one in flight when the executor can chain them.
    overlap_schedule: bool = False


class StepResult(NamedTuple):
    updated: list[Req]  # requests with new output tokens, in batch order
    finished: list[Req]  # requests that finished (already released)
    failed: list[Req]  # requests ended by an error attributed to them (released; see `error`)


class RequestRejected(ValueError):
    """The request can never be served with this configuration (prompt too long, ...)."""


class Scheduler:
    """Plans and applies steps; not thread-safe (one thread drives it, see `scheduler_loop`)."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        req_pool: ReqToTokenPool,
        allocator: PagedTokenAllocator,
        executor: BaseStepExecutor,
    ) -> None:
        self.cfg = cfg
        self.req_pool = req_pool
        self.allocator = allocator
        self.executor = executor
        # Insertion-ordered by rid: FCFS order, and an abort finds its request in O(1).
        self.waiting: dict[str, Req] = {}
        self.running: dict[str, Req] = {}
        self._reserved_pages = 0
        self._inflight: InflightStep | None = None
        self._failed: list[Req] = []  # failed during the current step

    # ---- admission -------------------------------------------------------------------------
    def validate(self, req: Req) -> None:
        """Raise RequestRejected when `req` can never run (checked before queueing)."""
        total = len(req.prompt_ids) + req.params.max_new_tokens
        ctx = self.req_pool.max_context_len
        if not req.prompt_ids:
            raise RequestRejected("the prompt is empty")
        if total > ctx:
            raise RequestRejected(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                f"({req.params.max_new_tokens}) = {total} exceeds the context length {ctx}"
            )
        refusal = self.executor.refuses(req)
        if refusal is not None:
            raise RequestRejected(refusal)
        if req.return_logprob and req.logprob_start_len > len(req.prompt_ids):
            raise RequestRejected(
                f"logprob_start_len ({req.logprob_start_len}) is higher than the number of "
                f"prompt tokens ({len(req.prompt_ids)})"
            )
        if self._pages_for(total) > self.allocator.num_usable_pages:
            raise RequestRejected(f"request needs {total} tokens of KV, more than the pool holds")
        vocab = self.cfg.vocab_size
        if vocab is not None:
            bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
            if bad:
                raise RequestRejected(f"token ids out of range [0, {vocab}): {bad[:5]}")
            for name, ids in (
                ("logit_bias", [t for t, _ in req.params.logit_bias]),
                ("token_ids_logprob", list(req.token_ids_logprob or ())),
            ):
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise RequestRejected(f"{name}: token ids out of range [0, {vocab}): {bad[:5]}")

    def add(self, req: Req) -> None:
        self.add_group([req])

    def add_group(self, reqs: list[Req]) -> None:
        """Queue `reqs` together or none of them (RequestRejected when one can never run or
        reuses a request id)."""
        rids: set[str] = set()
        for req in reqs:
            self.validate(req)
            if req.rid in self.waiting or req.rid in self.running or req.rid in rids:
                raise RequestRejected(f"request id {_short(req.rid)} is already in use")
            rids.add(req.rid)
        for req in reqs:
            self.waiting[req.rid] = req

    def expire_waiting(self, queued_before: float) -> list[Req]:
        """Remove and return the waiting requests queued before `queued_before` (`Req.queued_at`,
        non-decreasing in arrival order, so only the head is examined)."""
        expired = []
        while self.waiting:
            req = next(iter(self.waiting.values()))
            if req.queued_at >= queued_before:
                break
            del self.waiting[req.rid]
            req.finish_reason = {"type": "abort", "message": "queue timeout"}
            expired.append(req)
        return expired

    def _pages_for(self, tokens: int) -> int:
        # A step may write up to `step_window` positions past the committed length.
        ps = self.allocator.page_size
        return -(-(tokens + self.executor.step_window) // ps)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_running_requests:
            req = next(iter(self.waiting.values()))
            pages = self._pages_for(len(req.prompt_ids) + req.params.max_new_tokens)
            if self._reserved_pages + pages > self.allocator.num_usable_pages:
                break  # wait for memory (FCFS: later requests do not overtake)
            if self.req_pool.num_free_slots == 0:
                break
            del self.waiting[req.rid]
            req.slot = self.req_pool.alloc_slot()
            req.reserved_tokens = pages * self.allocator.page_size
            self._reserved_pages += pages
            # Every position the request can address gets its page now: steps never allocate.
            self.req_pool.reserve(req.slot, min(req.reserved_tokens, self.req_pool.max_context_len))
            self.running[req.rid] = req
            self.executor.on_admit(req)

    def release(self, req: Req) -> None:
        """Free the request's slot and pages (it finished or was aborted)."""
        if req.slot >= 0:
            self.executor.on_release(req)
            self.req_pool.free_slot(req.slot)
            self._reserved_pages -= req.reserved_tokens // self.allocator.page_size
            req.slot = -1
        self.running.pop(req.rid, None)

    def abort(self, rid: str) -> Req | None:
        """Abort `rid` if it is queued or running; returns it (finish reason abort) or None."""
        req = self.waiting.pop(rid, None)
        if req is None:
            req = self.running.get(rid)
            if req is None:
                return None
            self.release(req)
        req.finish_reason = {"type": "abort"}
        return req

    @property
    def has_work(self) -> bool:
        # A step in flight has running requests: they are owed its tokens.
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one scheduling step over the running requests: admit, plan, launch, and apply the
        results of the step that completes (this one, or with the overlap schedule the one
        launched before it). A step that raises is retried request by request (module doc)."""
        self._admit()
        updated: list[Req] = []
        finished: list[Req] = []
        try:
            self._step(updated, finished)
        except Exception as exc:
            self._inflight = None  # its results are dropped; requests redo them from host state
            suspects = [r for r in self.running.values() if not r.finished]
            logger.exception(
                "step failed (%s); retrying its %d requests one by one",
                _describe(exc),
                len(suspects),
            )
            updated += self._isolate(suspects)
        finished += self._release_finished()
        failed, self._failed = self._failed, []
        return StepResult(_unique(updated), finished, failed)

    def _step(self, updated: list[Req], finished: list[Req]) -> None:
        prev = self._inflight
        work = self._plan()
        if prev is not None and not (
            work and self.cfg.overlap_schedule and self.executor.can_chain(work, prev)
        ):
            # The next step needs the results in flight (the batch changed or the step kinds
            # differ): read them first and plan from known tokens.
            self._inflight = None
            updated += self._apply(prev.wait())
            finished += self._release_finished()
            self._admit()
            prev = None
            work = self._plan()
        if work:
            launched = self.executor.launch(work, prev)
            if prev is not None:  # read the previous step while this one runs
                self._inflight = None
                updated += self._apply(prev.wait())
            if self.cfg.overlap_schedule and launched.chainable:
                self._inflight = launched
            else:
                self._inflight = None
                updated += self._apply(launched.wait())

    def _isolate(self, suspects: list[Req]) -> list[Req]:
        """Run each request alone; fail those that fail alone. Returns the updated ones."""
        updated: list[Req] = []
        for req in suspects:
            if req.finished or req.slot < 0:
                continue
            try:
                updated += self._apply(self.executor.launch(self._plan_alone(req), None).wait())
            except Exception as exc:
                logger.exception("request %s fails alone; ending it", _short(req.rid))
                self._fail(req, exc)
        return updated

    def _plan_alone(self, req: Req) -> StepWork:
        if req.prefill_done:
            return StepWork(decode=(req,))
        budget = self.cfg.chunked_prefill_size
        end = len(req.prompt_ids) if budget <= 0 else min(len(req.prompt_ids), req.kv_len + budget)
        return StepWork(prefill=((req, tuple(req.prompt_ids[req.kv_len : end])),))

    def _fail(self, req: Req, exc: Exception) -> None:
        """End `req` with an error (released like an abort, reported in `StepResult.failed`)."""
        req.error = _describe(exc)
        req.finish_reason = {"type": "abort", "message": req.error}
        self.release(req)
        self._failed.append(req)

    def _plan(self) -> StepWork:
        budget = self.cfg.chunked_prefill_size
        prefill: list[tuple[Req, tuple[int, ...]]] = []
        decode: list[Req] = []
        for req in self.running.values():
            if req.prefill_done:
                decode.append(req)
            elif budget != 0:
                start = req.kv_len
                end = (
                    len(req.prompt_ids) if budget < 0 else min(len(req.prompt_ids), start + budget)
                )
                prefill.append((req, tuple(req.prompt_ids[start:end])))
                if budget > 0:
                    budget -= end - start
        return StepWork(tuple(prefill), tuple(decode))

    def _release_finished(self) -> list[Req]:
        finished = [r for r in self.running.values() if r.finished]
        for r in finished:
            self.release(r)
        return finished

    # ---- applying results --------------------------------------------------------------------
    def _apply(self, updates: list[ReqUpdate]) -> list[Req]:
        """The one place a step's results change requests; returns those with new tokens.
        A request that finished or was aborted after the step was launched takes nothing; one
        whose update fails on the host (a stop string, detokenization) fails alone."""
        out = []
        for u in updates:
            req = u.req
            if req.finished or req.slot < 0:
                continue
            try:
                if req.wants_prompt_logprobs:
                    _append_prompt_logprobs(req, u)
                req.kv_len += u.kv_committed
                if u.speculative:
                    req.spec_verify_ct += 1
                    req.spec_committed += len(u.tokens)
                if u.tokens:
                    self._append_tokens(req, u)
                    out.append(req)
            except Exception as exc:
                logger.exception("could not apply the step to request %s", _short(req.rid))
                self._fail(req, exc)
        return [r for r in out if r.error is None]

    def _append_tokens(self, req: Req, u: ReqUpdate) -> None:
        """Append sampled tokens, stopping at the first stop condition (later tokens dropped).
        A grammar advances by each appended token and ends the request once it terminates."""
        p = req.params
        if p.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            return
        for i, (tok, lp) in enumerate(zip(u.tokens, u.logprobs)):
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            if u.top_logprobs:
                req.output_top_logprobs.append(u.top_logprobs[i])
            if u.token_ids_logprobs:
                req.output_token_ids_logprobs.append(u.token_ids_logprobs[i])
            if req.grammar is not None:
                if not req.grammar.accept(tok):
                    raise RuntimeError(f"the grammar does not allow the sampled token {tok}")
                if req.grammar.terminated:
                    req.finish_reason = {"type": "stop", "matched": tok}
                    return
            if not p.ignore_eos and tok in self.cfg.eos_token_ids:
                req.finish_reason = {"type": "stop", "matched": tok}
            elif tok in p.stop_token_ids:
                req.finish_reason = {"type": "stop", "matched": tok}
            elif req.detok is not None and req.detok.append([tok]).stop is not None:
                req.finish_reason = {"type": "stop", "matched": req.detok.matched_stop}
            if req.finish_reason is None and len(req.output_ids) >= p.max_new_tokens:
                req.finish_reason = {"type": "length", "length": p.max_new_tokens}
            if req.finish_reason is not None:
                return


def _append_prompt_logprobs(req: Req, u: ReqUpdate) -> None:
    """Record the prompt logprobs of a prefill chunk: SGLang's layout starts at the prompt index
    `logprob_start_len` with None (no position before it is scored), then one value per later
    prompt token."""
    start = req.logprob_start_len
    if req.kv_len <= start < req.kv_len + u.kv_committed:
        req.input_logprobs.append(None)
        req.input_top_logprobs.append(None)
        req.input_token_ids_logprobs.append(None)
    pl = u.prompt_logprobs
    if pl is None:
        return
    req.input_logprobs.extend(pl.logprobs)
    if pl.top:
        req.input_top_logprobs.extend(pl.top)
    if pl.token_ids:
        req.input_token_ids_logprobs.extend(pl.token_ids)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _short(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else repr(text[: limit - 3] + "...")


def _unique(reqs: list[Req]) -> list[Req]:
    """Each request once, first occurrence first: a step that reads the step in flight and then
    its own results may update a request twice."""
    seen: set[str] = set()
    out = []
    for r in reqs:
        if r.rid not in seen:
            seen.add(r.rid)
            out.append(r)
    return out
