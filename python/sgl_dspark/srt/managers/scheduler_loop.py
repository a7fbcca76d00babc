"""The scheduler driver: one dedicated thread owns the (not thread-safe) `Scheduler`, the
tokenizer and every request's detokenizer.

Requests come in through a thread-safe inbox (`submit_group`, `abort`); results go out to one
asyncio queue per HTTP request, posted with `loop.call_soon_threadsafe` (one call per batch of
records). The thread runs `Scheduler.step()` while there is work and blocks on the inbox when idle.

Per iteration: handle inbox messages in arrival order (tokenize, validate, queue a group; abort)
-> expire requests queued longer than `queue_timeout_s` -> deliver the acceptances -> one `step()`
-> turn `StepResult.updated` into `GenerateOutput` deltas -> publish a `SchedulerStats` snapshot ->
deliver the outputs. The snapshot is published before the outputs of the same step, so once a
client has seen its final output the stats already show the request's pages released. While
requests run, one iteration handles inbox messages for at most `ADMISSION_BUDGET_S` and leaves
the rest for the next one, so a huge batch arriving never stalls the running requests' steps.

Failure isolation: a request that cannot be tokenized or admitted fails alone (400, or 503 when
the queue is full); an exception while building one request's output fails that request (500);
a step failure fails only the requests it is attributed to (`Scheduler.step`). An exception
elsewhere in an iteration fails what is in flight (500) and the loop goes on, unless it repeats
`MAX_CONSECUTIVE_FAILURES` times: then, as when the thread dies of anything else, every request
fails with 503, nothing more is accepted and `on_fatal` tells the server to shut down.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sgl_dspark.srt.managers.io_struct import (
    AbortReq,
    GenerateReqInput,
    ReqAccepted,
    ReqFailed,
    SchedulerOutput,
    SchedulerStats,
)
from sgl_dspark.srt.managers.request_io import OutQueue, RequestIO, Tracked
from sgl_dspark.srt.managers.scheduler import RequestRejected, Scheduler

if TYPE_CHECKING:
    from sgl_dspark.srt.core.req import Req
    from sgl_dspark.srt.tokenizer import TokenizerLike

logger = logging.getLogger(__name__)

SPEC_METRICS_INTERVAL_S = 1.0
# Longest time one iteration spends on inbox messages while requests are running.
ADMISSION_BUDGET_S = 0.02
MAX_CONSECUTIVE_FAILURES = 3
# Hints for refused clients: when to try again.
RETRY_AFTER_BUSY_S = 1.0
RETRY_AFTER_SHUTDOWN_S = 5.0
SHUTTING_DOWN = "the server is shutting down"


class AcceptanceStats(Protocol):
    """Speculative acceptance statistics (DSpark's metrics): `summary()` has `request_steps`,
    `accept_length`, `accept_rate` and `conditional_acceptance`."""

    def summary(self) -> Any: ...


class _Stop:
    """Inbox sentinel: abort everything and end the thread."""


@dataclass
class _Group:
    """The sub-requests of one HTTP request: queued together or refused together. A large
    group is built over several iterations (`built` holds the requests made so far)."""

    inputs: tuple[GenerateReqInput, ...]
    out: OutQueue
    built: list[tuple[Req, ReqAccepted]] = field(default_factory=list)


@dataclass(frozen=True)
class _FailAll:
    """Fail every request in flight (the end of a graceful shutdown's grace period)."""

    status: int
    message: str


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
        max_queued: int | None = None,
        queue_timeout_s: float = 0.0,
    ) -> None:
        """`spec_metrics`: DSpark's acceptance statistics (None without speculative decoding).
        `max_queued`: most waiting requests (a group that does not fit is refused with 503);
        None: no limit. `queue_timeout_s`: refuse (503) a request still waiting after this
        long; 0: never. Set `on_fatal(reason)` to be called on the event loop when the thread
        ends unexpectedly."""
        self._scheduler = scheduler
        self._spec_metrics = spec_metrics
        self._step_delay_s = step_delay_s
        self._tokenizer = tokenizer
        self._max_queued = max_queued
        self._queue_timeout_s = queue_timeout_s
        self.on_fatal: Callable[[str], None] | None = None
        self._inbox: queue.Queue[_Group | AbortReq | _FailAll | _Stop] = queue.Queue()
        self._backlog: collections.deque[_Group | AbortReq | _FailAll | _Stop] = collections.deque()
        # Guards the inbox against the thread ending: a message is either queued before
        # `_closed` is set (and then failed by the dying thread) or refused at once.
        self._lock = threading.Lock()
        self._closed = False
        self._draining = False
        self.iterations = 0  # completed loop iterations (the watchdog's heartbeat)
        self._io = RequestIO(scheduler, tokenizer, speculative=spec_metrics is not None)
        self._tracked: dict[str, Tracked] = {}
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
        self.submit_group([req], out)

    def submit_group(self, reqs: Sequence[GenerateReqInput], out: OutQueue) -> None:
        """Queue `reqs` together (all accepted or the group refused); their records go to `out`.
        Refused at once with 503 once the server drains or the thread has ended."""
        with self._lock:
            if not (self._closed or self._draining):
                self._inbox.put(_Group(tuple(reqs), out))
                return
        if reqs:
            self._deliver_now(
                [(out, ReqFailed(reqs[0].rid, 503, SHUTTING_DOWN, None, RETRY_AFTER_SHUTDOWN_S))]
            )

    def abort(self, rid: str) -> None:
        """Abort `rid` if it is still queued or running (no-op otherwise); its waiter gets a
        final output with finish_reason abort."""
        self._inbox.put(AbortReq((rid,)))

    def abort_many(self, rids: Sequence[str], notify: bool = True) -> None:
        """`abort` for each of `rids`, as one message (each costs O(1) on the thread);
        `notify=False` when nobody waits for the final outputs any more."""
        if rids:
            self._inbox.put(AbortReq(tuple(rids), notify))

    def begin_drain(self) -> None:
        """Refuse new requests (503); those already submitted go on."""
        with self._lock:
            self._draining = True

    def fail_all(self, status: int, message: str) -> None:
        """Fail every request submitted so far with `status` (ends a drain's grace period)."""
        self._inbox.put(_FailAll(status, message))

    @property
    def stats(self) -> SchedulerStats:
        return self._stats

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    @property
    def thread_running(self) -> bool:
        """The scheduler thread has not ended (after `shutdown`: it hung in a step)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._draining

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
        fatal: str | None = None
        try:
            failures = 0
            while True:
                try:
                    if not self._iterate():
                        break
                    failures = 0
                except Exception as exc:  # a bug outside step(): fail what is in flight, go on
                    failures += 1
                    logger.exception(
                        "scheduler loop iteration failed; failing %d requests", len(self._tracked)
                    )
                    self._abort_all(500, f"internal error: {type(exc).__name__}: {exc}")
                    self._stats = self._snapshot()
                    self._flush()
                    if failures >= MAX_CONSECUTIVE_FAILURES:
                        fatal = f"the scheduler loop failed {failures} times in a row"
                        break
        except BaseException as exc:  # the thread is dying: end cleanly, then let the server go
            fatal = f"the scheduler thread died: {type(exc).__name__}: {exc}"
            logger.critical("%s", fatal, exc_info=True)
        finally:
            with self._lock:
                self._closed = True
            message = SHUTTING_DOWN if fatal is None else f"{SHUTTING_DOWN} (internal error)"
            self._fail_backlog(message)
            self._abort_all(503, message)
            self._stats = self._snapshot()
            self._flush()
            logger.info("scheduler thread stopped")
            if fatal is not None and self.on_fatal is not None and self._event_loop is not None:
                try:
                    self._event_loop.call_soon_threadsafe(self.on_fatal, fatal)
                except RuntimeError:
                    logger.error("event loop closed; cannot report: %s", fatal)

    def _iterate(self) -> bool:
        """One loop iteration; False when a stop was requested."""
        busy = self._scheduler.has_work
        self._backlog.extend(self._drain(block=not (busy or self._backlog)))
        # While requests run, inbox work stops at the deadline (a large group or abort resumes
        # in the next iteration, ahead of later messages); when idle it all runs now.
        deadline = time.monotonic() + ADMISSION_BUDGET_S if busy else float("inf")
        while self._backlog and time.monotonic() <= deadline:
            msg = self._backlog[0]
            if isinstance(msg, _Stop):
                return False
            if isinstance(msg, AbortReq):
                rest = self._abort_many(msg, deadline)
                if rest:
                    self._backlog[0] = rest
                    continue
            elif isinstance(msg, _FailAll):
                self._abort_all(msg.status, msg.message)
            elif not self._add_group(msg, deadline):
                continue
            self._backlog.popleft()
        self._expire_queued()
        self._flush()
        if self._scheduler.has_work:
            self._step()
        self._stats = self._snapshot()
        self._flush()
        self.iterations += 1
        return True

    def _drain(self, block: bool) -> list:
        msgs = [self._inbox.get()] if block else []
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _fail_backlog(self, message: str) -> None:
        """Refuse every group not yet queued (the thread is ending)."""
        self._backlog.extend(self._drain(block=False))
        for msg in self._backlog:
            if isinstance(msg, _Group) and msg.inputs:
                rid = msg.inputs[0].rid
                self._post(msg.out, ReqFailed(rid, 503, message, None, RETRY_AFTER_SHUTDOWN_S))
        self._backlog.clear()

    def _abort_many(self, msg: AbortReq, deadline: float) -> AbortReq | None:
        """Abort `msg.rids` until the deadline; returns what is left to abort, or None."""
        for i, rid in enumerate(msg.rids):
            if time.monotonic() > deadline:
                return AbortReq(msg.rids[i:], msg.notify)
            self._abort(rid, notify=msg.notify)
        return None

    def _add_group(self, group: _Group, deadline: float) -> bool:
        """Build the group's requests until the deadline, then queue them all; False when it
        is not built yet (resumed next iteration). A refusal ends the group."""
        if not group.built and not self._group_fits(group):
            return True
        while len(group.built) < len(group.inputs):
            if time.monotonic() > deadline:
                return False
            inp = group.inputs[len(group.built)]
            if inp.rid in self._tracked:
                message = f"request id {_short(inp.rid)} is already in use"
                self._post(group.out, ReqFailed(inp.rid, 400, message, "rid"))
                return True
            try:
                group.built.append(self._io.make_req(inp))
            except (RequestRejected, ValueError) as exc:
                param = getattr(exc, "param", None)  # a grammar error names its field
                self._post(group.out, ReqFailed(inp.rid, 400, str(exc), param))
                return True
            except Exception as exc:  # a broken tokenizer/template fails this request only
                logger.exception("could not queue request %s", _short(inp.rid))
                message = f"internal error: {type(exc).__name__}: {exc}"
                self._post(group.out, ReqFailed(inp.rid, 500, message))
                return True
        try:
            # Last: once added, the requests must be tracked.
            self._scheduler.add_group([req for req, _ in group.built])
        except RequestRejected as exc:
            self._post(group.out, ReqFailed(group.inputs[0].rid, 400, str(exc)))
            return True
        for inp, (req, acc) in zip(group.inputs, group.built):
            self._tracked[req.rid] = Tracked(req, group.out, inp.return_logprob)
            self._post(group.out, acc)
        return True

    def _group_fits(self, group: _Group) -> bool:
        """Whether the group fits the waiting queue; posts the refusal when not. (The queue
        only shrinks while the group is built: groups are built one at a time, in order.)"""
        waiting, limit, size = len(self._scheduler.waiting), self._max_queued, len(group.inputs)
        if limit is None or not group.inputs or waiting + size <= limit:
            return True
        rid = group.inputs[0].rid
        if size > limit:  # could never be queued: retrying is useless
            message = (
                f"one request may carry at most {limit} prompts x choices "
                f"(--max-queued-requests), got {size}"
            )
            self._post(group.out, ReqFailed(rid, 400, message))
        else:
            message = (
                f"the request queue is full ({waiting} waiting, at most {limit}: "
                "--max-queued-requests); retry later"
            )
            self._post(group.out, ReqFailed(rid, 503, message, None, RETRY_AFTER_BUSY_S))
        return False

    def _expire_queued(self) -> None:
        """Refuse (503) the requests that waited longer than the queue timeout."""
        timeout = self._queue_timeout_s
        if timeout <= 0:
            return
        for req in self._scheduler.expire_waiting(time.monotonic() - timeout):
            tracked = self._tracked.pop(req.rid, None)
            if tracked is not None:
                message = (
                    f"the request waited {timeout:g} s in the queue without being scheduled "
                    "(--queue-timeout); retry later"
                )
                self._post(tracked.out, ReqFailed(req.rid, 503, message, None, RETRY_AFTER_BUSY_S))

    def _abort(self, rid: str, notify: bool = True) -> None:
        """Abort `rid`; with `notify`, its waiter gets a final output (finish_reason abort)."""
        tracked = self._tracked.pop(rid, None)
        if self._scheduler.abort(rid) is None:
            return
        logger.debug("aborted request %s", rid)
        if notify and tracked is not None:
            try:
                self._post(tracked.out, self._io.make_output(tracked))
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
        except Exception as exc:  # a scheduler bug (step failures are isolated inside step())
            running = list(self._scheduler.running)
            logger.exception("scheduler step failed; failing its %d running requests", len(running))
            for rid in running:
                self._fail(rid, f"internal error: {type(exc).__name__}: {exc}")
            return
        self._steps += 1
        for req in result.failed:
            tracked = self._tracked.pop(req.rid, None)
            if tracked is not None:
                self._post(tracked.out, ReqFailed(req.rid, 500, f"internal error: {req.error}"))
        for req in result.updated:
            tracked = self._tracked.get(req.rid)
            assert tracked is not None, f"step updated untracked request {req.rid}"
            try:
                output = self._io.make_output(tracked)
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
        self._deliver_now(batch)

    def _deliver_now(self, batch: list[tuple[OutQueue, SchedulerOutput]]) -> None:
        assert self._event_loop is not None, "SchedulerLoop.start was not called"
        try:
            self._event_loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            logger.debug("event loop closed; dropped %d scheduler records", len(batch))


def _deliver(batch: list[tuple[OutQueue, SchedulerOutput]]) -> None:
    for out, item in batch:
        out.put_nowait(item)


def _short(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else repr(text[: limit - 3] + "...")
