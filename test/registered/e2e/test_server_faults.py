"""Failure isolation, in-process (so faults can be injected): an internal error in one request
fails that request with 500 and an OpenAI-style body that carries no path and no traceback; the
other requests, and later ones, produce exactly what they produce alone, and no KV page leaks.
Also in-process: TCP_NODELAY on the accepted sockets, and no request field that makes the
server open a file the client names."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time

import httpx
import pytest
import torch
from sgl_dspark.srt.entrypoints.http_server import build_engine, build_server, create_app
from sgl_dspark.srt.server_args import ServerArgs


class InProcessServer:
    def __init__(self) -> None:
        self.args = ServerArgs(
            model_path="tiny", context_length=256, max_total_tokens=4096, log_level="warning"
        ).resolved()
        self.engine = build_engine(self.args)
        self.app = create_app(self.args, self.engine)
        sock = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = build_server(self.args, self.app)  # the server's own protocol and limits
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    @property
    def stats(self):
        return self.app.state.ctx.loop.stats

    def wait_idle(self) -> None:
        deadline = time.monotonic() + 30
        while self.stats.num_running_reqs or self.stats.num_waiting_reqs:
            assert time.monotonic() < deadline, self.stats
            time.sleep(0.02)
        assert self.stats.kv_free_pages == self.stats.kv_total_pages

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert not self.app.state.ctx.loop.is_alive


@pytest.fixture(scope="module")
def srv():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = InProcessServer()
    yield server
    server.stop()
    torch.set_num_threads(threads)


def _completion(prompt: str, max_tokens: int = 10, **kw) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **kw,
    }


async def _post(client: httpx.AsyncClient, body: dict) -> tuple[int, dict]:
    r = await client.post("/v1/completions", json=body)
    return r.status_code, r.json()


async def _stream(
    client: httpx.AsyncClient,
    body: dict,
    started: asyncio.Event | None = None,
) -> list[dict]:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None:
                    started.set()
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _assert_500(status: int, body: dict, needle: str) -> None:
    assert status == 500, body
    assert body["error"]["type"] == "server_error" and needle in body["error"]["message"], body


GOOD = [_completion(f"good {i}", 8 + i) for i in range(4)]


def _solo(srv: InProcessServer, bodies: list[dict] = GOOD) -> list[str]:
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        return [client.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]


def test_tokenizer_failure_fails_only_that_request(srv, monkeypatch):
    alone = _solo(srv)
    tokenizer = srv.engine.tokenizer
    real_encode = tokenizer.encode

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if "BOOM" in text:
            raise RuntimeError("tokenizer exploded")
        return real_encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", encode)

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            return await asyncio.gather(
                _post(client, _completion("BOOM now")), *(_post(client, b) for b in GOOD)
            )

    (status, body), *good = asyncio.run(run())
    _assert_500(status, body, "tokenizer exploded")
    assert [b["choices"][0]["text"] for _, b in good] == alone
    srv.wait_idle()


def test_transient_forward_failure_is_retried_and_fails_nobody(srv, monkeypatch):
    """One step raises once: its requests are retried one by one and produce exactly what they
    produce alone."""
    alone = _solo(srv)
    runner = srv.engine.runner
    real_forward = runner.forward
    armed = threading.Event()

    def forward(*args, **kwargs):
        if armed.is_set():
            armed.clear()  # fail exactly one step, after its KV pages were reserved
            raise RuntimeError("injected forward failure")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", forward)

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            started = asyncio.Event()
            stream = asyncio.create_task(_stream(client, GOOD[0] | {"max_tokens": 40}, started))
            plain = asyncio.create_task(_post(client, GOOD[1] | {"max_tokens": 40}))
            await started.wait()
            while srv.stats.num_running_reqs < 2:  # both in the batch
                await asyncio.sleep(0.01)
            armed.set()
            return await asyncio.gather(stream, plain)

    long_alone = _solo(srv, [GOOD[0] | {"max_tokens": 40}, GOOD[1] | {"max_tokens": 40}])
    events, (status, body) = asyncio.run(run())
    assert not armed.is_set(), "the failure was never injected"
    assert "".join(e["choices"][0]["text"] for e in events) == long_alone[0]
    assert status == 200 and body["choices"][0]["text"] == long_alone[1]
    assert _solo(srv) == alone
    srv.wait_idle()


def test_forward_failure_attributed_to_one_request_fails_it_alone(srv, monkeypatch):
    """Every step holding one request raises: that request fails (500), its batch-mates
    finish with exactly their solo outputs, and no page leaks."""
    alone = _solo(srv)
    runner = srv.engine.runner
    scheduler = srv.engine.scheduler
    real_forward = runner.forward
    poison_ids = srv.engine.tokenizer.encode("poison pill")

    def forward(batch, *args, **kwargs):
        slots = set(batch.req_pool_indices.tolist())
        if any(r.prompt_ids == poison_ids and r.slot in slots for r in scheduler.running.values()):
            raise RuntimeError("injected fault of one request at /opt/models/secret.bin")
        return real_forward(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "forward", forward)

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            started = asyncio.Event()
            stream = asyncio.create_task(_stream(client, GOOD[0], started))
            await started.wait()
            return await asyncio.gather(
                stream,
                _post(client, _completion("poison pill", 30)),
                *(_post(client, b) for b in GOOD[1:]),
            )

    events, (status, body), *good = asyncio.run(run())
    _assert_500(status, body, "injected fault of one request")
    assert "/opt/models" not in json.dumps(body) and "<path>" in body["error"]["message"]
    assert "".join(e["choices"][0]["text"] for e in events) == alone[0]
    assert [b["choices"][0]["text"] for _, b in good] == alone[1:]
    srv.wait_idle()


def test_output_failure_fails_only_that_request(srv, monkeypatch):
    """Decoding token strings (asked for by logprobs) breaks: only the logprob request fails."""
    alone = _solo(srv)
    tokenizer = srv.engine.tokenizer
    real_decode = tokenizer.decode

    def decode(ids, skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            raise RuntimeError("decoder exploded")
        return real_decode(ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", decode)

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            return await asyncio.gather(
                _post(client, _completion("lp", 30, logprobs=0)), *(_post(client, b) for b in GOOD)
            )

    (status, body), *good = asyncio.run(run())
    _assert_500(status, body, "decoder exploded")
    assert [b["choices"][0]["text"] for _, b in good] == alone
    srv.wait_idle()
    with httpx.Client(base_url=srv.base_url) as client:
        assert client.get("/health").status_code == 200


def test_scheduler_loop_bug_fails_inflight_requests_and_loop_survives(srv, monkeypatch):
    alone = _solo(srv)
    loop = srv.app.state.ctx.loop
    real_snapshot = loop._snapshot
    armed = threading.Event()

    def snapshot():
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected loop bug")
        return real_snapshot()

    monkeypatch.setattr(loop, "_snapshot", snapshot)

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            victim = asyncio.create_task(_post(client, _completion("victim", 200)))
            while srv.stats.num_running_reqs < 1:
                await asyncio.sleep(0.01)
            armed.set()
            status, body = await victim
            after = await asyncio.gather(*(_post(client, b) for b in GOOD))
            return status, body, after

    status, body, after = asyncio.run(run())
    _assert_500(status, body, "injected loop bug")
    assert [b["choices"][0]["text"] for _, b in after] == alone
    assert loop.is_alive
    srv.wait_idle()


def test_tokenizer_error_with_paths_and_a_traceback_is_redacted(srv, monkeypatch):
    tokenizer = srv.engine.tokenizer
    real_encode = tokenizer.encode

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if "LEAK" in text:
            raise FileNotFoundError(
                "cannot read /home/ops/models/tokenizer.json\n"
                'Traceback (most recent call last):\n  File "/srv/app.py", line 1'
            )
        return real_encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", encode)
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        r = client.post("/v1/completions", json=_completion("LEAK"))
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "FileNotFoundError" in message and "<path>" in message
    for leak in ("/home/ops", "/srv/app.py", "Traceback", "line 1"):
        assert leak not in r.text, r.text
    srv.wait_idle()


def test_accepted_sockets_have_tcp_nodelay(srv):
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        assert client.get("/v1/models").status_code == 200
        connections = list(srv.server.server_state.connections)
        assert connections
        for conn in connections:
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


_OPENED: list[str] = []
_RECORDING = threading.Event()


def _record_opens(event: str, args: tuple) -> None:
    if _RECORDING.is_set() and event == "open" and isinstance(args[0], (str, bytes)):
        _OPENED.append(str(args[0]))


def test_no_request_field_opens_a_file_the_client_names(srv, tmp_path):
    """Every string field of every route carries a path to an existing file (and SGLang's
    path-taking fields are sent too): the process never opens it."""
    target = tmp_path / "client-chosen.json"
    target.write_text('{"chat_template": "x"}')
    path = str(target)
    bodies = [
        ("/v1/completions", _completion(path, model=path, user=path, stop=[path], suffix=path)),
        ("/v1/completions", _completion(path, lora_path=path)),
        (
            "/v1/chat/completions",
            {
                "model": path,
                "messages": [{"role": "user", "content": path, "name": path}],
                "max_tokens": 2,
                "user": path,
                "stop": path,
            },
        ),
        ("/v1/chat/completions", {"model": "tiny", "messages": [], "chat_template": path}),
        ("/generate", {"text": path, "rid": path, "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": path, "sampling_params": {"stop": [path], "max_new_tokens": 2}}),
        ("/generate", {"text": "x", "lora_path": path, "custom_logit_processor": path}),
        ("/generate", {"input_ids": [0, 9], "sampling_params": {"json_schema": path}}),
        ("/abort_request", {"rid": path}),
    ]
    sys.addaudithook(_record_opens)  # audit hooks cannot be removed: it records only when asked
    _RECORDING.set()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as client:
            statuses = [client.post(p, json=b).status_code for p, b in bodies]
        opened_by_requests = list(_OPENED)
        target.read_text()  # the hook sees an open of the file: the check can fail
    finally:
        _RECORDING.clear()
    assert all(s < 500 for s in statuses), statuses
    assert 200 in statuses and 400 in statuses
    assert [p for p in _OPENED if target.name in p], "the audit hook saw no open"
    assert not [p for p in opened_by_requests if target.name in p], opened_by_requests
    srv.wait_idle()
