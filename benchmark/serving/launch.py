"""Start a server from a shell command, wait until it is healthy, stop it and its children."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import httpx

logger = logging.getLogger(__name__)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n_chars:]
    except OSError as exc:
        return f"<log unreadable: {exc}>"


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in group `pgid`.

    Orphaned children are reaped by PID 1, which can take seconds; a zombie holds no port or
    memory, so it counts as gone. Falls back to signal 0 where /proc is unavailable.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # Fields after the parenthesised command name: state, ppid, pgrp, ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process vanished while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class ServerProcess:
    """A server launched with `command` (a shell string, run in its own process group).

    Use as a context manager: entering starts the process and blocks until GET `health_path`
    returns 200; leaving sends SIGTERM to the group, then SIGKILL after `stop_timeout_s`.
    Raises RuntimeError when the process exits early or is not healthy within `ready_timeout_s`,
    with the tail of its log in the message.
    """

    def __init__(
        self,
        command: str,
        base_url: str,
        log_path: str | Path,
        cwd: str | Path | None = None,
        env: dict[str, str] | None = None,
        health_path: str = "/health",
        ready_timeout_s: float = 600.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.command = command
        self.base_url = base_url.rstrip("/")
        self.log_path = Path(log_path)
        self.cwd = cwd
        self.env = env
        self.health_path = health_path
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_after_s = float("nan")

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        t0 = time.perf_counter()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                shell=True,
                cwd=self.cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        logger.info("started pid %d: %s", self.proc.pid, self.command)
        deadline = t0 + self.ready_timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"server exited with code {code} before becoming healthy: {self.command}\n"
                        f"--- log tail ({self.log_path}) ---\n{_tail(self.log_path)}"
                    )
                try:
                    if client.get(self.base_url + self.health_path).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass  # not listening yet: keep polling until the deadline
                if time.perf_counter() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"server not healthy after {self.ready_timeout_s:.0f} s: {self.command}\n"
                        f"--- log tail ({self.log_path}) ---\n{_tail(self.log_path)}"
                    )
                time.sleep(0.05)
        self.ready_after_s = time.perf_counter() - t0

    def stop(self) -> None:
        """Terminates the whole process group (children included) and waits until it is gone."""
        if self.proc is None:
            return
        # start_new_session made the shell the leader of a group whose id is its pid; children
        # stay in that group even after the shell itself has exited.
        pgid = self.proc.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.perf_counter() + self.stop_timeout_s
            while time.perf_counter() < deadline and _group_alive(pgid):
                self.proc.poll()  # reap the shell so it does not linger as a zombie
                time.sleep(0.02)
            if not _group_alive(pgid):
                break
            logger.warning("process group %d ignored SIGTERM; killing", pgid)
        self.proc.wait()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
