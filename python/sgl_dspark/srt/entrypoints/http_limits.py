"""Bounds on what one HTTP client can hold: connections, time, bytes.

- Connections: at most `max_connections` open at once (capped below the open-file limit, which
  `raise_open_file_limit` raises at start where the OS allows). A connection past the limit is
  answered `503` with `Retry-After` and closed at once, so the server never runs out of file
  descriptors; refusals are logged at a bounded rate (`RateLimitedLog`), never one line each.
- Time: a client must send a complete request head within `client_timeout` of its first byte
  (or of connecting), and its body within `client_timeout` (`read_body`); a streamed response
  whose client stops reading for `client_timeout` is cut; an idle keep-alive connection closes
  after `keep_alive_timeout` (uvicorn's).
- Bytes: request line + headers at most `max_header_bytes` (h11's limit; 400 past it), body at
  most `max_request_body_bytes` (413).
- Latency: TCP_NODELAY on every accepted socket (a listening socket made by
  `socket.create_server` has protocol 0, so asyncio does not set it, and a keep-alive response
  written in two parts would wait for the client's delayed ACK).

The protocol is uvicorn's h11 implementation with these hooks (`guarded_protocol`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import h11
from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from sgl_dspark.srt.entrypoints.api_errors import ApiError

logger = logging.getLogger(__name__)

# File descriptors kept free of client connections: the model's files, logs, pipes, and the
# connections asyncio accepts in one burst before they are refused.
MIN_FD_RESERVE = 64
OPEN_FILE_TARGET = 65535  # the soft limit asked for at start (as SGLang does)
REFUSED_LOG_INTERVAL_S = 10.0
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
)
_REFUSED_BODY = (
    b'{"error": {"message": "too many open connections (--max-connections); retry later", '
    b'"type": "server_error", "param": null, "code": "503"}}'
)
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


class RateLimitedLog:
    """Counts an event and logs it at most once per `interval_s` (the first one at once), with
    how many happened since the last line."""

    def __init__(self, message: str, interval_s: float = REFUSED_LOG_INTERVAL_S) -> None:
        self.message = message
        self.interval_s = interval_s
        self.count = 0  # since the last line
        self.total = 0
        self._last = -float("inf")

    def note(self, detail: str = "") -> None:
        self.count += 1
        self.total += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            logger.warning(
                "%s: %d since the last report, %d in all%s",
                self.message,
                self.count,
                self.total,
                detail,
            )
            self._last = now
            self.count = 0


@dataclass
class ConnectionGuard:
    """The limits every connection of one server shares."""

    max_connections: int
    client_timeout: float
    refused: RateLimitedLog = field(
        default_factory=lambda: RateLimitedLog("refused connections past --max-connections")
    )
    stalled: RateLimitedLog = field(
        default_factory=lambda: RateLimitedLog("closed connections of slow clients")
    )


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the peer is already gone
            pass


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol bound to `guard` (pass it as `uvicorn.Config(http=...)`)."""

    class GuardedH11Protocol(H11Protocol):
        _refused = False
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            set_nodelay(transport)
            if len(self.connections) >= guard.max_connections:
                self._refused = True
                transport.write(_REFUSED % (len(_REFUSED_BODY), _REFUSED_BODY))
                transport.close()
                guard.refused.note(f" (limit {guard.max_connections})")
                return
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._cancel_timers()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm_head_timer()  # (the rest of) a request head is still to come
            elif self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(guard.client_timeout, self._cut_reader)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:  # measured from the first byte, not the latest one
                self._head_timer = self.loop.call_later(guard.client_timeout, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(_TIMED_OUT)
                self.transport.close()
                guard.stalled.note(" (no complete request head within --client-timeout)")

        def _cut_reader(self) -> None:
            self._write_timer = None
            if not self.transport.is_closing():
                self.transport.abort()
                guard.stalled.note(" (a response unread for --client-timeout)")

        def _cancel_timers(self) -> None:
            for timer in (self._head_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            self._head_timer = self._write_timer = None

    return GuardedH11Protocol


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The request body: 413 past `max_bytes` (checked on Content-Length first), 408 when it
    does not arrive within `timeout`; a client that hangs up raises starlette's
    `ClientDisconnect`."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise _too_large(int(length), max_bytes)
    chunks: list[bytes] = []
    size = 0

    async def collect() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(size, max_bytes)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout:g} s (--client-timeout)",
            close=True,
        ) from None
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body has {size} bytes or more; at most {limit} are accepted "
        "(--max-request-body-bytes)",
        close=True,
    )


def raise_open_file_limit(target: int = OPEN_FILE_TARGET) -> int:
    """Raise the soft open-file limit towards `target` (never above the hard limit); returns
    the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, want, exc)
    return soft if soft != resource.RLIM_INFINITY else target


def connection_limit(requested: int, open_files: int) -> int:
    """`requested` connections, or fewer so that a reserve of descriptors stays free."""
    reserve = max(MIN_FD_RESERVE, open_files // 4)
    allowed = max(1, open_files - reserve)
    if requested > allowed:
        logger.warning(
            "--max-connections %d is more than the open-file limit %d allows; using %d",
            requested,
            open_files,
            allowed,
        )
    return min(requested, allowed)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log asyncio's "out of system resource" accept errors (which it repeats every second
    while descriptors are exhausted) at a bounded rate and without a traceback."""
    accept_failed = RateLimitedLog("accept() failed: out of file descriptors or memory")
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            accept_failed.note(f" ({context.get('exception')})")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
