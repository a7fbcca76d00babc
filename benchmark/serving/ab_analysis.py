"""Paired statistics over an A/B results file (the JSON `benchmark/ab.py` writes).

Per workload and arm, one number per launch: the median over that launch's timed runs. Launches
of the same replicate index are paired (they ran back to back in the ABBA schedule). For each
comparison arm X against the baseline the per-replicate change is 100 * (X_i / baseline_i - 1) %;
the harness reports its mean with a paired-t CI (primary) and a bootstrap CI, both p-values, the
same after normalising by acceptance length, and the A/A arm's CI as the noise floor.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from benchmark.stats import paired_bootstrap, paired_t

# +1: higher is better (rates), -1: lower is better (times).
METRIC_DIRECTION = {
    "output_throughput": +1,
    "tok_per_s_per_user": +1,
    "request_throughput": +1,
    "tpot_ms_p50": -1,
    "ttft_ms_p50": -1,
    "itl_ms_p50": -1,
    "e2e_latency_ms_mean": -1,
}

BASELINE, CANDIDATE, BASELINE_AA = "baseline", "candidate", "baseline_aa"


def compact_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The per-run numbers the harness keeps from a `bench_serving` summary."""
    return {
        "output_throughput": summary["output_throughput"],
        "request_throughput": summary["request_throughput"],
        "tok_per_s_per_user": summary["tok_per_s_per_user"]["mean"],
        "tpot_ms_p50": summary["tpot_ms"]["p50"],
        "ttft_ms_p50": summary["ttft_ms"]["p50"],
        "itl_ms_p50": summary["itl_ms"]["p50"],
        "e2e_latency_ms_mean": summary["e2e_latency_ms"]["mean"],
        "accept_length": summary["accept_length"],
        "accept_length_metrics": summary["accept_length_metrics"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "duration_s": summary["duration_s"],
    }


def launch_table(
    results: dict[str, Any], workload: str, metric: str
) -> dict[str, dict[int, dict[str, Any]]]:
    """{arm: {replicate: {"value": median metric, "accept": median acceptance or None}}}."""
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for launch in results["launches"]:
        runs = launch["workloads"][workload]["runs"]
        accepts = [
            r["accept_length"] if r["accept_length"] is not None else r["accept_length_metrics"]
            for r in runs
        ]
        accepts = [a for a in accepts if a is not None]
        table.setdefault(launch["arm"], {})[launch["replicate"]] = {
            "value": statistics.median(r[metric] for r in runs),
            "accept": statistics.median(accepts) if accepts else None,
        }
    return table


def _stats(changes: Sequence[float], confidence: float, n_boot: int, seed: int) -> dict[str, Any]:
    zeros = [0.0] * len(changes)
    t = paired_t(zeros, changes, confidence)
    boot = paired_bootstrap(zeros, changes, confidence, n_boot, seed)
    return {
        "changes_pct": list(changes),
        "t": dataclasses.asdict(t) | {"ci_contains_zero": t.ci_contains_zero},
        "bootstrap": dataclasses.asdict(boot) | {"ci_contains_zero": boot.ci_contains_zero},
    }


def compare_arms(
    base: dict[int, dict[str, Any]],
    other: dict[int, dict[str, Any]],
    direction: int,
    replicates: Sequence[int],
    confidence: float,
    n_boot: int,
    seed: int,
) -> dict[str, Any]:
    """Paired % change of `other` vs `base` over `replicates`, raw and acceptance-normalised,
    plus the change of the medians over launches and the worst case (other's worst launch vs
    the baseline's best launch).

    Normalised values are per verify step: rate / acceptance for rates, time x acceptance for
    times, so a launch that happened to accept more tokens per step gains nothing from it.
    """
    reps = [r for r in replicates if r in base and r in other]
    if len(reps) < 2:
        raise ValueError(f"need >= 2 paired replicates, got {len(reps)}")
    raw = [100.0 * (other[r]["value"] / base[r]["value"] - 1.0) for r in reps]
    base_vals = [base[r]["value"] for r in reps]
    other_vals = [other[r]["value"] for r in reps]
    # Worst case: the other arm's worst launch against the baseline's best launch.
    worst_other, best_base = (
        (min(other_vals), max(base_vals)) if direction > 0 else (max(other_vals), min(base_vals))
    )
    out: dict[str, Any] = {
        "replicates": reps,
        "raw": _stats(raw, confidence, n_boot, seed),
        "normalised": None,
        "median_pct": 100.0 * (statistics.median(other_vals) / statistics.median(base_vals) - 1.0),
        "worst_case_pct": 100.0 * (worst_other / best_base - 1.0),
    }
    if all(base[r]["accept"] and other[r]["accept"] for r in reps):

        def per_step(cell: dict[str, Any]) -> float:
            return (
                cell["value"] / cell["accept"] if direction > 0 else cell["value"] * cell["accept"]
            )

        norm = [100.0 * (per_step(other[r]) / per_step(base[r]) - 1.0) for r in reps]
        out["normalised"] = _stats(norm, confidence, n_boot, seed)
    return out


def verdict(cmp: dict[str, Any], direction: int, aa: dict[str, Any] | None) -> str:
    """One sentence on the raw t interval, with the A/A noise floor when there is one."""
    t = cmp["raw"]["t"]
    level = f"{100 * t['confidence']:.0f}%"
    ci = f"[{t['ci_low']:+.2f}, {t['ci_high']:+.2f}] %"
    if t["ci_contains_zero"]:
        text = f"{level} CI {ci} contains 0: no significant difference (p = {t['p_value']:.3g})."
    else:
        better = (t["mean"] > 0) == (direction > 0)
        text = (
            f"{level} CI {ci} excludes 0: candidate is significantly {'better' if better else 'worse'} "
            f"({t['mean']:+.2f} %, p = {t['p_value']:.3g})."
        )
    if aa is not None:
        at = aa["raw"]["t"]
        floor = max(abs(at["ci_low"]), abs(at["ci_high"]))
        text += f" A/A noise floor ±{floor:.2f} %"
        if not t["ci_contains_zero"] and abs(t["mean"]) <= floor:
            text += " — the effect is within it; do not claim it"
        text += "."
    return text


def analyze(
    results: dict[str, Any],
    metric: str = "output_throughput",
    confidence: float = 0.95,
    n_boot: int = 10_000,
    seed: int = 0,
    exclude_replicates: Sequence[int] = (),
) -> dict[str, Any]:
    """Statistics for every workload (see module docstring). With `exclude_replicates` (e.g. the
    run that selected the candidate) each comparison is reported with and without them."""
    if metric not in METRIC_DIRECTION:
        raise ValueError(f"metric must be one of {sorted(METRIC_DIRECTION)}, got {metric!r}")
    direction = METRIC_DIRECTION[metric]
    all_reps = sorted({launch["replicate"] for launch in results["launches"]})
    subsets = {"all": all_reps}
    if exclude_replicates:
        subsets["excluding " + ",".join(map(str, exclude_replicates))] = [
            r for r in all_reps if r not in set(exclude_replicates)
        ]
    out: dict[str, Any] = {
        "metric": metric,
        "direction": direction,
        "confidence": confidence,
        "workloads": {},
    }
    for wl in results["meta"]["workloads"]:
        name = wl["name"]
        table = launch_table(results, name, metric)
        entry: dict[str, Any] = {
            "table": {arm: {str(k): v for k, v in t.items()} for arm, t in table.items()}
        }
        for label, reps in subsets.items():
            comps: dict[str, Any] = {}
            for arm in (CANDIDATE, BASELINE_AA):
                if arm in table:
                    comps[arm] = compare_arms(
                        table[BASELINE], table[arm], direction, reps, confidence, n_boot, seed
                    )
            if CANDIDATE in comps:
                comps["verdict"] = verdict(comps[CANDIDATE], direction, comps.get(BASELINE_AA))
            entry[label] = comps
        out["workloads"][name] = entry
    return out
