"""The HTTP side of generation: submit the sub-requests of one HTTP request (prompts x n) to the
scheduler thread as one group, wait for their acceptance, then read their outputs from one shared
asyncio queue -- while watching for the client going away, in which case every unfinished
sub-request is aborted (its KV pages return to the pool). Every started group is registered in
`ServingContext.active` until it ends, so a shutdown can wait for it, or end it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from sgl_dspark.srt.entrypoints.api_errors import ApiError
from sgl_dspark.srt.entrypoints.http_limits import RateLimitedLog, read_body
from sgl_dspark.srt.entrypoints.openai_protocol import describe_validation_error
from sgl_dspark.srt.managers.io_struct import (
    GenerateOutput,
    GenerateReqInput,
    PromptLogprobsOut,
    ReqAccepted,
    ReqFailed,
)
from sgl_dspark.srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sgl_dspark.srt.managers.metrics import ServerMetrics
    from sgl_dspark.srt.managers.scheduler_loop import SchedulerLoop
    from sgl_dspark.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# How often a waiting handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25
SSE_DONE = "data: [DONE]\n\n"
_Model = TypeVar("_Model", bound=BaseModel)
_SAMPLING_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def new_rid() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class ServingContext:
    """What every route handler needs (one per app)."""

    args: ServerArgs
    loop: SchedulerLoop
    metrics: ServerMetrics
    has_tokenizer: bool
    vocab_size: int
    # The model's directory: --model-path, or where a built-in model is materialised.
    model_dir: str | None = None
    model_type: str = ""
    architectures: tuple[str, ...] = ()
    active: set[RequestGroup] = field(default_factory=set)  # groups started and not ended
    # Requests refused with 503 (queue full, queue timeout, shutdown): one line per interval.
    refused_log: RateLimitedLog = field(
        default_factory=lambda: RateLimitedLog("requests refused with 503")
    )


class ClientDisconnected(Exception):
    """The HTTP client went away; the group's sub-requests were aborted."""


async def parse_body(request: Request, model: type[_Model]) -> _Model:
    """Read the body (bounded in size and time, `read_body`) and validate the raw JSON against
    `model`; a 400 names the first problem."""
    ctx: ServingContext = request.app.state.ctx
    try:
        raw = await read_body(request, ctx.args.max_request_body_bytes, ctx.args.client_timeout)
    except ClientDisconnect:
        raise ClientDisconnected() from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise ApiError(400, message, param=param) from None


def check_model_name(ctx: ServingContext, name: str) -> None:
    served = ctx.args.served_model_name
    if name != served:
        raise ApiError(
            404,
            f"The model '{name}' does not exist; this server serves '{served}'",
            param="model",
            code="model_not_found",
        )


def require_tokenizer(ctx: ServingContext, what: str) -> None:
    if not ctx.has_tokenizer:
        raise ApiError(
            400,
            f"{what} needs a tokenizer, and this server runs with "
            "--skip-tokenizer-init; use /generate with input_ids",
        )


def make_sampling_params(
    values: Mapping[str, Any],
    rename: Mapping[str, str] | None = None,
    default_param: str | None = None,
) -> SamplingParams:
    """`SamplingParams.from_dict(values)`; a ValueError becomes a 400 whose `param` is the API's
    name of the offending field (`rename` maps SamplingParams names to API names), or
    `default_param` when the message names no single field."""
    try:
        return SamplingParams.from_dict(values)
    except ValueError as exc:
        message = str(exc)
        # SamplingParams messages start with the field name ("top_k must be ...").
        field_name: str | None = message.split(" ", 1)[0].split("=", 1)[0]
        if field_name not in _SAMPLING_FIELD_NAMES:
            field_name = default_param
        elif rename and field_name in rename:
            message = message.replace(field_name, rename[field_name], 1)
            field_name = rename[field_name]
        raise ApiError(400, message, param=field_name) from None


