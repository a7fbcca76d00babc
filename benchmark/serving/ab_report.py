"""Markdown report and matplotlib figure for an A/B analysis (`ab_analysis.analyze`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmark.serving.ab_analysis import BASELINE, BASELINE_AA, CANDIDATE

_ARMS = (BASELINE, CANDIDATE, BASELINE_AA)
_LETTER = {BASELINE: "A", CANDIDATE: "B", BASELINE_AA: "A′"}


def _fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _stat_rows(label: str, stats: dict[str, Any] | None) -> list[str]:
    if stats is None:
        return [f"| {label} | n/a (no acceptance length reported) | | | | |"]
    t, b = stats["t"], stats["bootstrap"]
    return [
        f"| {label} | {t['mean']:+.2f} | [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}] | {t['p_value']:.3g} "
        f"| [{b['ci_low']:+.2f}, {b['ci_high']:+.2f}] | {b['p_value']:.3g} |"
    ]


def _arm_header(meta: dict[str, Any], arm: str) -> str:
    info = meta["arms"][arm]
    git = info.get("git") or {}
    rev = git.get("rev", "not a git checkout")
    dirty = " (uncommitted changes)" if git.get("dirty") else ""
    return f"- **{arm}**: `{info['command']}` in `{info['cwd']}` at {rev}{dirty}"


def write_markdown(
    results: dict[str, Any], analysis: dict[str, Any], path: str | Path, plot_name: str | None
) -> str:
    """Writes the report to `path` and returns its text."""
    meta = results["meta"]
    arms = [a for a in _ARMS if a in meta["arms"]]
    lines = ["# A/B benchmark report", ""]
    lines += [_arm_header(meta, a) for a in arms]
    sim = meta.get("simulate_accept_len")
    lines += [
        "",
        f"- metric: `{analysis['metric']}` ({'higher' if analysis['direction'] > 0 else 'lower'} is better); "
        f"per launch: median of {meta['runs_per_launch']} timed runs after {meta['warmup_runs']} warm-up run(s)",
        f"- replicates: {meta['replicates']}; launch order: "
        + " ".join(f"{_LETTER[arm]}{rep}" for rep, arm in meta["schedule"])
        + " (A = baseline, B = candidate, A′ = second baseline launch)",
        f"- simulated acceptance length: {sim if sim is not None else 'off (real acceptance)'}",
        f"- host {meta['host']}; 1-min load average at each launch: "
        + ", ".join(f"{launch['loadavg'][0]:.2f}" for launch in results["launches"]),
        "",
        "Change = 100 × (arm / baseline − 1) % per replicate; CI = paired t (primary) and percentile",
        'bootstrap (cross-check, too narrow for n < 6). "Normalised" divides out the acceptance',
        "length measured in each launch (values per verify step).",
    ]
    for name, entry in analysis["workloads"].items():
        lines += ["", f"## {name}", ""]
        table = entry["table"]
        reps = sorted({int(r) for arm in table.values() for r in arm}, key=int)
        head = "| replicate | " + " | ".join(f"{a} | accept ({a})" for a in arms) + " |"
        lines += [head, "|" + "---|" * (1 + 2 * len(arms))]
        for r in reps:
            cells = []
            for a in arms:
                cell = table.get(a, {}).get(str(r))
                cells += [_fmt(cell and cell["value"]), _fmt(cell and cell["accept"], 3)]
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
        for subset, comps in entry.items():
            if subset == "table":
                continue
            lines += [
                "",
                f"**{subset} replicates**",
                "",
                "| comparison | mean % | t CI % | p (t) | bootstrap CI % | p (bootstrap) |",
                "|---|---|---|---|---|---|",
            ]
            for arm in (CANDIDATE, BASELINE_AA):
                if arm in comps:
                    label = (
                        "candidate − baseline" if arm == CANDIDATE else "A/A: baseline′ − baseline"
                    )
                    lines += _stat_rows(label, comps[arm]["raw"])
                    lines += _stat_rows(label + " (normalised)", comps[arm]["normalised"])
            for arm in (CANDIDATE, BASELINE_AA):
                if arm in comps:
                    lines.append(
                        f"\n{arm}: median over launches {comps[arm]['median_pct']:+.2f} %, worst "
                        f"case (its worst launch vs the best baseline launch) "
                        f"{comps[arm]['worst_case_pct']:+.2f} %"
                    )
            if "verdict" in comps:
                lines += ["", f"Verdict: {comps['verdict']}"]
    if plot_name:
        lines += ["", f"![per-replicate values and paired changes]({plot_name})"]
    text = "\n".join(lines) + "\n"
    Path(path).write_text(text, encoding="utf-8")
    return text


def write_plot(analysis: dict[str, Any], path: str | Path) -> None:
    """One row per workload: per-replicate medians by arm (left), paired % changes with the t CI
    and the A/A interval shaded (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = analysis["workloads"]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.2 * len(workloads)), squeeze=False)
    for row, (name, entry) in enumerate(workloads.items()):
        left, right = axes[row]
        for a in _ARMS:
            cells = entry["table"].get(a)
            if cells:
                reps = sorted(cells, key=int)
                left.plot([int(r) for r in reps], [cells[r]["value"] for r in reps], "o-", label=a)
        left.set_xticks(sorted({int(r) for cells in entry["table"].values() for r in cells}))
        left.set_title(f"{name}: {analysis['metric']} per launch")
        left.set_xlabel("replicate")
        left.legend(fontsize=8)
        comps = entry["all"]
        aa = comps.get(BASELINE_AA)
        if aa is not None:
            right.axhspan(
                aa["raw"]["t"]["ci_low"],
                aa["raw"]["t"]["ci_high"],
                color="grey",
                alpha=0.25,
                label="A/A CI",
            )
        for x, arm in enumerate((CANDIDATE, BASELINE_AA)):
            if arm not in comps:
                continue
            for y, kind in ((comps[arm]["raw"], "raw"), (comps[arm]["normalised"], "normalised")):
                if y is None:
                    continue
                pos = x + (0.0 if kind == "raw" else 0.25)
                t = y["t"]
                right.scatter([pos] * len(y["changes_pct"]), y["changes_pct"], s=12, alpha=0.6)
                right.errorbar(
                    [pos],
                    [t["mean"]],
                    yerr=[[t["mean"] - t["ci_low"]], [t["ci_high"] - t["mean"]]],
                    fmt="s",
                    capsize=4,
                    label=f"{arm} {kind}",
                )
        right.axhline(0.0, color="black", lw=0.8)
        right.set_xticks([0, 1])
        right.set_xticklabels(["candidate", "A/A"])
        right.set_ylabel("change vs baseline, %")
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
