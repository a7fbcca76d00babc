"""The HTTP server: a FastAPI app over one `SchedulerLoop`, run by uvicorn.

Processes and threads: one process; the asyncio event loop (uvicorn + FastAPI) parses and
answers requests; one scheduler thread owns the model, the scheduler, the tokenizer and the
detokenizers (`managers/scheduler_loop.py`). Routes: OpenAI `/v1/completions`,
`/v1/chat/completions`, `/v1/models`, `/v1/models/{id}`; SGLang `/generate`, `/abort_request`,
`/health`, `/health_generate`, `/ready`, `/flush_cache`, `/model_info` and `/server_info` (also
under their older names `/get_model_info`, `/get_server_info`); Prometheus `/metrics`. Every
error is an OpenAI-style `{"error": {"message", "type", "param", "code"}}` body; a server error's
message never carries a stack trace or a path (`api_errors.redact`). Every 4xx is logged with
the request's id (the client's `X-Request-Id`, else one the server makes), which the response
carries in `X-Request-Id`.

Authentication (`--api-key`): every route needs `Authorization: Bearer <key>` except `/health`
(liveness: answers from memory, runs nothing) and `/metrics` (aggregate counters for
Prometheus), which SGLang and vLLM leave open as well. `/health_generate` runs the model, so it
is protected (SGLang leaves it open). The key is compared in constant time (`hmac.compare_digest`
on bytes). No request field names a file: the server never opens a path a client chose.

Bounds on clients (connections, header and body size, slow clients, keep-alive):
`http_limits.py`. Shutdown, the watchdog and fatal errors: `lifecycle.py`; `run_server` returns
the process exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import sgl_dspark
from sgl_dspark.srt.entrypoints.api_errors import ApiError, error_body
from sgl_dspark.srt.entrypoints.http_limits import (
    ConnectionGuard,
    connection_limit,
    guarded_protocol,
    quiet_accept_errors,
    raise_open_file_limit,
)
from sgl_dspark.srt.entrypoints.lifecycle import (
    FLUSH_S,
    SHUTTING_DOWN,
    GracefulServer,
    Lifecycle,
)
from sgl_dspark.srt.entrypoints.native_serving import abort_request, generate
from sgl_dspark.srt.entrypoints.openai_serving import create_chat_completion, create_completion
from sgl_dspark.srt.entrypoints.request_group import (
    ClientDisconnected,
    RequestGroup,
    ServingContext,
    new_rid,
)
from sgl_dspark.srt.managers.io_struct import GenerateReqInput
from sgl_dspark.srt.managers.metrics import ServerMetrics
from sgl_dspark.srt.managers.scheduler_loop import SchedulerLoop
from sgl_dspark.srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sgl_dspark.srt.entrypoints.engine import Engine
    from sgl_dspark.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")
AUTH_EXEMPT_PATHS = frozenset({"/health", "/metrics"})
HEALTH_GENERATE_TIMEOUT_S = 30.0
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"
RETRY_AFTER_SHUTDOWN_S = 5.0

Handler = Callable[[ServingContext, Request], Awaitable[Response]]


class ApiMiddleware:
    """Pure ASGI middleware (never buffers or wraps `receive`, so streaming and disconnect
    detection are untouched): 503 while the server drains, the API-key check, and request
    counting per endpoint and status."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        metrics: ServerMetrics,
        lifecycle: Lifecycle,
        max_header_bytes: int,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        counted = path in GENERATION_ENDPOINTS
        # h11 bounds a head that arrives in pieces; this bounds one that arrived whole.
        head = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
        head += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > self.max_header_bytes:
            error = ApiError(
                431,
                f"the request line and headers have {head} bytes; at most "
                f"{self.max_header_bytes} are accepted (--max-header-bytes)",
                close=True,
            )
            await error.response()(scope, receive, send)
            return
        if self.lifecycle.shutting_down and path != "/metrics":
            if counted:
                self.metrics.count_request(path, 503)
            error = ApiError(503, SHUTTING_DOWN, retry_after=RETRY_AFTER_SHUTDOWN_S, close=True)
            await error.response()(scope, receive, send)
            return
        if self.api_key is not None and path not in AUTH_EXEMPT_PATHS:
            if not self._authorized(scope):
                if counted:
                    self.metrics.count_request(path, 401)
                response = JSONResponse(
                    error_body(
                        401,
                        "Incorrect API key provided: send 'Authorization: Bearer <key>' with "
                        "the server's --api-key",
                        code="invalid_api_key",
                    ),
                    status_code=401,
                )
                await response(scope, receive, send)
                return
        if not counted:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(path, int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)

    def _authorized(self, scope: Scope) -> bool:
        assert self.api_key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                return bearer_matches(value, self.api_key)
        return False


