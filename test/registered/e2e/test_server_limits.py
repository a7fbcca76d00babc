"""Bounds and security defaults of the HTTP server, against a real server process with small
limits: body and header size, slow and idle clients, keep-alive, the connection limit, the queue
limit and queue timeout (503 + Retry-After), /health_generate under load, and which routes the
API key protects."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from server_fixture import running_server

API_KEY = "sk-limits"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_LIMIT = 4096
CLIENT_TIMEOUT = 2.0
KEEP_ALIVE = 1.0
MAX_CONNECTIONS = 12
MAX_RUNNING = 2
MAX_QUEUED = 3
QUEUE_TIMEOUT = 2.0
STEP_DELAY_MS = 10  # every step takes >= 10 ms, so long requests last seconds on any box


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("limits") / "server.log"
    args = {
        "--context-length": 512,
        "--max-total-tokens": 8192,
        "--max-request-body-bytes": BODY_LIMIT,
        "--max-header-bytes": 2048,
        "--client-timeout": CLIENT_TIMEOUT,
        "--keep-alive-timeout": KEEP_ALIVE,
        "--max-connections": MAX_CONNECTIONS,
        "--max-running-requests": MAX_RUNNING,
        "--max-queued-requests": MAX_QUEUED,
        "--queue-timeout": QUEUE_TIMEOUT,
        "--debug-step-delay-ms": STEP_DELAY_MS,
    }
    flat = [str(x) for kv in args.items() for x in kv]
    with running_server(log, *flat, api_key=API_KEY) as srv:
        yield srv


def _connect(server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server writes until it closes the connection, and when that was."""
    start = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def _body(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def _gen(tokens: int, **kw) -> dict:
    return {"text": "x", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}, **kw}


