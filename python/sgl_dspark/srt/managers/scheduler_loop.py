"""The scheduler driver: one dedicated thread owns the (not thread-safe) `Scheduler`, the
tokenizer and every request's detokenizer.

Requests come in through a thread-safe inbox (`submit`, `abort`); results go out to one asyncio
queue per HTTP request, posted with `loop.call_soon_threadsafe` (one call per batch of records).
The thread runs `Scheduler.step()` while there is work and blocks on the inbox when idle.

Per iteration: handle inbox messages (tokenize, validate, queue; abort) -> deliver the
acceptances -> one `step()` -> turn `StepResult.updated` into `GenerateOutput` deltas -> publish a
`SchedulerStats` snapshot -> deliver the outputs. The snapshot is published before the outputs of
the same step, so once a client has seen its final output the stats already show the request's
pages released.

Failure isolation: a request that cannot be tokenized or admitted fails alone (400); an exception
while building one request's output fails that request (500); an exception inside `step()` fails
the requests of that batch (500) and the loop keeps serving the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.managers.io_struct import (
    AbortReq,
    GenerateOutput,
    GenerateReqInput,
    ReqAccepted,
    ReqFailed,
    SchedulerOutput,
    SchedulerStats,
)
from sgl_dspark.srt.managers.scheduler import RequestRejected, Scheduler
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from sgl_dspark.srt.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from sgl_dspark.srt.tokenizer import TokenizerLike

logger = logging.getLogger(__name__)

OutQueue = asyncio.Queue  # of SchedulerOutput
SPEC_METRICS_INTERVAL_S = 1.0


class AcceptanceStats(Protocol):
    """Speculative acceptance statistics (DSpark's metrics): `summary()` has `request_steps`,
    `accept_length`, `accept_rate` and `conditional_acceptance`."""

    def summary(self) -> Any: ...


class _Stop:
    """Inbox sentinel: abort everything and end the thread."""


@dataclass
class _Tracked:
    req: Req
    out: OutQueue
    return_logprob: bool
    sent_chars: int = 0
    sent_tokens: int = 0


class SchedulerLoop:
    """Runs `scheduler` on its own thread (see the module doc).

    `submit`, `abort`, `stats` and `is_alive` may be called from any thread; `start` and
    `shutdown` from the thread that owns the event loop.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: TokenizerLike | None,
        step_delay_s: float = 0.0,
        spec_metrics: AcceptanceStats | None = None,
    ) -> None:
        """`spec_metrics`: DSpark's acceptance statistics (None without speculative decoding)."""
        self._scheduler = scheduler
        self._spec_metrics = spec_metrics
        self._step_delay_s = step_delay_s
        self._tokenizer = tokenizer
        self._inbox: queue.Queue[tuple[GenerateReqInput, OutQueue] | AbortReq | _Stop] = (
            queue.Queue()
        )
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[tuple[OutQueue, SchedulerOutput]] = []
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._spec_time = 0.0
        self._spec_fields: dict = {}
        self._stats = self._snapshot()

    # ---- any thread ----------------------------------------------------------------------------
    def submit(self, req: GenerateReqInput, out: OutQueue) -> None:
        """Queue `req`; its records will be put on `out` (see `io_struct`)."""
        self._inbox.put((req, out))

    def abort(self, rid: str) -> None:
        """Abort `rid` if it is still queued or running (no-op otherwise); its waiter gets a
        final output with finish_reason abort."""
        self._inbox.put(AbortReq(rid))

    @property
    def stats(self) -> SchedulerStats:
        return self._stats

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self, event_loop: asyncio.AbstractEventLoop) -> None:
        assert self._thread is None, "SchedulerLoop.start called twice"
        self._event_loop = event_loop
        self._thread = threading.Thread(target=self._run, name="sgl-dspark-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request (their waiters get a 503 `ReqFailed`) and join the thread."""
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("scheduler thread did not stop within %.0f s", timeout)

    # ---- scheduler thread ----------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("scheduler thread started")
        try:
            while True:
                try:
                    if not self._iterate():
                        break
                except Exception as exc:  # a bug outside step(): fail what is in flight, go on
                    logger.exception(
                        "scheduler loop iteration failed; failing %d requests", len(self._tracked)
                    )
                    self._abort_all(500, f"internal error: {exc}")
                    self._stats = self._snapshot()
                    self._flush()
        finally:
            self._abort_all(503, "the server is shutting down")
            self._stats = self._snapshot()
            self._flush()
            logger.info("scheduler thread stopped")

    def _iterate(self) -> bool:
        """One loop iteration; False when a stop was requested."""
        for msg in self._drain(block=not self._scheduler.has_work):
            if isinstance(msg, _Stop):
                return False
            if isinstance(msg, AbortReq):
                self._abort(msg.rid)
            else:
                self._add(*msg)
        self._flush()
        if self._scheduler.has_work:
            self._step()
        self._stats = self._snapshot()
        self._flush()
        return True

    def _drain(self, block: bool) -> list:
        msgs = [self._inbox.get()] if block else []
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _add(self, inp: GenerateReqInput, out: OutQueue) -> None:
        if inp.rid in self._tracked:
            self._post(
                out, ReqFailed(inp.rid, 400, f"request id {inp.rid!r} is already in use", "rid")
            )
            return
        try:
            ids = self._tokenize(inp)
            p = self._finalise_params(inp, len(ids))
            detok = None
            if self._tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self._tokenizer,
                    skip_special_tokens=p.skip_special_tokens,
                    stop=p.stop,
                    no_stop_trim=p.no_stop_trim,
                    prompt_ids=ids,
                )
            prompt_text = None
            if inp.return_prompt_text and self._tokenizer is not None:
                prompt_text = self._tokenizer.decode(ids)
            req = Req(
                rid=inp.rid,
                prompt_ids=ids,
                params=p,
                return_logprob=inp.return_logprob,
                detok=detok,
            )
            self._scheduler.add(req)  # last: once added, the request must be tracked
        except (RequestRejected, ValueError) as exc:
            self._post(out, ReqFailed(inp.rid, 400, str(exc)))
            return
        except Exception as exc:  # a broken tokenizer/template fails this request only
            logger.exception("could not queue request %s", inp.rid)
            self._post(out, ReqFailed(inp.rid, 500, f"internal error: {exc}"))
            return
        self._tracked[inp.rid] = _Tracked(req, out, inp.return_logprob)
        self._post(out, ReqAccepted(inp.rid, len(ids), prompt_text))

    def _tokenize(self, inp: GenerateReqInput) -> list[int]:
        if inp.input_ids is not None:
            return list(inp.input_ids)
        if self._tokenizer is None:
            raise ValueError(
                "text and chat prompts need a tokenizer; this server runs with "
                "--skip-tokenizer-init, so send token ids"
            )
        if inp.text is not None:
            return self._tokenizer.encode(inp.text)
        assert inp.messages is not None
        ids = self._tokenizer.apply_chat_template(
            inp.messages, add_generation_prompt=True, tokenize=True
        )
        assert isinstance(ids, list), type(ids)
        return ids

    def _finalise_params(self, inp: GenerateReqInput, num_prompt_ids: int) -> SamplingParams:
        params = inp.sampling_params
        if params.stop and self._tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer; this server runs with "
                "--skip-tokenizer-init, so use stop_token_ids"
            )
        if not inp.fill_context:
            return params
        sched = self._scheduler
        # The longest sequence the context and, with the executor's step window, the pool allow.
        pages = sched.allocator.num_usable_pages * sched.allocator.page_size
        limit = min(sched.req_pool.max_context_len, pages - sched.executor.step_window)
        if num_prompt_ids >= limit:
            raise ValueError(
                f"the prompt ({num_prompt_ids} tokens) leaves no room for output "
                f"in the context length {limit}"
            )
        return dataclasses.replace(params, max_new_tokens=limit - num_prompt_ids)

    def _abort(self, rid: str, notify: bool = True) -> None:
        """Abort `rid`; with `notify`, its waiter gets a final output (finish_reason abort)."""
        tracked = self._tracked.pop(rid, None)
        if self._scheduler.abort(rid) is None:
            return
        logger.debug("aborted request %s", rid)
        if notify and tracked is not None:
            try:
                self._post(tracked.out, self._make_output(tracked))
            except Exception as exc:
                logger.exception("could not build the final output of aborted request %s", rid)
                self._post(tracked.out, ReqFailed(rid, 500, f"internal error: {exc}"))

    def _abort_all(self, status: int, message: str) -> None:
        for rid, tracked in list(self._tracked.items()):
            self._abort(rid, notify=False)
            self._post(tracked.out, ReqFailed(rid, status, message))

    def _step(self) -> None:
        if self._step_delay_s > 0:
            time.sleep(self._step_delay_s)  # --debug-step-delay-ms (tests of the A/B harness)
        try:
            result = self._scheduler.step()
        except Exception as exc:
            running = list(self._scheduler.running)
            logger.exception("scheduler step failed; failing its %d running requests", len(running))
            for rid in running:
                self._fail(rid, f"internal error: {exc}")
            return
        self._steps += 1
        for req in result.updated:
            tracked = self._tracked.get(req.rid)
            assert tracked is not None, f"step updated untracked request {req.rid}"
            try:
                output = self._make_output(tracked)
            except Exception as exc:
                logger.exception("could not build the output of request %s", req.rid)
                self._fail(req.rid, f"internal error: {exc}")
                continue
            self._post(tracked.out, output)
            if output.finished:
                del self._tracked[req.rid]

    def _fail(self, rid: str, message: str) -> None:
        tracked = self._tracked.get(rid)
        self._abort(rid, notify=False)
        if tracked is not None:
            self._post(tracked.out, ReqFailed(rid, 500, message))

    def _make_output(self, tracked: _Tracked) -> GenerateOutput:
        req = tracked.req
        text = ""
        if req.detok is not None:
            if req.finished:
                req.detok.finish()  # flush held-back text; a no-op after a stop-string match
            text = req.detok.text
        new_ids = tuple(req.output_ids[tracked.sent_tokens :])
        logprobs: tuple[float, ...] = ()
        token_texts: tuple[str, ...] = ()
        if tracked.return_logprob:
            logprobs = tuple(req.output_logprobs[tracked.sent_tokens :])
            if self._tokenizer is not None:
                token_texts = tuple(
                    self._tokenizer.decode([t], skip_special_tokens=False) for t in new_ids
                )
        spec = self._spec_metrics is not None
        delta = text[tracked.sent_chars :]
        tracked.sent_chars = len(text)
        tracked.sent_tokens = len(req.output_ids)
        return GenerateOutput(
            rid=req.rid,
            text=delta,
            token_ids=new_ids,
            logprobs=logprobs,
            token_texts=token_texts,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            finish_reason=req.finish_reason,
            spec_verify_ct=req.spec_verify_ct if spec else None,
            spec_committed=req.spec_committed if spec else None,
        )

    def _spec_summary(self) -> dict:
        """DSpark acceptance, refreshed at most every SPEC_METRICS_INTERVAL_S (the summary syncs
        with the device) and whenever the scheduler goes idle."""
        metrics = self._spec_metrics
        if metrics is None:
            return {}
        now = time.monotonic()
        if self._scheduler.has_work and now - self._spec_time < SPEC_METRICS_INTERVAL_S:
            return self._spec_fields
        self._spec_time = now
        summary = metrics.summary()
        if summary.request_steps:
            self._spec_fields = {
                "spec_accept_length": summary.accept_length,
                "spec_accept_rate": summary.accept_rate,
                "spec_acceptance_by_position": tuple(summary.conditional_acceptance),
            }
        return self._spec_fields

    def _snapshot(self) -> SchedulerStats:
        sched = self._scheduler
        return SchedulerStats(
            num_running_reqs=len(self._scheduler.running),
            num_waiting_reqs=len(self._scheduler.waiting),
            kv_free_pages=sched.allocator.num_free_pages,
            kv_total_pages=sched.allocator.num_usable_pages,
            page_size=sched.allocator.page_size,
            free_req_slots=sched.req_pool.num_free_slots,
            total_steps=self._steps,
            **self._spec_summary(),
        )

    # ---- delivery ------------------------------------------------------------------------------
    def _post(self, out: OutQueue, item: SchedulerOutput) -> None:
        self._pending.append((out, item))

    def _flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        assert self._event_loop is not None
        try:
            self._event_loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            logger.debug("event loop closed; dropped %d scheduler records", len(batch))


def _deliver(batch: list[tuple[OutQueue, SchedulerOutput]]) -> None:
    for out, item in batch:
        out.put_nowait(item)
