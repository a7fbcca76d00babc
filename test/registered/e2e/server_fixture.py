"""Start the real server (`python -m sgl_dspark.launch_server`) as a subprocess for e2e tests.

The server binds port 0; its ready line (with the curl example) tells us the URL. Stopping sends
SIGTERM and returns the exit status, which must be 0 for a clean shutdown.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

READY_PATTERN = re.compile(r"The server is ready\. Serving '[^']*' at (http://\S+)")
CURL_PATTERN = re.compile(r"^\s+(curl .+)$", re.MULTILINE)
STARTUP_TIMEOUT_S = 120.0


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, log_path: Path, base_url: str) -> None:
        self.proc = proc
        self.log_path = log_path
        self.base_url = base_url
        self.auth_headers: dict[str, str] = {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def curl_line(self) -> str:
        match = CURL_PATTERN.search(self.log())
        assert match, f"no curl line in the server output:\n{self.log()[-3000:]}"
        return match.group(1)

    def info(self) -> dict:
        return httpx.get(
            f"{self.base_url}/get_server_info", headers=self.auth_headers, timeout=30
        ).json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll /get_server_info until nothing runs or waits; return that info."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                return info
            assert time.monotonic() < deadline, f"server not idle after {timeout} s: {info}"
            time.sleep(0.1)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait, return the exit status (kills and fails after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"server ignored SIGTERM for {timeout} s:\n{self.log()[-3000:]}"
            ) from None


def server_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        env["OMP_NUM_THREADS"] = "1"  # one core per xdist worker
    return env


def launch(log_path: Path, *args: str, api_key: str | None = None) -> ServerProcess:
    """Start the tiny-model server with extra CLI `args`; return once /health answers 200."""
    cmd = [
        sys.executable,
        "-m",
        "sgl_dspark.launch_server",
        "--model-path",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *args,
    ]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env())
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    base_url = None
    while base_url is None:
        if proc.poll() is not None:
            raise AssertionError(
                f"server exited with {proc.returncode} during startup "
                f"({shlex.join(cmd)}):\n{log_path.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server not ready after {STARTUP_TIMEOUT_S} s")
        match = READY_PATTERN.search(log_path.read_text(errors="replace"))
        base_url = match.group(1) if match else None
        time.sleep(0.1)
    server = ServerProcess(proc, log_path, base_url)
    if api_key is not None:
        server.auth_headers = {"Authorization": f"Bearer {api_key}"}
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200
    return server


@contextlib.contextmanager
def running_server(
    log_path: Path,
    *args: str,
    api_key: str | None = None,
) -> Iterator[ServerProcess]:
    """`launch`, yield, then stop with SIGTERM and assert a clean exit (status 0 and the
    shutdown log line)."""
    server = launch(log_path, *args, api_key=api_key)
    try:
        yield server
    finally:
        status = server.stop()
        log = server.log()
        assert status == 0, f"server exited with {status}:\n{log[-3000:]}"
        assert "server shut down cleanly" in log, log[-3000:]
