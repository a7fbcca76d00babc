"""Fault scenarios against a fresh tiny-model server each; every scenario returns what it saw and
the list of problems (empty = the server behaved).

    python -m benchmark.reliability.faults [--only NAME ...] [--scale ci|full] [--out FILE]

- abort_storm: clients start long requests and hang up at random moments; afterwards every KV
  page and slot is back, greedy output is unchanged and the server still serves.
- huge_batch_hangup: one /generate with tens of thousands of prompts whose client hangs up
  while a greedy stream runs: the stream never pauses for long (admission and aborts cost
  O(1) per request) and keeps its exact output.
- connection_flood: idle connections past the process's open-file limit; the server answers
  the surplus 503 at once, closes the idle ones after --client-timeout, logs refusals at a
  bounded rate, and serves again.
- sigterm_under_load: SIGTERM with streams in flight: new requests get 503 + Retry-After, short
  requests finish, long ones end with a 503 error event within --graceful-shutdown-timeout,
  exit status 0, no traceback.
- sigstop_sigcont: the server is stopped and continued mid-stream; nothing is lost or changed.
- scheduler_death / hung_step: the scheduler thread dies / its step never returns (watchdog);
  every request ends with a 503, the process exits with status 1, nothing hangs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmark.reliability.server import FD_EXHAUSTED, TRACEBACK, ServerUnderTest
from benchmark.reliability.traffic import (
    abort_storm,
    closed_by_server,
    greedy_text,
    health_status,
    new_client,
    open_idle_connections,
    references,
    run_streams,
    status_of,
)

SCALES: dict[str, dict[str, Any]] = {
    "ci": {
        "storm_clients": 16,
        "storm_s": 4.0,
        "flood_files": 256,
        "streams": 8,
        "batch_prompts": 4_000,
    },
    "full": {
        "storm_clients": 128,
        "storm_s": 60.0,
        "flood_files": 1024,
        "streams": 32,
        "batch_prompts": 40_000,
    },
}
# The longest pause a running stream may see while a huge batch arrives and is aborted.
MAX_STREAM_GAP_S = 5.0


@dataclass
class Outcome:
    name: str
    seen: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def check(self, cond: bool, problem: str) -> None:
        if not cond:
            self.problems.append(problem)


def _clean_log(out: Outcome, srv: ServerUnderTest) -> None:
    out.seen["tracebacks"] = srv.count(TRACEBACK)
    out.check(out.seen["tracebacks"] == 0, f"tracebacks in the log:\n{srv.tail()}")


# ---- abort storm ---------------------------------------------------------------------------------
def abort_storm_scenario(log_dir: Path, scale: dict[str, Any]) -> Outcome:
    out = Outcome("abort_storm")
    with ServerUnderTest(log_dir / "abort_storm.log", ["--max-running-requests", "16"]) as srv:

        async def run() -> tuple[dict[str, str], int, dict[str, str]]:
            async with new_client(srv.base_url, 60) as client:
                before = await references(client)
            abandoned = await abort_storm(srv.base_url, scale["storm_clients"], scale["storm_s"])
            async with new_client(srv.base_url, 60) as client:
                after = await references(client)
            return before, abandoned, after

        start_steps = srv.wait_idle()["total_steps"]
        before, abandoned, after = asyncio.run(run())
        info = srv.wait_idle(60)
        out.seen.update(abandoned=abandoned, steps=info["total_steps"] - start_steps)
        out.check(abandoned >= scale["storm_clients"], f"only {abandoned} requests abandoned")
        out.check(srv.pool_is_full(info), f"pool not full after the storm: {info}")
        out.check(before == after, "greedy output changed after the storm")
        _clean_log(out, srv)
        out.check(srv.stop() == 0, "exit status not 0")
    return out


# ---- a huge batch that hangs up -------------------------------------------------------------------
def huge_batch_scenario(log_dir: Path, scale: dict[str, Any]) -> Outcome:
    out = Outcome("huge_batch_hangup")
    prompts = scale["batch_prompts"]
    args = ["--max-queued-requests", str(prompts), "--max-running-requests", "32"]
    with ServerUnderTest(log_dir / "huge_batch.log", args) as srv:

        async def run() -> tuple[str, str, list[float]]:
            async with new_client(srv.base_url, 300) as client:
                reference = await greedy_text(client, "steady", 200)
                body = {
                    "model": "tiny",
                    "prompt": "steady",
                    "max_tokens": 200,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                arrivals: list[float] = []
                text: list[str] = []

                async def stream() -> None:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                arrivals.append(time.monotonic())
                                text.append(json.loads(line[6:])["choices"][0]["text"])

                task = asyncio.create_task(stream())
                await _until(lambda: len(arrivals) >= 5, 120)
                batch = {
                    "text": [f"p{i}" for i in range(prompts)],
                    "sampling_params": {"max_new_tokens": 8},
                }
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(client.post("/generate", json=batch), 2.0)
                await task
                gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
                return reference, "".join(text), gaps

        reference, got, gaps = asyncio.run(run())
        info = srv.wait_idle(120)
        out.seen.update(prompts=prompts, max_stream_gap_s=round(max(gaps), 2))
        out.check(got == reference, "the stream's output changed")
        out.check(max(gaps) < MAX_STREAM_GAP_S, f"the stream paused {max(gaps):.1f} s")
        out.check(srv.pool_is_full(info), f"pool not full: {info}")
        _clean_log(out, srv)
        out.check(srv.stop() == 0, "exit status not 0")
    return out


# ---- connection flood ----------------------------------------------------------------------------
def connection_flood_scenario(log_dir: Path, scale: dict[str, Any]) -> Outcome:
    out = Outcome("connection_flood")
    files = scale["flood_files"]
    client_timeout = 3.0
    args = ["--client-timeout", str(client_timeout)]
    with ServerUnderTest(log_dir / "flood.log", args, open_files=files) as srv:
        flood = open_idle_connections(srv.host, srv.port, int(files * 1.5))
        during = asyncio.run(health_status(srv.base_url))
        closed = [closed_by_server(s, client_timeout + 5.0) for s in flood]
        for s in flood:
            s.close()
        statuses = [status_of(data) for _, data in closed]
        out.seen.update(
            opened=len(flood),
            refused_503=statuses.count(503),
            timed_out_408=statuses.count(408),
            closed_by_server=sum(c for c, _ in closed),
            health_during_flood=during,
            refusal_log_lines=srv.count("refused connections past --max-connections"),
            fd_exhausted_lines=srv.count(FD_EXHAUSTED),
        )
        out.check(len(flood) > files, f"the flood opened only {len(flood)} connections")
        out.check(out.seen["closed_by_server"] == len(flood), "idle connections left open")
        out.check(out.seen["refused_503"] > 0, "no connection was refused with 503")
        out.check(during in (200, 503), f"/health during the flood: {during}")
        out.check(out.seen["refusal_log_lines"] <= 5, "refusals logged one line each")
        out.check(out.seen["fd_exhausted_lines"] <= 5, "file descriptors ran out repeatedly")
        after = asyncio.run(health_status(srv.base_url))
        out.check(after == 200, f"/health after the flood: {after}")
        r = httpx.post(
            f"{srv.base_url}/generate",
            json={"text": "still here", "sampling_params": {"max_new_tokens": 4}},
            timeout=60,
        )
        out.check(r.status_code == 200, f"/generate after the flood: {r.status_code}")
        _clean_log(out, srv)
        out.check(srv.stop() == 0, "exit status not 0")
    return out


# ---- SIGTERM under load --------------------------------------------------------------------------
async def _stream_outcome(client: httpx.AsyncClient, tokens: int) -> str:
    """'finished', 'error-503' (a clean error event), or what went wrong."""
    body = {"model": "tiny", "prompt": "drain", "max_tokens": tokens, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return f"http-{r.status_code}"
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        return f"broken: {type(exc).__name__}"
    if not events or events[-1] != "[DONE]":
        return "no [DONE]"
    last = json.loads(events[-2]) if len(events) > 1 else {}
    if "error" in last:
        return f"error-{last['error']['code']}"
    return "finished" if last["choices"][0]["finish_reason"] == "length" else "unfinished"


def sigterm_scenario(log_dir: Path, scale: dict[str, Any]) -> Outcome:
    out = Outcome("sigterm_under_load")
    grace = 4.0
    args = ["--graceful-shutdown-timeout", str(grace), "--max-running-requests", "64"]
    with ServerUnderTest(log_dir / "sigterm.log", args) as srv:

        async def run() -> tuple[list[str], list[Any], float]:
            async with new_client(srv.base_url, 120) as client:
                n = scale["streams"]
                # Half finish within the grace period, half cannot.
                tasks = [
                    asyncio.create_task(_stream_outcome(client, 12 if i % 2 else 3000))
                    for i in range(n)
                ]
                await _until(lambda: srv.info()["num_running_reqs"] >= n // 2, 120)
                srv.signal(signal.SIGTERM)
                signalled = time.monotonic()
                await asyncio.sleep(0.5)
                late = [await health_status(srv.base_url, "/health")]
                async with new_client(srv.base_url, 10) as fresh:
                    r = await fresh.post(
                        "/v1/completions", json={"model": "tiny", "prompt": "late"}
                    )
                    late += [r.status_code, r.headers.get("retry-after")]
                outcomes = list(await asyncio.gather(*tasks))
                return outcomes, late, time.monotonic() - signalled

        outcomes, late, elapsed = asyncio.run(run())
        status = srv.wait_exit(grace + 30)
        out.seen.update(outcomes=dict(_count(outcomes)), late=late, drain_s=round(elapsed, 2))
        out.check(status == 0, f"exit status {status}")
        out.check(late[0] == 503, f"/health while draining: {late[0]}")
        out.check(late[1] == 503 and late[2] is not None, f"a new request while draining: {late}")
        bad = [o for o in outcomes if o not in ("finished", "error-503")]
        out.check(not bad, f"streams ended badly: {bad}")
        out.check("finished" in outcomes, "no stream finished within the grace period")
        out.check("error-503" in outcomes, "no long stream was ended at the grace period")
        out.check(elapsed < grace + 8, f"the drain took {elapsed:.1f} s (grace {grace:g} s)")
        _clean_log(out, srv)
    return out


# ---- SIGSTOP / SIGCONT ---------------------------------------------------------------------------
def sigstop_scenario(log_dir: Path, scale: dict[str, Any]) -> Outcome:
    out = Outcome("sigstop_sigcont")
    with ServerUnderTest(log_dir / "sigstop.log") as srv:

        async def run() -> tuple[dict[str, str], list[str]]:
            async with new_client(srv.base_url, 120) as client:
                refs = {p: await greedy_text(client, p, 40) for p in ("stop", "and go")}
                tasks = [
                    asyncio.create_task(greedy_text(client, p, 40))
                    for _ in range(scale["streams"] // 2)
                    for p in refs
                ]
                await _until(lambda: srv.info()["num_running_reqs"] == len(tasks), 120)
                srv.signal(signal.SIGSTOP)
                await asyncio.sleep(2.0)
                srv.signal(signal.SIGCONT)
                got = await asyncio.gather(*tasks)
                return refs, list(got)

        refs, got = asyncio.run(run())
        expected = [p for _ in range(scale["streams"] // 2) for p in refs]
        out.seen["streams"] = len(got)
        out.check(got == [refs[p] for p in expected], "outputs changed across SIGSTOP/SIGCONT")
        info = srv.wait_idle()
        out.check(srv.pool_is_full(info), f"pool not full: {info}")
        result = asyncio.run(run_streams(srv.base_url, 4, 2.0))
        out.check(not result.errors, f"errors after SIGCONT: {result.errors[:2]}")
        _clean_log(out, srv)
        out.check(srv.stop() == 0, "exit status not 0")
    return out


# ---- the scheduler dies or hangs -----------------------------------------------------------------
def _fatal_scenario(log_dir: Path, scale: dict[str, Any], name: str, fault: list[str]) -> Outcome:
    out = Outcome(name)
    args = ["--watchdog-timeout", "3"]
    streams = scale["streams"]
    with ServerUnderTest(
        log_dir / f"{name}.log",
        args,
        module="benchmark.reliability.fault_injection",
        module_args=[*fault, "--when-running", str(streams)],  # every stream is in flight
    ) as srv:

        async def run() -> list[str]:
            async with new_client(srv.base_url, 60) as client:
                tasks = [asyncio.create_task(_stream_outcome(client, 3000)) for _ in range(streams)]
                return list(await asyncio.gather(*tasks))

        start = time.monotonic()
        outcomes = asyncio.run(run())
        status = srv.wait_exit(60)
        out.seen.update(outcomes=dict(_count(outcomes)), seconds=round(time.monotonic() - start))
        out.check(status == 1, f"exit status {status} (expected 1)")
        out.check(all(o == "error-503" for o in outcomes), f"streams: {_count(outcomes)}")
        out.check("fatal:" in srv.log(), "no fatal line in the log")
    return out


def scheduler_death_scenario(log_dir: Path, scale: dict[str, Any]) -> Outcome:
    return _fatal_scenario(log_dir, scale, "scheduler_death", ["--die-after-steps", "20"])


def hung_step_scenario(log_dir: Path, scale: dict[str, Any]) -> Outcome:
    return _fatal_scenario(log_dir, scale, "hung_step", ["--hang-after-steps", "20"])


async def _until(cond: Callable[[], bool], timeout_s: float) -> None:
    """Poll `cond` until it holds; TimeoutError after `timeout_s` (a scenario never waits
    forever)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not reached within {timeout_s:g} s")
        await asyncio.sleep(0.05)


