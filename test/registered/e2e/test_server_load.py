"""Clients that go away: 50 clients that disconnect mid-stream or while queued, and non-streaming
clients that time out. After each phase the KV pool must report every page and request slot
free. (Sustained mixed load runs in `test_reliability.py`.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import httpx
import pytest
from server_fixture import running_server

NUM_DISCONNECTING = 50
MAX_RUNNING = 32
LONG_TOKENS = 400  # a request this long needs >= 400 steps to finish on its own


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
