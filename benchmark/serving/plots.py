"""Plots of a serving benchmark, written beside its JSON: the end-to-end latency CDF of every run
(one line per concurrency level) and output throughput against concurrency (total and per
user). matplotlib is optional (the `bench` extra): without it no plot is written and a warning
says why."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def plot_paths(json_path: Path) -> tuple[Path, Path]:
    stem = json_path.with_suffix("")
    return Path(f"{stem}.latency_cdf.png"), Path(f"{stem}.throughput.png")


def _label(run: dict[str, Any]) -> str:
    conc = run.get("max_concurrency")
    rate = run.get("request_rate")
    return f"concurrency {conc if conc is not None else 'unbounded'}, rate {rate}"


def write_plots(runs: Sequence[dict[str, Any]], json_path: Path) -> list[Path]:
    """Write the two plots for `runs` (summaries of `run_benchmark`) next to `json_path`;
    returns the paths written (none when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install -e '.[bench]'): no plots written")
        return []
    cdf_path, tput_path = plot_paths(json_path)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run in runs:
        lat = np.sort(np.asarray(run.get("e2e_latencies_ms") or [], dtype=np.float64))
        if lat.size:
            ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=_label(run))
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("Request latency CDF")
    fig.tight_layout()
    fig.savefig(cdf_path, dpi=120)
    plt.close(fig)

    levels = [r for r in runs if r.get("max_concurrency") is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if levels:
        conc = [r["max_concurrency"] for r in levels]
        ax.plot(conc, [r["output_throughput"] for r in levels], "o-", label="output tok/s")
        per_user = [(r.get("tok_per_s_per_user") or {}).get("mean") for r in levels]
        if all(v is not None for v in per_user):
            ax.plot(conc, per_user, "s--", label="output tok/s per user (mean)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tokens / s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("Output throughput vs concurrency")
    fig.tight_layout()
    fig.savefig(tput_path, dpi=120)
    plt.close(fig)
    return [cdf_path, tput_path]
