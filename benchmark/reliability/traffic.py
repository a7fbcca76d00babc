"""Client traffic against a tiny-model server: mixed checked streams, greedy canaries, an abort
storm, idle connection floods. Every request checks what it got: token counts (`ignore_eos`
makes them exact), finish reasons, greedy text equal to a reference produced alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

# Idle pooled connections are dropped by the client well before the server's keep-alive timeout
# (5 s by default), so a request never races the server closing the connection it reuses.
KEEPALIVE_EXPIRY_S = 1.0
GREEDY_PROMPTS = ("alpha", "beta gamma", "delta epsilon zeta", "eta")
GREEDY_TOKENS = 16
KINDS = ("completion", "chat", "generate", "greedy")


def new_client(
    base_url: str, timeout: float, connections: int = 100, keepalive: bool = True
) -> httpx.AsyncClient:
    """An async client for the scripts (`keepalive=False`: a new connection per request)."""
    limits = httpx.Limits(
        max_connections=connections,
        max_keepalive_connections=None if keepalive else 0,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
    return httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits)


class CheckFailed(AssertionError):
    """A response that is not what the request must get."""


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


async def stream_events(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    """The events of a streamed request; any non-200, missing `[DONE]` or error event fails."""
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise CheckFailed(f"{path}: HTTP {r.status_code} {(await r.aread())[:300]!r}")
        payloads = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    _expect(bool(payloads) and payloads[-1] == "[DONE]", f"{path}: no [DONE]: {payloads[-2:]}")
    events = [json.loads(p) for p in payloads[:-1]]
    errors = [e for e in events if "error" in e]
    _expect(not errors, f"{path}: error event {errors[:1]}")
    return events


async def greedy_text(client: httpx.AsyncClient, prompt: str, tokens: int = GREEDY_TOKENS) -> str:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    events = await stream_events(client, "/v1/completions", body)
    return "".join(e["choices"][0]["text"] for e in events)


async def references(client: httpx.AsyncClient) -> dict[str, str]:
    """Greedy outputs of GREEDY_PROMPTS, each produced alone."""
    return {p: await greedy_text(client, p) for p in GREEDY_PROMPTS}


async def one_request(client: httpx.AsyncClient, rng: random.Random, refs: dict[str, str]) -> str:
    """One random checked streaming request; returns its kind."""
    n = rng.randint(1, 24)
    kind = rng.choice(KINDS)
    if kind == "greedy":
        prompt = rng.choice(GREEDY_PROMPTS)
        got = await greedy_text(client, prompt)
        _expect(got == refs[prompt], f"greedy {prompt!r}: {got!r} != {refs[prompt]!r}")
    elif kind == "completion":
        body = {
            "model": "tiny",
            "prompt": "load " * rng.randint(1, 30),
            "max_tokens": n,
            "temperature": 0.8,
            "logprobs": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        events = await stream_events(client, "/v1/completions", body)
        tokens = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events[:-1])
        _expect(tokens == events[-1]["usage"]["completion_tokens"] == n, f"completion: {n}")
        _expect(events[-2]["choices"][0]["finish_reason"] == "length", "completion: finish")
    elif kind == "chat":
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x" * rng.randint(1, 60)}],
            "max_tokens": n,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        events = await stream_events(client, "/v1/chat/completions", body)
        _expect(events[-1]["usage"]["completion_tokens"] == n, f"chat: {n} tokens")
    else:
        ids = [0] + [rng.randrange(7, 263) for _ in range(rng.randint(1, 50))]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
        events = await stream_events(client, "/generate", body)
        final = events[-1]
        _expect(len(final["output_ids"]) == final["meta_info"]["completion_tokens"] == n, "gen")
        _expect(final["meta_info"]["prompt_tokens"] == len(ids), "generate: prompt tokens")
    return kind


@dataclass
class LoadResult:
    done: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def requests(self) -> int:
        return sum(self.done.values())


async def run_streams(
    base_url: str, streams: int, seconds: float, seed: int = 0, stop_on_error: bool = False
) -> LoadResult:
    """`streams` clients, each sending checked requests back to back for `seconds`."""
    result = LoadResult()
    async with new_client(base_url, 300, streams + 8) as http:
        refs = await references(http)
        start = time.monotonic()
        deadline = start + seconds

        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                try:
                    result.done[await one_request(http, rng, refs)] += 1
                except (CheckFailed, httpx.HTTPError) as exc:
                    result.errors.append(f"{type(exc).__name__}: {exc}")
                    if stop_on_error:
                        return

        await asyncio.gather(*(worker(i) for i in range(streams)))
        result.seconds = time.monotonic() - start
    return result


# ---- abort storm ---------------------------------------------------------------------------------
LONG_TOKENS = 400  # no request of the storm can finish on its own during it


def _long_body(rng: random.Random) -> tuple[str, dict]:
    return rng.choice(
        [
            (
                "/v1/completions",
                {"model": "tiny", "prompt": "storm", "max_tokens": LONG_TOKENS, "ignore_eos": True},
            ),
            (
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "storm"}],
                    "max_tokens": LONG_TOKENS,
                    "ignore_eos": True,
                },
            ),
            (
                "/generate",
                {
                    "text": ["storm"] * rng.randint(1, 8),
                    "sampling_params": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True},
                },
            ),
        ]
    )


async def abort_storm(base_url: str, clients: int, seconds: float, seed: int = 0) -> int:
    """`clients` clients that, for `seconds`, start long requests (streamed or not, single or
    batched) and hang up at a random moment: before the answer, after a few chunks, mid-body.
    Returns how many requests were abandoned."""
    abandoned = 0
    deadline = time.monotonic() + seconds
    async with new_client(base_url, 60, clients + 8, keepalive=False) as http:

        async def leave_stream(path: str, body: dict, after: int) -> None:
            seen = 0
            async with http.stream("POST", path, json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= after:
                        return  # closing the response drops the connection

        async def worker(index: int) -> None:
            nonlocal abandoned
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                path, body = _long_body(rng)
                mode = rng.choice(["stream", "plain", "queued"])
                with contextlib.suppress(httpx.HTTPError, asyncio.TimeoutError):
                    if mode == "stream":
                        await leave_stream(path, body, rng.randint(1, 5))
                    else:
                        wait = rng.uniform(0.05, 0.6) if mode == "plain" else 0.01
                        await asyncio.wait_for(http.post(path, json=body), wait)
                abandoned += 1

        await asyncio.gather(*(worker(i) for i in range(clients)))
    return abandoned


# ---- connection floods ---------------------------------------------------------------------------
def open_idle_connections(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` TCP connections that send nothing (a refused one may be closed by the server at
    once: it is kept, and reads as closed)."""
    socks = []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def closed_by_server(sock: socket.socket, timeout_s: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `timeout_s`, and what it wrote before."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return True, data
            data += chunk
    except TimeoutError:
        return False, data
    except OSError:  # reset
        return True, data


def status_of(raw: bytes) -> int | None:
    """The HTTP status of a raw response, or None."""
    head = raw.split(b"\r\n", 1)[0].split()
    return int(head[1]) if len(head) >= 2 and head[1].isdigit() else None


async def health_status(base_url: str, path: str = "/health", timeout_s: float = 10.0) -> Any:
    """The status of one fresh-connection GET, or the exception's name."""
    try:
        async with new_client(base_url, timeout_s) as http:
            return (await http.get(path)).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__
