"""Summaries of a benchmark run: throughput, latency percentiles, speculative acceptance.

Definitions (per successful request r, times in seconds):
- TTFT_r: first content chunk time. E2E_r: last byte time.
- TPOT_r = (E2E_r - TTFT_r) / (out_r - 1), for requests with out_r > 1.
- ITL: every gap between successive content chunks (a speculative step may bring several tokens
  in one chunk, so ITL percentiles describe steps while TPOT describes tokens).
- tok/s/user_r = 1 / TPOT_r: the decode speed one user sees.
- output throughput = sum(out_r) / wall time of the whole run (first send to last byte).
- acceptance length = sum(out_r) / sum(verify_r) when servers report verify counts, else the mean
  of per-request reported acceptance lengths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmark.serving.client import RequestResult

PERCENTILES = (50, 90, 95, 99)


def distribution(values_s: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/std/min/max and PERCENTILES of `values_s` multiplied by `scale` (default: s -> ms).

    Empty input gives NaN for every field, so a missing metric is visible, not zero.
    """
    keys = ["mean", "std", "min", "max"] + [f"p{p}" for p in PERCENTILES]
    if len(values_s) == 0:
        return {k: math.nan for k in keys}
    v = np.asarray(values_s, dtype=np.float64) * scale
    out = {
        "mean": float(v.mean()),
        "std": float(v.std()),
        "min": float(v.min()),
        "max": float(v.max()),
    }
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(v, p))
    return out


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None, so the JSON is strict (no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def parse_prometheus(text: str) -> dict[str, list[tuple[str, float]]]:
    """Prometheus text exposition -> {metric name: [(label string, value), ...]}."""
    samples: dict[str, list[tuple[str, float]]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels, _, tail = rest.rpartition("}")
        else:
            name, _, tail = line.partition(" ")
            labels = ""
        fields = tail.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue  # a malformed sample line must not hide the rest of the page
        samples.setdefault(name.strip(), []).append((labels, value))
    return samples


def gauge_mean(text: str, metric: str) -> float | None:
    """Mean over label sets of a gauge in a /metrics page; None when absent or all NaN."""
    values = [v for _, v in parse_prometheus(text).get(metric, []) if math.isfinite(v)]
    return float(np.mean(values)) if values else None


def acceptance_length(results: Sequence[RequestResult]) -> float | None:
    """Token-weighted acceptance over requests with verify counts, else the mean reported value."""
    ok = [r for r in results if r.ok]
    with_verify = [r for r in ok if r.verify_ct]
    if with_verify:
        return sum(r.output_tokens for r in with_verify) / sum(
            r.verify_ct or 0 for r in with_verify
        )
    reported = [r.accept_length for r in ok if r.accept_length is not None]
    return float(np.mean(reported)) if reported else None


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """Aggregate metrics for one run (see module docstring for definitions)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    per_user = [1.0 / t for t in tpot if t > 0]
    itl = [gap for r in ok for gap in r.itl]
    duration = max(duration_s, 1e-9)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "output_tokens_estimated": any(r.tokens_counted_by_chunks for r in ok),
        "request_throughput": len(ok) / duration,
        "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration,
        "tok_per_s_per_user": distribution(per_user, scale=1.0),
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution(tpot),
        "itl_ms": distribution(itl),
        "e2e_latency_ms": distribution([r.latency for r in ok]),
        # Every request's latency, for the latency CDF plot (`benchmark/serving/plots.py`).
        "e2e_latencies_ms": sorted(r.latency * 1000.0 for r in ok),
        "accept_length": acceptance_length(ok),
    }