def _count(items: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


SCENARIOS: dict[str, Callable[[Path, dict[str, Any]], Outcome]] = {
    "abort_storm": abort_storm_scenario,
    "huge_batch_hangup": huge_batch_scenario,
    "connection_flood": connection_flood_scenario,
    "sigterm_under_load": sigterm_scenario,
    "sigstop_sigcont": sigstop_scenario,
    "scheduler_death": scheduler_death_scenario,
    "hung_step": hung_step_scenario,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=None)
    parser.add_argument("--scale", choices=sorted(SCALES), default="full")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the outcomes as JSON")
    ns = parser.parse_args(argv)
    log_dir = ns.log_dir or Path(tempfile.mkdtemp(prefix="sgl_dspark_faults_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for name in ns.only or list(SCENARIOS):
        start = time.monotonic()
        outcome = SCENARIOS[name](log_dir, SCALES[ns.scale])
        outcome.seen["wall_s"] = round(time.monotonic() - start, 1)
        outcomes.append(outcome)
        verdict = "ok" if not outcome.problems else "FAILED: " + "; ".join(outcome.problems)
        print(f"{name}: {verdict}\n  {json.dumps(outcome.seen)}", flush=True)
    if ns.out is not None:
        ns.out.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))
    print(f"logs: {log_dir}")
    return 0 if all(not o.problems for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
