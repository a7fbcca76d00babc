"""Load: 32 concurrent streaming clients for 60 s (completions, chat, /generate; token counts
and greedy outputs checked), then 50 clients that disconnect mid-stream or while queued. After
each phase the KV pool must report every page and request slot free."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections import Counter

import httpx
import pytest
from server_fixture import running_server

LOAD_SECONDS = float(os.environ.get("SGL_DSPARK_LOAD_SECONDS", "60"))
NUM_CLIENTS = 32
NUM_DISCONNECTING = 50
MAX_RUNNING = 32
LONG_TOKENS = 400  # a request this long needs >= 400 steps to finish on its own
GREEDY_PROMPTS = ["alpha", "beta gamma", "delta epsilon zeta", "eta"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("load") / "server.log"
    with running_server(
        log,
        "--context-length",
        "512",
        "--max-total-tokens",
        "20480",
        "--max-running-requests",
        str(MAX_RUNNING),
    ) as srv:
        yield srv


async def _stream(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        payloads = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert payloads and payloads[-1] == "[DONE]", payloads[-2:]
    events = [json.loads(p) for p in payloads[:-1]]
    assert not any("error" in e for e in events), events
    return events


async def _greedy_text(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    events = await _stream(
        client,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    return "".join(e["choices"][0]["text"] for e in events)


async def _one_request(
    client: httpx.AsyncClient, rng: random.Random, references: dict[str, str]
) -> str:
    """One random streaming request; checks its token count (ignore_eos makes it exact)."""
    n = rng.randint(1, 24)
    kind = rng.choice(["completion", "chat", "generate", "greedy"])
    if kind == "greedy":
        prompt = rng.choice(GREEDY_PROMPTS)
        assert await _greedy_text(client, prompt, 16) == references[prompt]
    elif kind == "completion":
        events = await _stream(
            client,
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": "load " * rng.randint(1, 30),
                "max_tokens": n,
                "temperature": 0.8,
                "logprobs": 0,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            },
        )
        tokens = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events[:-1])
        assert tokens == events[-1]["usage"]["completion_tokens"] == n
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    elif kind == "chat":
        events = await _stream(
            client,
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x" * rng.randint(1, 60)}],
                "max_tokens": n,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert events[-1]["usage"]["completion_tokens"] == n
    else:
        ids = [0] + [rng.randrange(7, 263) for _ in range(rng.randint(1, 50))]
        events = await _stream(
            client,
            "/generate",
            {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}},
        )
        final = events[-1]
        assert len(final["output_ids"]) == final["meta_info"]["completion_tokens"] == n
        assert final["meta_info"]["prompt_tokens"] == len(ids)
    return kind


def test_32_streaming_clients_for_60s(server):
    async def run() -> Counter:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=120, limits=limits
        ) as client:
            references = {p: await _greedy_text(client, p, 16) for p in GREEDY_PROMPTS}
            deadline = time.monotonic() + LOAD_SECONDS
            done: Counter = Counter()

            async def worker(seed: int) -> None:
                rng = random.Random(seed)
                while time.monotonic() < deadline:
                    done[await _one_request(client, rng, references)] += 1

            await asyncio.gather(*(worker(i) for i in range(NUM_CLIENTS)))
            return done

    start = time.monotonic()
    done = asyncio.run(run())
    print("requests done:", dict(done))
    assert time.monotonic() - start >= LOAD_SECONDS
    assert set(done) == {"completion", "chat", "generate", "greedy"}, done
    assert sum(done.values()) >= NUM_CLIENTS
    info = server.wait_idle()
    assert info["kv_free_pages"] == info["kv_total_pages"]
    assert info["free_req_slots"] == MAX_RUNNING


def _long_request(seed: int) -> tuple[str, dict]:
    path, body = random.Random(seed).choice(
        [
            (
                "/v1/completions",
                {
                    "model": "tiny",
                    "prompt": f"leave {seed}",
                    "max_tokens": LONG_TOKENS,
                    "ignore_eos": True,
                },
            ),
            (
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "max_tokens": LONG_TOKENS,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": "bye"}],
                },
            ),
            (
                "/generate",
                {
                    "text": "gone",
                    "sampling_params": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True},
                },
            ),
        ]
    )
    return path, {**body, "stream": True}


def _has_tokens(payload: str) -> bool:
    """True for a streamed event that carries output (not chat's initial role chunk)."""
    event = json.loads(payload)
    if "output_ids" in event:
        return bool(event["output_ids"])
    choice = event["choices"][0]
    return bool(choice.get("text") or choice.get("delta", {}).get("content"))


def test_disconnecting_clients_leak_no_pages(server):
    """MAX_RUNNING clients fill every slot and read a few tokens; the others queue behind them
    and hang up before their first token; then the first ones hang up mid-stream."""
    steps_before = server.wait_idle()["total_steps"]
    num_queued = NUM_DISCONNECTING - MAX_RUNNING

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=NUM_DISCONNECTING + 8, max_keepalive_connections=0)
        holders_leave = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:

            async def wait_for_state(key: str, value: int) -> None:
                while (await client.get("/get_server_info")).json()[key] != value:
                    await asyncio.sleep(0.05)

            async def holder(seed: int) -> int:
                path, body = _long_request(seed)
                seen, leave_after = 0, random.Random(seed).randint(1, 4)
                async with client.stream("POST", path, json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and _has_tokens(line[6:]):
                            seen += 1
                        if seen >= leave_after:
                            await holders_leave.wait()
                            return seen  # closing the response drops the connection
                return seen

            async def queued(seed: int) -> int:
                path, body = _long_request(seed)
                seen = 0

                async def read() -> None:
                    nonlocal seen
                    async with client.stream("POST", path, json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and _has_tokens(line[6:]):
                                seen += 1

                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(read(), timeout=1.5)
                return seen

            holders = [asyncio.create_task(holder(i)) for i in range(MAX_RUNNING)]
            await asyncio.wait_for(wait_for_state("num_running_reqs", MAX_RUNNING), 60)
            waiters = [
                asyncio.create_task(queued(i)) for i in range(MAX_RUNNING, NUM_DISCONNECTING)
            ]
            await asyncio.wait_for(wait_for_state("num_waiting_reqs", num_queued), 60)
            queued_seen = await asyncio.gather(*waiters)
            await asyncio.wait_for(wait_for_state("num_waiting_reqs", 0), 60)
            holders_leave.set()
            return list(await asyncio.gather(*holders)) + list(queued_seen)

    seen = asyncio.run(run())
    assert all(s >= 1 for s in seen[:MAX_RUNNING]), seen
    assert all(s == 0 for s in seen[MAX_RUNNING:]), seen
    info = server.wait_idle(timeout=60)
    assert info["kv_free_pages"] == info["kv_total_pages"]
    assert info["free_req_slots"] == MAX_RUNNING
    # Aborted, not run to completion: finishing any one of them takes LONG_TOKENS steps.
    assert info["total_steps"] - steps_before < LONG_TOKENS
    # And the server still serves.
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "still here", "max_tokens": 3},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_non_streaming_clients_that_time_out_leak_no_pages(server):
    """Non-streaming requests are watched too: a client that gives up aborts its request."""
    steps_before = server.wait_idle()["total_steps"]

    async def give_up(client: httpx.AsyncClient, seed: int) -> None:
        path, body = _long_request(seed)
        with contextlib.suppress(httpx.ReadTimeout):
            await client.post(path, json={**body, "stream": False}, timeout=1.0)
            raise AssertionError("a long request finished within the client timeout")

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url) as client:
            await asyncio.gather(*(give_up(client, i) for i in range(8)))

    asyncio.run(run())
    info = server.wait_idle(timeout=30)
    assert info["kv_free_pages"] == info["kv_total_pages"]
    assert info["total_steps"] - steps_before < LONG_TOKENS
