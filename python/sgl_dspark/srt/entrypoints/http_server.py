"""The HTTP server: a FastAPI app over one `SchedulerLoop`, run by uvicorn.

Processes and threads: one process; the asyncio event loop (uvicorn + FastAPI) parses and
answers requests; one scheduler thread owns the model, the scheduler, the tokenizer and the
detokenizers (`managers/scheduler_loop.py`). Routes: OpenAI `/v1/completions`,
`/v1/chat/completions`, `/v1/models`; SGLang `/generate`, `/abort_request`, `/health`,
`/health_generate`, `/get_model_info`, `/get_server_info`; Prometheus `/metrics`. Every error is
an OpenAI-style `{"error": {"message", "type", "param", "code"}}` body.

Shutdown (SIGTERM/SIGINT): uvicorn stops accepting, waits up to --graceful-shutdown-timeout for
in-flight requests, cancels the rest (their requests are aborted), then the scheduler thread is
stopped and `run_server` returns.
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
_AUTH_EXEMPT_PREFIXES = ("/health", "/metrics")
HEALTH_GENERATE_TIMEOUT_S = 30.0
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"

Handler = Callable[[ServingContext, Request], Awaitable[Response]]


class ApiMiddleware:
    """Pure ASGI middleware (never buffers or wraps `receive`, so streaming and disconnect
    detection are untouched): API-key check and request counting per endpoint and status."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        counted = path in GENERATION_ENDPOINTS
        if self.api_key is not None and not path.startswith(_AUTH_EXEMPT_PREFIXES):
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
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    token.strip().encode(), self.api_key.encode()
                )
        return False


def _route(ctx: ServingContext, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Turn errors into OpenAI-style responses; an unexpected exception fails only this
    request (500) and is logged."""

    async def route(request: Request) -> Response:
        try:
            return await handler(ctx, request)
        except ApiError as exc:
            if exc.status >= 500:
                logger.error("%s: %s", request.url.path, exc.message)
            return exc.response()
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:
            logger.exception("%s failed", request.url.path)
            return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    return route


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
    )
    ctx = ServingContext(
        args=server_args,
        loop=loop,
        metrics=metrics,
        has_tokenizer=engine.tokenizer is not None,
        vocab_size=engine.runner.model_cfg.vocab_size,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(loop.shutdown)

    app = FastAPI(
        title="sglang-dspark",
        version=sgl_dspark.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.ctx = ctx
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
        ("/v1/models", _models),
        ("/get_model_info", _model_info),
        ("/get_server_info", _server_info),
        ("/metrics", _metrics),
    ):
        app.add_api_route(path, _route(ctx, handler), methods=["GET"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            error_body(exc.status_code, message),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    app.add_middleware(ApiMiddleware, api_key=server_args.api_key, metrics=metrics)
    return app


# ---- small routes -------------------------------------------------------------------------------
async def _health(ctx: ServingContext, request: Request) -> Response:
    return Response(status_code=200 if ctx.loop.is_alive else 503)


async def _health_generate(ctx: ServingContext, request: Request) -> Response:
    """Generate one token through the whole stack; 503 when that fails or takes too long."""
    inp = GenerateReqInput(
        rid=f"health-{new_rid()}",
        input_ids=[0],
        sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
    )
    group = RequestGroup(ctx, request, "/health_generate", [inp], "input_ids")

    async def run() -> None:
        async with group:
            await group.start()
            await group.collect()

    try:
        await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
    except (asyncio.TimeoutError, ApiError) as exc:
        raise ApiError(503, f"health generation failed: {exc or 'timed out'}") from None
    return Response(status_code=200)


async def _models(ctx: ServingContext, request: Request) -> Response:
    args = ctx.args
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": args.served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "sglang-dspark",
                    "root": args.model_path,
                    "max_model_len": args.context_length,
                }
            ],
        }
    )


async def _model_info(ctx: ServingContext, request: Request) -> Response:
    args = ctx.args
    return JSONResponse(
        {
            "model_path": args.model_path,
            "tokenizer_path": args.tokenizer_path
            or (None if args.skip_tokenizer_init else args.model_path),
            "served_model_name": args.served_model_name,
            "is_generation": True,
            "context_length": args.context_length,
            "vocab_size": ctx.vocab_size,
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


def run_server(server_args: ServerArgs, on_ready: Callable[[str], None] | None = None) -> None:
    """Load the model, bind the port and serve until SIGTERM/SIGINT. `on_ready(base_url)` is
    called once the server accepts requests. Raises OSError when the port cannot be bound."""
    engine = build_engine(server_args)
    app = create_app(server_args, engine)
    family = socket.AF_INET6 if ":" in server_args.host else socket.AF_INET
    sock = socket.create_server((server_args.host, server_args.port), family=family)
    base_url = display_url(server_args.host, sock.getsockname()[1])
    # uvicorn annotates the grace period as int but only uses it as an asyncio timeout.
    grace: Any = server_args.graceful_shutdown_timeout
    config = uvicorn.Config(
        app,
        log_level=server_args.log_level,
        access_log=server_args.log_level == "debug",
        timeout_graceful_shutdown=grace,
    )
    server = uvicorn.Server(config)

    async def serve() -> None:
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
        engine.shutdown()  # with several ranks: releases them and waits for their exit
    logger.info("server shut down cleanly")


def _log_signal(signum: int, frame: Any) -> None:
    logger.info("received %s after shutdown", signal.Signals(signum).name)