def test_request_body_larger_than_the_limit_is_413(server):
    big = {"text": "x" * BODY_LIMIT}
    r = httpx.post(f"{server.base_url}/generate", json=big, headers=AUTH, timeout=30)
    assert r.status_code == 413, r.text
    assert "--max-request-body-bytes" in r.json()["error"]["message"]
    assert r.headers["connection"] == "close"

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(BODY_LIMIT // 512 + 2):
            yield b" " * 512

    r = httpx.post(f"{server.base_url}/generate", content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413


def test_headers_larger_than_the_limit_are_refused(server):
    r = httpx.get(f"{server.base_url}/health", headers={"X-Big": "y" * 4096}, timeout=30)
    assert r.status_code == 431 and "--max-header-bytes" in r.json()["error"]["message"]
    sock = _connect(server)  # the same head arriving in pieces: h11's limit
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    for _ in range(3):
        sock.sendall(b"X-Big: " + b"y" * 1000 + b"\r\n")
        time.sleep(0.05)
    raw, _ = _read_until_closed(sock, 10)
    assert _status(raw) == 400
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200


def test_slow_request_head_and_body_time_out(server):
    sock = _connect(server)  # a head that never completes (slowloris)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
    raw, waited = _read_until_closed(sock, CLIENT_TIMEOUT + 10)
    assert _status(raw) == 408 and CLIENT_TIMEOUT - 0.5 <= waited < CLIENT_TIMEOUT + 5

    sock = _connect(server)  # a body that never completes
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
    sock.sendall((head + "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode())
    sock.sendall(b'{"text": ')
    raw, waited = _read_until_closed(sock, CLIENT_TIMEOUT + 10)
    assert _status(raw) == 408 and "--client-timeout" in _body(raw)["error"]["message"]

    sock = _connect(server)  # a connection that never sends anything
    raw, waited = _read_until_closed(sock, CLIENT_TIMEOUT + 10)
    assert _status(raw) == 408 and waited < CLIENT_TIMEOUT + 5


def test_idle_keep_alive_connection_is_closed(server):
    sock = _connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    raw, waited = _read_until_closed(sock, KEEP_ALIVE + CLIENT_TIMEOUT + 10)
    assert _status(raw) == 200
    assert waited < KEEP_ALIVE + 3


def test_connections_past_the_limit_get_503_at_once(server):
    held = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        extra = _connect(server)
        raw, waited = _read_until_closed(extra, 10)
        assert _status(raw) == 503 and waited < 5
        assert b"retry-after: 1" in raw.lower()
        assert "--max-connections" in _body(raw)["error"]["message"]
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.base_url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert server.log().count("refused connections past --max-connections") == 1


def test_full_queue_and_queue_timeout_answer_503_with_retry_after(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as c:
            running = [asyncio.create_task(c.post("/generate", json=_gen(400))) for _ in "ab"]
            while server.info()["num_running_reqs"] < MAX_RUNNING:
                await asyncio.sleep(0.02)
            queued = [asyncio.create_task(c.post("/generate", json=_gen(4))) for _ in "cde"]
            while server.info()["num_waiting_reqs"] < MAX_QUEUED:
                await asyncio.sleep(0.02)
            full = await c.post("/generate", json=_gen(4))
            too_big = await c.post("/generate", json=_gen(4, text=["x"] * (MAX_QUEUED + 1)))
            timed_out = await asyncio.gather(*queued)
            for t in running:
                t.cancel()
            return full, too_big, timed_out

    full, too_big, timed_out = asyncio.run(run())
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert "queue is full" in full.json()["error"]["message"]
    assert too_big.status_code == 400  # could never be queued: retrying would not help
    for r in timed_out:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "--queue-timeout" in r.json()["error"]["message"]
    info = server.wait_idle(60)
    assert info["kv_free_pages"] == info["kv_total_pages"]


def test_health_generate_under_load_and_behind_the_key(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as c:
            busy = [asyncio.create_task(c.post("/generate", json=_gen(300))) for _ in "ab"]
            while server.info()["num_running_reqs"] < MAX_RUNNING:
                await asyncio.sleep(0.02)
            steps = server.info()["total_steps"]
            start = time.monotonic()
            probes = [await c.get("/health_generate") for _ in range(3)]
            waited = time.monotonic() - start
            busy_steps = server.info()["total_steps"] - steps
            for t in busy:
                t.cancel()
            return probes, waited, busy_steps

    probes, waited, busy_steps = asyncio.run(run())
    assert [p.status_code for p in probes] == [200] * 3
    assert waited < 10 and busy_steps >= 3  # answered from the steps of the running requests
    server.wait_idle(60)
    r = httpx.get(f"{server.base_url}/health_generate", headers=AUTH, timeout=60)
    assert r.status_code == 200  # idle: the probe generates its own token
    assert httpx.get(f"{server.base_url}/health_generate", timeout=60).status_code == 401


ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/generate"),
    ("POST", "/abort_request"),
    ("GET", "/v1/models"),
    ("GET", "/get_model_info"),
    ("GET", "/get_server_info"),
    ("GET", "/health_generate"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_the_api_key_protects_every_route_but_health_and_metrics(server, method, path):
    url = f"{server.base_url}{path}"
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY}):
        r = httpx.request(method, url, headers=headers, json={}, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, url, headers=AUTH, json={}, timeout=60)
    assert r.status_code != 401


def test_health_and_metrics_are_open(server):
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.base_url}/metrics", timeout=30).status_code == 200


def test_client_hanging_up_mid_body_is_not_an_error(server):
    sock = _connect(server)
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
    sock.sendall((head + "Content-Length: 1000\r\n\r\n").encode() + b'{"text": "abc')
    time.sleep(0.2)
    sock.close()
    time.sleep(0.5)
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    generate = [line for line in metrics.splitlines() if 'endpoint="/generate"' in line]
    assert not [line for line in generate if 'code="500"' in line], generate
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_a_client_that_stops_reading_a_stream_is_cut_and_its_requests_aborted(server):
    """A streamed /generate batch with logprobs (each event repeats everything so far: several
    megabytes in all, more than the socket buffers hold) to a client that never reads: once the buffers are full and a write waits --client-timeout, the
    connection is cut and the requests are aborted (their pages come back)."""
    steps_before = server.wait_idle()["total_steps"]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    sock.connect((host, int(port)))
    request = _gen(480, text=["slow reader"] * MAX_RUNNING, stream=True, return_logprob=True)
    body = json.dumps(request).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    deadline = time.monotonic() + 60
    while "closed connections of slow clients" not in server.log():
        assert time.monotonic() < deadline, "the stalled stream was never cut"
        time.sleep(0.2)
    info = server.wait_idle(30)
    assert info["kv_free_pages"] == info["kv_total_pages"]
    assert info["total_steps"] - steps_before < 480  # aborted, not run to the end
    sock.close()
