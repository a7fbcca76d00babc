"""Sustained mixed load against a fresh tiny-model server, in rounds.

    python -m benchmark.reliability.load --streams 64 --seconds 120 --rounds 2 [--dspark]

Each round runs `--streams` clients that send checked streaming requests back to back for
`--seconds` (OpenAI completions with logprobs, chat, `/generate` with token ids, and greedy
canaries whose text must equal the text produced alone). After each round the server must be
idle with every KV page and request slot back in its pool; the server's RSS is recorded after
each round (it must not keep growing from round to round). Any failed request fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmark.reliability.server import TRACEBACK, ServerUnderTest
from benchmark.reliability.traffic import run_streams

# RSS may grow by this much from one round to the next (allocator caches settling), no more.
RSS_GROWTH_MIB = 64.0


@dataclass
class Round:
    requests: dict[str, int]
    errors: list[str]
    seconds: float
    pool_full: bool
    rss_mib: float


@dataclass
class LoadReport:
    args: dict[str, Any]
    rounds: list[Round] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def run_load(
    log_dir: Path,
    streams: int,
    seconds: float,
    rounds: int,
    dspark: bool = False,
    server_args: tuple[str, ...] = (),
) -> LoadReport:
    args = ["--context-length", "512", "--max-total-tokens", "20480", *server_args]
    if dspark:
        args += ["--speculative-algorithm", "DSpark"]
    report = LoadReport(
        {"streams": streams, "seconds": seconds, "rounds": rounds, "dspark": dspark}
    )
    with ServerUnderTest(log_dir / "load.log", args) as srv:
        for index in range(rounds):
            result = asyncio.run(run_streams(srv.base_url, streams, seconds, seed=index))
            info = srv.wait_idle(120)
            report.rounds.append(
                Round(
                    requests=dict(result.done),
                    errors=result.errors[:20],
                    seconds=round(result.seconds, 1),
                    pool_full=srv.pool_is_full(info),
                    rss_mib=round(srv.rss_mib(), 1),
                )
            )
        for i, r in enumerate(report.rounds):
            if r.errors:
                report.problems.append(f"round {i}: {len(r.errors)} errors, first {r.errors[0]}")
            if not r.pool_full:
                report.problems.append(f"round {i}: KV pages or request slots not back")
            if set(r.requests) != {"completion", "chat", "generate", "greedy"}:
                report.problems.append(f"round {i}: not every request kind ran: {r.requests}")
        rss = [r.rss_mib for r in report.rounds]
        if len(rss) >= 2 and rss[-1] - rss[-2] > RSS_GROWTH_MIB:
            report.problems.append(f"RSS grew from {rss[-2]} to {rss[-1]} MiB in the last round")
        if srv.count(TRACEBACK):
            report.problems.append(f"tracebacks in the log:\n{srv.tail()}")
        if srv.stop() != 0:
            report.problems.append("the server did not exit with status 0")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dspark", action="store_true", help="serve with DSpark")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    ns = parser.parse_args(argv)
    log_dir = ns.log_dir or Path(tempfile.mkdtemp(prefix="sgl_dspark_load_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    report = run_load(log_dir, ns.streams, ns.seconds, ns.rounds, ns.dspark)
    print("| round | requests | errors | wall s | pool full | RSS MiB |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(report.rounds):
        total = sum(r.requests.values())
        print(
            f"| {i} | {total} {r.requests} | {len(r.errors)} | {r.seconds} | {r.pool_full} "
            f"| {r.rss_mib} |"
        )
    print("ok" if not report.problems else "FAILED:\n" + "\n".join(report.problems))
    if ns.out is not None:
        ns.out.write_text(json.dumps(asdict(report), indent=2))
    print(f"logs: {log_dir}")
    return 0 if not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())
