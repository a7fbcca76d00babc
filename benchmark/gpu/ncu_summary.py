"""One table of an Nsight Compute text report (`ncu ... > ncu.txt`, the `ncu` stage of
`native_h200.sh`): per profiled kernel launch, its grid, duration, how much of its span the SMs
were active, warps resident and eligible per scheduler, instructions issued a cycle per
scheduler, and, where the report holds the warp-stall metrics (`NCU_STALLS=1`), the cycles a
warp spends per issued instruction in each stall state, largest first across the report.

    python benchmark/gpu/ncu_summary.py NCU_TXT [--out FILE]

Only what the report prints is read; a metric it lacks is left blank.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

# A profiled launch's header line: two spaces, the kernel name, its grid and block.
_LAUNCH = re.compile(r"(?m)^  (\w+) \(([\d, ]+)\)x\(([\d, ]+)\)")
_METRICS = {
    "us": r"Duration\s+us\s+([\d.,]+)",
    "elapsed": r"Elapsed Cycles\s+cycle\s+([\d.,]+)",
    "sm_active": r"SM Active Cycles\s+cycle\s+([\d.,]+)",
    "active_warps": r"Active Warps Per Scheduler\s+warp\s+([\d.,]+)",
    "eligible_warps": r"Eligible Warps Per Scheduler\s+warp\s+([\d.,]+)",
    "issued": r"Issued Warp Per Scheduler\s+([\d.,]+)",
    "cycles_per_issue": r"Warp Cycles Per Issued Instruction\s+cycle\s+([\d.,]+)",
}
_STALL = re.compile(
    r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+\S+\s+([\d.,]+)"
)
# Stall states shown, in this order when present; the rest are summed into "other".
_SHOWN = 8


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def read_launches(report: str) -> list[dict]:
    """Each profiled launch in report order: name, grid, the `_METRICS` found (floats) and its
    stall states (name -> cycles per issued instruction)."""
    heads = list(_LAUNCH.finditer(report))
    launches = []
    for i, head in enumerate(heads):
        body = report[head.end() : heads[i + 1].start() if i + 1 < len(heads) else len(report)]
        metrics = {}
        for key, pattern in _METRICS.items():
            m = re.search(pattern, body)
            if m:
                metrics[key] = _number(m.group(1))
        stalls = {name: _number(value) for name, value in _STALL.findall(body)}
        grid = "x".join(part.strip() for part in head.group(2).split(","))
        launches.append({"name": head.group(1), "grid": grid, **metrics, "stalls": stalls})
    return launches


def render(launches: list[dict]) -> str:
    totals: dict[str, float] = {}
    for launch in launches:
        for name, value in launch["stalls"].items():
            if name != "selected":  # the issue itself, 1.0 by definition
                totals[name] = totals.get(name, 0.0) + value
    shown = sorted(totals, key=lambda name: -totals[name])[:_SHOWN]
    head = [
        "kernel",
        "grid",
        "us",
        "SM active / elapsed",
        "warps a scheduler (active / eligible)",
        "issued a cycle a scheduler",
        "cycles a warp per issued instruction",
        *shown,
    ]
    if len(totals) > len(shown):
        head.append("other stalls")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(launch: dict, key: str, fmt: str = "{:.2f}") -> str:
        return fmt.format(launch[key]) if key in launch else ""

    for launch in launches:
        active = ""
        if "sm_active" in launch and launch.get("elapsed"):
            active = f"{launch['sm_active'] / launch['elapsed']:.0%}"
        warps = ""
        if "active_warps" in launch and "eligible_warps" in launch:
            warps = f"{launch['active_warps']:.2f} / {launch['eligible_warps']:.2f}"
        stalls = launch["stalls"]
        row = [
            f"`{launch['name']}`",
            launch["grid"],
            cell(launch, "us"),
            active,
            warps,
            cell(launch, "issued"),
            cell(launch, "cycles_per_issue"),
            *(f"{stalls[name]:.2f}" if name in stalls else "" for name in shown),
        ]
        if len(totals) > len(shown):
            rest = [v for k, v in stalls.items() if k not in shown and k != "selected"]
            row.append(f"{sum(rest):.2f}" if rest else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("report", type=Path)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    table = render(read_launches(a.report.read_text()))
    if a.out:
        a.out.write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
