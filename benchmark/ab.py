"""Paired A/B serving benchmark: fresh server launches in ABBA order, paired statistics, report.

    python -m benchmark.ab \
        --baseline-cmd "python -m sgl_dspark.launch_server --model-path M --port {port}" \
        --candidate-cmd "python -m sgl_dspark.launch_server --model-path M --port {port}" \
        --candidate-cwd ../candidate-checkout --aa --replicates 4 --runs-per-launch 3 \
        --workload random:in=4096,out=1024,conc=1,n=4 --workload random:in=4096,out=1024,conc=32,n=64 \
        --simulate-accept-len 3.2 --output-dir benchmark/results/ab_fusion

Each replicate launches every arm once (baseline, candidate and, with --aa, a second baseline
launch), in ABBA order across replicates; each launch runs every workload `--warmup-runs` times
(discarded) then `--runs-per-launch` times. `{port}` and `{host}` in the commands are replaced by
a free port and the host. Writes results.json (raw numbers, written after every launch),
report.md and ab.png to --output-dir. `--from-results` re-analyses an existing results.json.
Statistics: `benchmark/serving/ab_analysis.py`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmark.bench_serving import run_benchmark
from benchmark.serving.ab_analysis import (
    BASELINE,
    BASELINE_AA,
    CANDIDATE,
    METRIC_DIRECTION,
    analyze,
    compact_metrics,
)
from benchmark.serving.ab_report import write_markdown, write_plot
from benchmark.serving.client import BACKENDS
from benchmark.serving.launch import ServerProcess, find_free_port
from benchmark.serving.metrics import json_safe
from benchmark.serving.workload import Workload, parse_workload
from benchmark.stats import abba_schedule

logger = logging.getLogger(__name__)

SIMULATE_FLAG = "--speculative-dspark-simulate-accept-len"


def git_state(cwd: str) -> dict[str, Any] | None:
    """HEAD revision and whether the checkout has uncommitted changes (read-only git calls)."""
    try:
        rev = subprocess.run(
            ["git", "-C", cwd, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
        status = subprocess.run(
            ["git", "-C", cwd, "status", "--porcelain"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None  # not a checkout: the report says so
    return {"rev": rev.stdout.strip(), "dirty": bool(status.stdout.strip())}


def arm_command(
    template: str, host: str, port: int, simulate: float | None, simulate_flag: str
) -> str:
    """The shell command of one launch. Raises ValueError when the template has no {port}."""
    if "{port}" not in template:
        raise ValueError(f"server command must contain '{{port}}': {template!r}")
    cmd = template.replace("{port}", str(port)).replace("{host}", host)
    if simulate is not None:
        cmd += f" {simulate_flag} {simulate}"
    return cmd


def run_launch(
    args: argparse.Namespace,
    arm: str,
    replicate: int,
    template: str,
    cwd: str,
    workloads: list[Workload],
    out_dir: Path,
) -> dict[str, Any]:
    """One fresh server launch: warm-up and timed runs of every workload. Raises RuntimeError when
    any request fails (a run with failures is not a measurement)."""
    port = find_free_port(args.host)
    cmd = arm_command(
        template, args.host, port, args.simulate_accept_len, args.simulate_accept_len_flag
    )
    base_url = f"http://{args.host}:{port}"
    record: dict[str, Any] = {
        "replicate": replicate,
        "arm": arm,
        "command": cmd,
        "port": port,
        "loadavg": list(os.getloadavg()),
        "started": time.time(),
        "workloads": {},
    }
    log_path = out_dir / "logs" / f"rep{replicate}_{arm}.log"
    record["log"] = str(log_path)
    with ServerProcess(
        cmd,
        base_url,
        log_path,
        cwd=cwd,
        health_path=args.health_path,
        ready_timeout_s=args.ready_timeout,
    ) as server:
        record["ready_s"] = server.ready_after_s
        for wl in workloads:
            runs = []
            for i in range(args.warmup_runs + args.runs_per_launch):
                # Fresh prompts per run, the same sequence in every launch (see Workload.config).
                cfg = wl.config(base_url, args.backend, seed=args.seed, run_index=i)
                summary = compact_metrics(run_benchmark(cfg))
                if summary["failed"]:
                    raise RuntimeError(
                        f"{arm} replicate {replicate} {wl.name}: {summary['failed']} requests "
                        f"failed; see {log_path}"
                    )
                if i >= args.warmup_runs:
                    runs.append(summary)
            record["workloads"][wl.name] = {"runs": runs}
            logger.info(
                "rep %d %-11s %-28s %s %.2f",
                replicate,
                arm,
                wl.name,
                args.metric,
                sorted(r[args.metric] for r in runs)[len(runs) // 2],
            )
    return record


def run_all(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """Runs the whole schedule, saving results.json after every launch."""
    workloads = [parse_workload(w) for w in args.workload]
    if len({w.name for w in workloads}) != len(workloads):
        raise ValueError("workload names must be distinct (add name=... to a --workload)")
    templates = {
        BASELINE: (args.baseline_cmd, args.baseline_cwd),
        CANDIDATE: (args.candidate_cmd, args.candidate_cwd),
    }
    if args.aa:
        templates[BASELINE_AA] = templates[BASELINE]
    schedule = abba_schedule(args.replicates, list(templates))
    results: dict[str, Any] = {
        "meta": {
            "arms": {
                a: {"command": c, "cwd": str(Path(w).resolve()), "git": git_state(w)}
                for a, (c, w) in templates.items()
            },
            "replicates": args.replicates,
            "runs_per_launch": args.runs_per_launch,
            "warmup_runs": args.warmup_runs,
            "backend": args.backend,
            "simulate_accept_len": args.simulate_accept_len,
            "workloads": [{"name": w.name, "kind": w.kind, "params": w.params} for w in workloads],
            "schedule": schedule,
            "host": socket.gethostname(),
        },
        "launches": [],
    }
    for rep, arm in schedule:
        template, cwd = templates[arm]
        results["launches"].append(run_launch(args, arm, rep, template, cwd, workloads, out_dir))
        (out_dir / "results.json").write_text(json.dumps(json_safe(results), indent=1, default=str))
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--baseline-cmd", help="shell command with {port}")
    p.add_argument("--candidate-cmd", help="shell command with {port}")
    p.add_argument("--baseline-cwd", default=".", help="checkout the baseline runs in")
    p.add_argument("--candidate-cwd", default=".", help="checkout the candidate runs in")
    p.add_argument(
        "--aa", action="store_true", help="add an A/A arm: a second launch of the baseline"
    )
    p.add_argument(
        "--replicates", type=int, default=4, help="launches per arm (n >= 4 recommended)"
    )
    p.add_argument(
        "--runs-per-launch", type=int, default=3, help="timed runs per workload per launch"
    )
    p.add_argument(
        "--warmup-runs", type=int, default=1, help="discarded runs per workload per launch"
    )
    p.add_argument(
        "--workload", action="append", default=[], help="see benchmark/serving/workload.py"
    )
    p.add_argument("--backend", choices=BACKENDS, default="sglang")
    p.add_argument("--metric", choices=sorted(METRIC_DIRECTION), default="output_throughput")
    p.add_argument(
        "--simulate-accept-len",
        type=float,
        default=None,
        help="fixed acceptance for both arms (knockout-ceiling method), passed to the servers",
    )
    p.add_argument("--simulate-accept-len-flag", default=SIMULATE_FLAG)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--bootstrap-resamples", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0, help="prompt and bootstrap seed")
    p.add_argument(
        "--exclude-replicates",
        type=int,
        nargs="*",
        default=[],
        help="also report without these replicates (e.g. the run that selected the candidate)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--health-path", default="/health")
    p.add_argument(
        "--ready-timeout", type=float, default=1800.0, help="seconds to wait for /health"
    )
    p.add_argument("--output-dir", required=True)
    p.add_argument(
        "--from-results", default=None, help="analyse this results.json instead of running"
    )
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.from_results is None:
        if not (args.baseline_cmd and args.candidate_cmd and args.workload):
            p.error("--baseline-cmd, --candidate-cmd and at least one --workload are required")
        if args.replicates < 2 or args.runs_per_launch < 1 or args.warmup_runs < 0:
            p.error("need --replicates >= 2, --runs-per-launch >= 1, --warmup-runs >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs (or loads) the experiment, writes report.md / ab.png, returns the analysis."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        results = json.loads(Path(args.from_results).read_text())
    else:
        if args.replicates < 4:
            logger.warning("fewer than 4 replicates: the t interval will be wide")
        results = run_all(args, out_dir)
    analysis = analyze(
        results,
        args.metric,
        args.confidence,
        args.bootstrap_resamples,
        args.seed,
        args.exclude_replicates,
    )
    (out_dir / "analysis.json").write_text(json.dumps(json_safe(analysis), indent=1))
    plot_name = None if args.no_plot else "ab.png"
    if plot_name:
        write_plot(analysis, out_dir / plot_name)
    write_markdown(results, analysis, out_dir / "report.md", plot_name)
    for name, entry in analysis["workloads"].items():
        print(f"{name}: {entry['all'].get('verdict', '')}", flush=True)
    return analysis


if __name__ == "__main__":
    main()