@dataclass
class SubResult:
    """Everything one sub-request produced (for non-streaming responses)."""

    accepted: ReqAccepted
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    spec_verify_ct: int | None = None
    spec_committed: int | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    token_ids_logprobs: list[tuple[float, ...]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobsOut | None = None
    id_texts: dict[int, str] = field(default_factory=dict)

    def add(self, out: GenerateOutput) -> None:
        self.top_logprobs.extend(out.top_logprobs)
        self.token_ids_logprobs.extend(out.token_ids_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.id_texts:
            self.id_texts.update(out.id_texts)
        self.spec_verify_ct = out.spec_verify_ct
        self.spec_committed = out.spec_committed
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.token_texts.extend(out.token_texts)
        self.completion_tokens = out.completion_tokens
        self.finish_reason = out.finish_reason


class RequestGroup:
    """The sub-requests of one HTTP request. Use as `async with`: leaving the block aborts
    whatever has not finished (client gone, handler cancelled, error)."""

    def __init__(
        self,
        ctx: ServingContext,
        request: Request,
        endpoint: str,
        inputs: list[GenerateReqInput],
        prompt_param: str,
        renames: Mapping[str, str] | None = None,
    ) -> None:
        """`prompt_param` is the API field a rejection points at; `renames` rewrites the
        scheduler's field names in rejection messages to the API's (max_new_tokens ->
        max_tokens)."""
        self.renames = renames or {}
        self.ctx = ctx
        self.request = request
        self.endpoint = endpoint
        self.inputs = inputs
        self.prompt_param = prompt_param
        self.index = {inp.rid: i for i, inp in enumerate(inputs)}
        self.accepted: list[ReqAccepted] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(self.index)
        self._arrival = time.perf_counter()
        self._last_poll = time.monotonic()
        self._last_time: dict[str, float] = {}

    async def __aenter__(self) -> RequestGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort_unfinished()

    def abort_unfinished(self) -> None:
        if self._unfinished:  # the group stops reading: no final outputs needed
            self.ctx.loop.abort_many(list(self._unfinished), notify=False)
            self._unfinished.clear()
        self.ctx.active.discard(self)

    def fail(self, status: int, message: str) -> None:
        """End every unfinished sub-request with `status` from the HTTP side (the server is
        going down and the scheduler thread may not answer any more)."""
        for rid in self._unfinished:
            self._queue.put_nowait(ReqFailed(rid, status, message))

    def submit(self) -> None:
        """Submit the sub-requests as one group (`start` does, and waits for the answer)."""
        self.ctx.active.add(self)
        self.ctx.loop.submit_group(self.inputs, self._queue)

    async def start(self) -> list[ReqAccepted]:
        """Submit the sub-requests as one group and wait until they are queued. A refusal
        raises `ApiError` (400 with the scheduler's reason, or 503 with Retry-After)."""
        self.submit()
        by_rid: dict[str, ReqAccepted] = {}
        try:
            while len(by_rid) < len(self.inputs):
                item = await self._next()
                if isinstance(item, ReqFailed):
                    self._unfinished.discard(item.rid)
                    message = item.message
                    for old, new in self.renames.items():
                        message = message.replace(old, new)
                    param = self.renames.get(item.param, item.param) if item.param else None
                    raise _api_error(item, message, param=param or self.prompt_param)
                if not isinstance(item, ReqAccepted):  # outputs never precede the acceptances
                    raise RuntimeError(f"output before acceptance: {type(item).__name__}")
                by_rid[item.rid] = item
        except BaseException:
            self.abort_unfinished()
            raise
        self.accepted = [by_rid[inp.rid] for inp in self.inputs]
        if self.ctx.args.log_requests:
            for inp, acc in zip(self.inputs, self.accepted):
                params = (
                    f" {inp.sampling_params.to_dict()}" if self.ctx.args.log_requests_level else ""
                )
                logger.info(
                    "request %s on %s: %d prompt tokens%s",
                    inp.rid,
                    self.endpoint,
                    acc.prompt_tokens,
                    params,
                )
        return self.accepted

    async def outputs(self) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """Yield (sub-request index, output) until every sub-request finished. Raises `ApiError`
        when one failed inside the scheduler, `ClientDisconnected` when the client left."""
        while self._unfinished:
            item = await self._next()
            if isinstance(item, ReqFailed):
                self._unfinished.discard(item.rid)
                raise _api_error(item, item.message)
            if not isinstance(item, GenerateOutput):
                raise RuntimeError(f"unexpected scheduler record {type(item).__name__}")
            self._observe(item)
            if item.finished:
                self._unfinished.discard(item.rid)
            yield self.index[item.rid], item

    async def collect(self) -> list[SubResult]:
        """Run every sub-request to completion (non-streaming responses)."""
        results = [SubResult(acc) for acc in self.accepted]
        async for i, out in self.outputs():
            results[i].add(out)
        return results

    async def _next(self) -> Any:
        """The next record; checks the client every DISCONNECT_POLL_S, busy or not (a long
        request keeps its queue busy, so an idle-only check would never fire)."""
        while True:
            if time.monotonic() - self._last_poll >= DISCONNECT_POLL_S:
                self._last_poll = time.monotonic()
                if await self.request.is_disconnected():
                    logger.info(
                        "client left %s; aborting %d request(s)",
                        self.endpoint,
                        len(self._unfinished),
                    )
                    self.abort_unfinished()
                    raise ClientDisconnected()
            if not self._queue.empty():
                return self._queue.get_nowait()
            try:
                return await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass

    def _observe(self, out: GenerateOutput) -> None:
        now = time.perf_counter()
        metrics = self.ctx.metrics
        if out.token_ids:
            last = self._last_time.get(out.rid)
            if last is None:
                metrics.observe_first_token(now - self._arrival)
                if len(out.token_ids) > 1:
                    metrics.observe_chunk(0.0, len(out.token_ids) - 1)
            else:
                metrics.observe_chunk(now - last, len(out.token_ids))
            self._last_time[out.rid] = now
        if out.finished:
            if self.ctx.args.log_requests:
                logger.info(
                    "request %s finished: %d output tokens, %s, %.3f s",
                    out.rid,
                    out.completion_tokens,
                    out.finish_reason,
                    now - self._arrival,
                )
            metrics.observe_finished(out.prompt_tokens, out.completion_tokens, now - self._arrival)


def _api_error(failed: ReqFailed, message: str, param: str | None = None) -> ApiError:
    return ApiError(failed.status, message, param=param, retry_after=failed.retry_after)


class GroupStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its group's unfinished requests however the stream ends
    (Starlette does not close the body iterator when the client disconnects mid-`send`)."""

    def __init__(self, content: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._group.abort_unfinished()


async def stream_events(
    group: RequestGroup, events: Callable[[], AsyncIterator[str]]
) -> AsyncIterator[str]:
    """Wrap an SSE event generator: errors after the stream started become an error event,
    and every stream ends with `[DONE]` unless the client left."""
    try:
        async with group:
            async for event in events():
                yield event
    except ClientDisconnected:
        return
    except ApiError as exc:
        yield exc.sse()
    except Exception as exc:
        logger.exception("stream of %s failed", group.endpoint)
        yield ApiError(500, f"internal error: {type(exc).__name__}: {exc}").sse()
    yield SSE_DONE
