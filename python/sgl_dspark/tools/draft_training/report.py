"""The training report (markdown) and the loss plot of a draft training run."""

from __future__ import annotations

import logging
import os
from typing import Any

from sgl_dspark.tools.draft_training.evaluate import AcceptanceResult

logger = logging.getLogger(__name__)

PLOT_FILE = "loss.png"
REPORT_FILE = "training_report.md"


def plot_losses(history: list[dict[str, float]], out_dir: str) -> str | None:
    """loss.png of the total loss and its parts per step; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no loss plot")
        return None
    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key in ("loss", "ce", "tv", "confidence"):
        ax_loss.plot(steps, [h[key] for h in history], label=key)
    ax_loss.set_xlabel("step")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_acc.plot(steps, [h["accept"] for h in history], label="1 - TV (teacher forced)")
    ax_acc.set_xlabel("step")
    ax_acc.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, PLOT_FILE)
    fig.savefig(path)
    plt.close(fig)
    return path


def _window_mean(history: list[dict[str, float]], key: str, first: bool, n: int = 10) -> float:
    rows = history[:n] if first else history[-n:]
    return sum(h[key] for h in rows) / max(len(rows), 1)


def write_report(
    out_dir: str,
    command: str,
    data: dict[str, Any],
    settings: dict[str, Any],
    history: list[dict[str, float]],
    before: AcceptanceResult | None,
    after: AcceptanceResult | None,
    plot: str | None,
) -> str:
    lines = ["# DSpark draft training report", "", "## Command", "", "```", command, "```", ""]
    lines += ["## Data", ""]
    lines += [f"- {k}: {v}" for k, v in data.items()]
    lines += ["", "## Settings", ""]
    lines += [f"- {k}: {v}" for k, v in settings.items()]
    lines += ["", "## Training", ""]
    if history:
        lines += [
            f"- steps: {history[-1]['step']}",
            "",
            "| | loss | CE | TV | confidence BCE | 1 - TV |",
            "|---|---|---|---|---|---|",
        ]
        for label, first in (("first 10 steps", True), ("last 10 steps", False)):
            vals = [
                _window_mean(history, k, first)
                for k in ("loss", "ce", "tv", "confidence", "accept")
            ]
            lines.append(f"| {label} | " + " | ".join(f"{v:.4f}" for v in vals) + " |")
    if plot:
        lines += ["", f"![losses]({os.path.basename(plot)})"]
    lines += ["", "## Acceptance on held-out prompts (serving engine, greedy)", ""]
    if before is None and after is None:
        lines.append("not measured (--skip-eval)")
    else:
        lines += [
            "| draft | mean acceptance length | verify steps | prompts | output == target-only |",
            "|---|---|---|---|---|",
        ]
        for label, res in (("initial", before), ("trained", after)):
            if res is not None:
                lines.append(
                    f"| {label} | {res.accept_length:.3f} | {res.verify_steps} | {res.prompts} | "
                    f"{'yes' if res.identical else 'NO'} |"
                )
    path = os.path.join(out_dir, REPORT_FILE)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
