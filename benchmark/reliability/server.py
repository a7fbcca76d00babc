"""A server under test: `python -m sgl_dspark.launch_server` (or the fault-injecting wrapper) as a
subprocess on a free port, with its log, pool state, RSS and exit status at hand."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

READY = re.compile(r"The server is ready\. Serving '[^']*' at (http://\S+)")
STARTUP_TIMEOUT_S = 180.0
# Lines a clean server never logs: a traceback, or one line per refused connection.
TRACEBACK = "Traceback (most recent call last)"
FD_EXHAUSTED = "Too many open files"


class ServerUnderTest:
    def __init__(
        self,
        log_path: Path,
        args: Sequence[str] = (),
        module: str = "sgl_dspark.launch_server",
        module_args: Sequence[str] = (),
        open_files: int | None = None,
    ) -> None:
        """Start `python -m module [module_args] --model-path tiny --port 0 [args]`; with
        `open_files`, the process runs under that open-file limit (soft and hard)."""
        self.log_path = log_path
        cmd = [sys.executable, "-m", module, *module_args, "--model-path", "tiny"]
        cmd += ["--host", "127.0.0.1", "--port", "0", *args]
        self.cmd = cmd
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if os.environ.get("PYTEST_XDIST_WORKER"):
            env["OMP_NUM_THREADS"] = "1"
        preexec: Callable[[], None] | None = None
        if open_files is not None:
            limit = open_files

            def preexec() -> None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec
            )
        self.base_url = self._wait_ready()
        host, port = self.base_url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S:g} s")
            match = READY.search(self.log())
            if match:
                return match.group(1)
            time.sleep(0.1)

    # ---- state ----------------------------------------------------------------------------------
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        return self.log()[-chars:]

    def count(self, needle: str) -> int:
        return self.log().count(needle)

    def info(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        r = httpx.get(f"{self.base_url}/get_server_info", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """/get_server_info once nothing runs or waits."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout_s:g} s: {info}")
            time.sleep(0.1)

    def pool_is_full(self, info: dict[str, Any]) -> bool:
        """Every KV page and request slot back (the pool as it was at start)."""
        return info["kv_free_pages"] == info["kv_total_pages"] and (
            info["free_req_slots"] == info["max_running_requests"]
        )

    def rss_mib(self) -> float:
        """Resident set size of the server process."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc")

    # ---- signals --------------------------------------------------------------------------------
    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"server did not exit within {timeout_s:g} s:\n{self.tail()}"
            ) from None

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (unless already gone) and the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout_s)

    def __enter__(self) -> ServerUnderTest:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
