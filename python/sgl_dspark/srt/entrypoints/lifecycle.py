"""How the server ends: graceful shutdown, the watchdog, and a scheduler that dies.

Graceful shutdown (SIGTERM / SIGINT, `GracefulServer.handle_exit`): the server keeps accepting
connections but answers every new request 503 with `Retry-After` and `Connection: close`
(`/health` too, so a load balancer takes it out of rotation); requests in flight continue for up
to `--graceful-shutdown-timeout` seconds; those still running then end with a 503 error (an error
event and `[DONE]` on a stream); then uvicorn closes the connections and the process exits 0. No
task is cancelled, so nothing logs a traceback. A second signal forces the exit.

Fatal errors: when the scheduler thread dies (or its loop keeps failing) it has already failed
every request; when it stops making progress for `--watchdog-timeout` seconds while it has work
(a hung device step), the watchdog fails every request from the HTTP side. Either way the server
then shuts down as above with no grace period and the process exits with status 1, so whatever
supervises it restarts it instead of leaving it hanging. The watchdog counts its own ticks, so a
process stopped with SIGSTOP is not mistaken for a hang once it continues.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from sgl_dspark.srt.entrypoints.request_group import ServingContext

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down"
WATCHDOG_TICK_S = 1.0
# After the grace period: how long the ended requests get to write their error responses.
FLUSH_S = 5.0
_POLL_S = 0.05


class Lifecycle:
    """Shutdown state of one server: drain, fatal errors, the exit status."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.fatal_reason: str | None = None
        self.shutting_down = False
        self._server: uvicorn.Server | None = None

    @property
    def exit_status(self) -> int:
        return 0 if self.fatal_reason is None else 1

    def attach(self, server: uvicorn.Server) -> None:
        self._server = server

    # ---- triggers (on the event loop) -----------------------------------------------------------
    def on_fatal(self, reason: str) -> None:
        """The scheduler cannot go on: fail what is left and shut down with exit status 1."""
        if self.fatal_reason is None:
            self.fatal_reason = reason
            logger.critical("fatal: %s; shutting down", reason)
        for group in list(self.ctx.active):
            group.fail(503, f"{SHUTTING_DOWN} (internal error)")
        self.begin_shutdown(0.0)

    def begin_shutdown(self, grace_s: float) -> None:
        if not self.shutting_down:
            self.shutting_down = True
            asyncio.get_running_loop().create_task(self._shutdown(grace_s))

    async def _shutdown(self, grace_s: float) -> None:
        loop, active = self.ctx.loop, self.ctx.active
        loop.begin_drain()
        if active:
            logger.info("shutting down: %d requests in flight get %g s", len(active), grace_s)
        await _wait_until(lambda: not active, grace_s)
        if active:
            logger.warning("ending %d requests in flight with an error", len(active))
            loop.fail_all(503, SHUTTING_DOWN)
            await _wait_until(lambda: not active, FLUSH_S / 2)
            for group in list(active):  # the scheduler did not answer: end them from here
                group.fail(503, SHUTTING_DOWN)
            await _wait_until(lambda: not active, FLUSH_S / 2)
        if self._server is not None:
            self._server.should_exit = True

    # ---- the watchdog ---------------------------------------------------------------------------
    async def watch(self, timeout_s: float) -> None:
        """Run until cancelled; `on_fatal` when the scheduler has work but completes no loop
        iteration for `timeout_s` (counted in ticks of the event loop)."""
        loop = self.ctx.loop
        last, stalled = loop.iterations, 0
        while True:
            await asyncio.sleep(WATCHDOG_TICK_S)
            stats = loop.stats
            busy = stats.num_running_reqs + stats.num_waiting_reqs > 0
            if loop.iterations != last or not busy or not loop.is_alive:
                last, stalled = loop.iterations, 0
                continue
            stalled += 1
            if stalled * WATCHDOG_TICK_S >= timeout_s:
                self.on_fatal(
                    f"the scheduler made no progress for {timeout_s:g} s with "
                    f"{stats.num_running_reqs} running requests (--watchdog-timeout)"
                )
                return


async def _wait_until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the graceful shutdown of the module doc."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace_s: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        lifecycle.attach(self)

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.shutting_down or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal, or before startup: exit now
            if self.lifecycle.shutting_down:
                self.force_exit = True
            return
        self._captured_signals.append(sig)
        logger.info("received %s: shutting down gracefully", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self.lifecycle.begin_shutdown, self.grace_s)