def bearer_matches(header: bytes, api_key: str) -> bool:
    """Whether an Authorization header value is `Bearer <api_key>`, compared in constant time
    (as bytes: a key or header with any characters compares without raising)."""
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(
        token.strip(), api_key.encode("utf-8")
    )


def _route(ctx: ServingContext, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Turn errors into OpenAI-style responses; an unexpected exception fails only this
    request (500) and is logged."""
    refused = ctx.refused_log

    async def route(request: Request) -> Response:
        try:
            return await handler(ctx, request)
        except ApiError as exc:
            if exc.status == 503:  # overload or shutdown: counted, logged at a bounded rate
                refused.note(f" (last: {request.url.path}: {exc.message})")
            elif exc.status >= 500:
                logger.error("%s: %s", request.url.path, exc.message)
            elif exc.status >= 400:
                request_id = _request_id(request)
                logger.info(
                    "request %s: %s %s -> %d (param %s): %s",
                    request_id,
                    request.method,
                    request.url.path,
                    exc.status,
                    exc.param,
                    exc.message[:300],
                )
                response = exc.response()
                response.headers["X-Request-Id"] = request_id
                return response
            return exc.response()
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:
            logger.exception("%s failed", request.url.path)
            return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    return route


def model_directory(server_args: ServerArgs) -> str | None:
    """The model's directory: --model-path, or for a built-in model its materialised Hugging
    Face directory (written once into the user cache; tools load its tokenizer from there)."""
    from sgl_dspark.srt.entrypoints.builtin_dirs import BUILTIN_MODELS, materialize

    if server_args.model_path in BUILTIN_MODELS:
        try:
            path = materialize(server_args.model_path, seed=server_args.random_seed)
        except OSError as exc:  # a read-only or full cache: serving works without it
            logger.warning(
                "could not write the built-in model's directory (%s); /model_info reports no "
                "tokenizer directory, so pass tools a tokenizer yourself (set SGL_DSPARK_CACHE "
                "to a writable directory)",
                exc,
            )
            return None
        logger.info("built-in model %r materialised at %s", server_args.model_path, path)
        return path
    return server_args.model_path


def _request_id(request: Request) -> str:
    """The client's X-Request-Id (bounded, printable) or a new id."""
    given = request.headers.get("x-request-id", "")
    if given and len(given) <= 128 and given.isprintable():
        return given
    return new_rid()


def create_app(server_args: ServerArgs, engine: Engine) -> FastAPI:
    """Build the app over `engine` (its scheduler, runner and tokenizer). The scheduler thread
    starts with the app's lifespan and stops when it ends."""
    spec = engine.spec
    spec_positions = spec.worker.gamma if spec is not None else 0
    metrics = ServerMetrics(str(server_args.served_model_name), spec_positions)
    loop = SchedulerLoop(
        engine.scheduler,
        engine.tokenizer,
        step_delay_s=server_args.debug_step_delay_ms / 1e3,
        spec_metrics=spec.metrics if spec is not None else None,
        max_queued=server_args.max_queued_requests,
        queue_timeout_s=server_args.queue_timeout,
    )
    ctx = ServingContext(
        args=server_args,
        loop=loop,
        metrics=metrics,
        has_tokenizer=engine.tokenizer is not None,
        vocab_size=engine.runner.model_cfg.vocab_size,
        model_dir=model_directory(server_args),
        model_type=engine.runner.model_cfg.model_type,
        architectures=tuple(engine.runner.model_cfg.architectures),
    )
    lifecycle = Lifecycle(ctx)
    loop.on_fatal = lifecycle.on_fatal

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start(asyncio.get_running_loop())
        watchdog = asyncio.create_task(lifecycle.watch(server_args.watchdog_timeout))
        try:
            yield
        finally:
            watchdog.cancel()
            # A scheduler that hung is not waited for long (its thread is a daemon).
            join_s = 2.0 if lifecycle.fatal_reason is not None else 30.0
            await asyncio.to_thread(loop.shutdown, join_s)

    app = FastAPI(
        title="sglang-dspark",
        version=sgl_dspark.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.ctx = ctx
    app.state.lifecycle = lifecycle
    for path, handler in (
        ("/v1/completions", create_completion),
        ("/v1/chat/completions", create_chat_completion),
        ("/generate", generate),
        ("/abort_request", abort_request),
    ):
        app.add_api_route(path, _route(ctx, handler), methods=["POST"])
    for path, handler in (
        ("/health", _health),
        ("/health_generate", _health_generate),
        ("/ready", _ready),
        ("/v1/models", _models),
        ("/v1/models/{model:path}", _model),
        ("/model_info", _model_info),
        ("/get_model_info", _model_info),
        ("/server_info", _server_info),
        ("/get_server_info", _server_info),
        ("/metrics", _metrics),
    ):
        app.add_api_route(path, _route(ctx, handler), methods=["GET"])
    app.add_api_route("/flush_cache", _route(ctx, _flush_cache), methods=["GET", "POST"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        request_id = _request_id(request)
        logger.info("request %s: %s -> %d", request_id, message, exc.status_code)
        return JSONResponse(
            error_body(exc.status_code, message),
            status_code=exc.status_code,
            headers={**(getattr(exc, "headers", None) or {}), "X-Request-Id": request_id},
        )

    app.add_middleware(
        ApiMiddleware,
        api_key=server_args.api_key,
        metrics=metrics,
        lifecycle=lifecycle,
        max_header_bytes=server_args.max_header_bytes,
    )
    return app


# ---- small routes -------------------------------------------------------------------------------
async def _health(ctx: ServingContext, request: Request) -> Response:
    return Response(status_code=200 if ctx.loop.is_alive else 503)


async def _health_generate(ctx: ServingContext, request: Request) -> Response:
    """200 once the scheduler completes a step after the probe arrived: a busy server answers
    as soon as its next step ends (the probe adds no work); an idle one generates one token
    for the probe. 503 when no step completes within HEALTH_GENERATE_TIMEOUT_S."""
    loop = ctx.loop
    if not loop.is_alive:
        raise ApiError(503, "the scheduler is not running")
    steps = loop.stats.total_steps
    group = None
    deadline = time.monotonic() + HEALTH_GENERATE_TIMEOUT_S
    try:
        while loop.stats.total_steps == steps:
            if time.monotonic() > deadline or not loop.is_alive:
                raise ApiError(
                    503, f"the scheduler completed no step within {HEALTH_GENERATE_TIMEOUT_S:g} s"
                )
            stats = loop.stats
            if group is None and stats.num_running_reqs + stats.num_waiting_reqs == 0:
                # Idle (or gone idle meanwhile): the probe's own token is the step to wait for.
                inp = GenerateReqInput(
                    rid=f"health-{new_rid()}",
                    input_ids=[0],
                    sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
                )
                group = RequestGroup(ctx, request, "/health_generate", [inp], "input_ids")
                group.submit()
            await asyncio.sleep(0.02)
    finally:
        if group is not None:
            group.abort_unfinished()
    return Response(status_code=200)


async def _ready(ctx: ServingContext, request: Request) -> Response:
    """200 once the model is loaded and the scheduler runs (SGLang's readiness probe; a
    draining server answers 503 from the middleware)."""
    if not ctx.loop.is_alive:
        raise ApiError(503, "the scheduler is not running")
    return JSONResponse({"status": "ready"})


async def _flush_cache(ctx: ServingContext, request: Request) -> Response:
    """SGLang's prefix-cache flush. KV pages are freed when each request ends, so nothing is
    cached across requests and there is nothing to flush."""
    return Response("Cache flushed (this server keeps no prefix cache).\n", status_code=200)


def _model_card(ctx: ServingContext) -> dict[str, Any]:
    args = ctx.args
    return {
        "id": args.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang-dspark",
        "root": ctx.model_dir or args.model_path,
        "max_model_len": args.context_length,
    }


async def _models(ctx: ServingContext, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(ctx)]})


async def _model(ctx: ServingContext, request: Request) -> Response:
    name = request.path_params["model"]
    if name != ctx.args.served_model_name:
        raise ApiError(
            404,
            f"The model '{name}' does not exist; this server serves '{ctx.args.served_model_name}'",
            param="model",
            code="model_not_found",
        )
    return JSONResponse(_model_card(ctx))


async def _model_info(ctx: ServingContext, request: Request) -> Response:
    """SGLang's model info. For a built-in model, `tokenizer_path` (and `model_dir`) is its
    materialised Hugging Face directory, which external tools load with `--tokenizer`."""
    args = ctx.args
    model_dir = ctx.model_dir or args.model_path
    return JSONResponse(
        {
            "model_path": args.model_path,
            "model_dir": model_dir,
            "tokenizer_path": args.tokenizer_path
            or (None if args.skip_tokenizer_init else model_dir),
            "served_model_name": args.served_model_name,
            "is_generation": True,
            "context_length": args.context_length,
            "vocab_size": ctx.vocab_size,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": ctx.model_type,
            "architectures": list(ctx.architectures),
        }
    )


async def _server_info(ctx: ServingContext, request: Request) -> Response:
    info: dict[str, Any] = dataclasses.asdict(ctx.args)
    if info.get("api_key") is not None:
        info["api_key"] = "<redacted>"
    stats = ctx.loop.stats
    info.update(
        dataclasses.asdict(stats),
        version=sgl_dspark.__version__,
        token_usage=stats.token_usage,
        max_total_num_tokens=stats.kv_total_pages * stats.page_size,
        # SGLang's per-scheduler states, read by its tools (bench_serving reads the mean
        # acceptance length from here; null without speculative decoding).
        internal_states=[
            {
                "avg_spec_accept_length": stats.spec_accept_length,
                "spec_accept_rate": stats.spec_accept_rate,
                "num_running_reqs": stats.num_running_reqs,
                "num_waiting_reqs": stats.num_waiting_reqs,
                "token_usage": stats.token_usage,
            }
        ],
    )
    return JSONResponse(info)


async def _metrics(ctx: ServingContext, request: Request) -> Response:
    return Response(ctx.metrics.render(ctx.loop.stats), media_type=CONTENT_TYPE_LATEST)


# ---- running ------------------------------------------------------------------------------------
def build_engine(server_args: ServerArgs) -> Engine:
    """The offline Engine configured from `server_args`."""
    from sgl_dspark.srt.entrypoints.engine import Engine

    return Engine.from_server_args(server_args)


def display_url(host: str, port: int) -> str:
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def build_server(server_args: ServerArgs, app: FastAPI) -> GracefulServer:
    """The uvicorn server of `app` with the client bounds of `http_limits` and the graceful
    shutdown of `lifecycle` (raises the open-file limit of the process first)."""
    open_files = raise_open_file_limit()
    guard = ConnectionGuard(
        max_connections=connection_limit(server_args.max_connections, open_files),
        client_timeout=server_args.client_timeout,
    )
    logger.info("open-file limit %d; at most %d connections", open_files, guard.max_connections)
    # uvicorn annotates the timeouts as int but only uses them as asyncio timeouts.
    flush: Any = FLUSH_S
    keep_alive: Any = server_args.keep_alive_timeout
    config = uvicorn.Config(
        app,
        http=guarded_protocol(guard),
        loop="asyncio",
        # asyncio accepts up to `backlog` connections per wake-up before any is refused: keep
        # that burst inside the descriptors left over by the connection limit.
        backlog=max(16, min(2048, open_files - guard.max_connections)),
        log_level=server_args.log_level,
        access_log=server_args.log_level == "debug",
        # The drain already waited for the requests: this only bounds writing the last bytes.
        timeout_graceful_shutdown=flush,
        timeout_keep_alive=keep_alive,
        h11_max_incomplete_event_size=server_args.max_header_bytes,
    )
    return GracefulServer(config, app.state.lifecycle, server_args.graceful_shutdown_timeout)


def run_server(server_args: ServerArgs, on_ready: Callable[[str], None] | None = None) -> int:
    """Load the model, bind the port and serve until SIGTERM/SIGINT. `on_ready(base_url)` is
    called once the server accepts requests. Returns the exit status: 0 after a signalled
    shutdown, 1 after a fatal error (`lifecycle`). Raises OSError when the port cannot be
    bound."""
    engine = build_engine(server_args)
    app = create_app(server_args, engine)
    family = socket.AF_INET6 if ":" in server_args.host else socket.AF_INET
    sock = socket.create_server((server_args.host, server_args.port), family=family)
    base_url = display_url(server_args.host, sock.getsockname()[1])
    server = build_server(server_args, app)

    async def serve() -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started and on_ready is not None:
            on_ready(base_url)
        await task

    # uvicorn re-raises a captured SIGTERM/SIGINT once it has shut down; route it to a handler
    # that only logs, so a signalled shutdown ends with a normal return (exit status 0).
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, _log_signal)
    try:
        asyncio.run(serve())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
        # With several ranks: releases them and waits for their exit (kills them when the
        # scheduler thread hung in a step, where they wait for it).
        engine.shutdown(scheduler_stuck=app.state.ctx.loop.thread_running)
    lifecycle: Lifecycle = app.state.lifecycle
    if lifecycle.fatal_reason is not None:
        logger.error("server shut down after a fatal error: %s", lifecycle.fatal_reason)
    else:
        logger.info("server shut down cleanly")
    return lifecycle.exit_status


def _log_signal(signum: int, frame: Any) -> None:
    logger.info("received %s after shutdown", signal.Signals(signum).name)
