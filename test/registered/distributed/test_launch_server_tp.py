"""`python -m sgl_dspark.launch_server --tp-size 2 --device cpu`: the server spawns its second
rank, answers /generate with the same greedy text as the single-process server, shuts down
cleanly, and exits with a clear error when a rank dies instead of hanging."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from server_fixture import launch, running_server  # noqa: E402

BODIES = [
    {"text": "Hello there", "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
    {"input_ids": [50, 60, 70, 80, 90], "sampling_params": {"max_new_tokens": 9, "temperature": 0}},
]
FLAGS = ("--device", "cpu", "--max-total-tokens", "2048", "--context-length", "256")


def _answers(base_url: str) -> list[tuple[str, list[int]]]:
    out = []
    for body in BODIES:
        r = httpx.post(f"{base_url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        out.append((data["text"], data["output_ids"]))
    return out


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def test_tp2_server_answers_like_one_process(tmp_path: Path) -> None:
    with running_server(tmp_path / "one.log", *FLAGS) as server:
        expected = _answers(server.base_url)
    with running_server(tmp_path / "tp2.log", *FLAGS, "--tp-size", "2") as server:
        assert _answers(server.base_url) == expected
        assert any(t for t, _ in expected)  # some text came back


@pytest.mark.parametrize("busy", [False, True])
def test_a_dead_rank_takes_the_server_down_with_a_clear_error(tmp_path: Path, busy: bool) -> None:
    server = launch(tmp_path / "dies.log", *FLAGS, "--tp", "2", "--ep-size", "2")
    client = None
    try:
        if busy:  # a request is decoding when the rank dies: the ranks are mid-step
            body = {"input_ids": [50, 60], "sampling_params": {"max_new_tokens": 200}}
            client = threading.Thread(target=_post_quietly, args=(server.base_url, body))
            client.start()
            deadline = time.monotonic() + 60
            while server.info()["num_running_reqs"] == 0:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.05)
        ranks = [
            k
            for k in _children(server.proc.pid)
            if "multiprocessing.spawn" in _cmdline(k) and "resource_tracker" not in _cmdline(k)
        ]
        assert len(ranks) == 1, [_cmdline(k) for k in _children(server.proc.pid)]
        os.kill(ranks[0], signal.SIGKILL)
        status = server.proc.wait(60)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    if client is not None:
        client.join(60)
        assert not client.is_alive(), "the client still waits on a dead server"
    assert status != 0
    assert "exited (code -9) while serving" in server.log(), server.log()[-3000:]


def _post_quietly(base_url: str, body: dict) -> None:
    """POST that expects to lose its server (any answer or connection error is fine)."""
    try:
        httpx.post(f"{base_url}/generate", json=body, timeout=120)
    except httpx.HTTPError:
        pass


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
