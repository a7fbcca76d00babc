"""`benchmark/gpu/ncu_summary.py` on an excerpt of a real Nsight Compute report
(`data/ncu_report_excerpt.txt`: two kernels of the `ncu` stage with NCU_STALLS=1, its advisory
paragraphs cut): every figure is the one the report prints, read off it by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmark" / "gpu"))

from ncu_summary import read_launches, render  # noqa: E402

REPORT = (Path(__file__).with_name("data") / "ncu_report_excerpt.txt").read_text()


def test_reads_each_launch_s_figures() -> None:
    linear, down = read_launches(REPORT)
    assert (linear["name"], linear["grid"]) == ("_quantized_linear_kernel", "112x1x1")
    assert (down["name"], down["grid"]) == ("_moe_token_down_kernel", "7x1x80")
    assert linear["us"] == 10.14 and down["us"] == 36.99
    assert (linear["elapsed"], linear["sm_active"]) == (18571, 11375.77)
    assert (down["elapsed"], down["sm_active"]) == (68165, 51744.35)
    assert (linear["active_warps"], linear["eligible_warps"], linear["issued"]) == (1, 0.31, 0.31)
    assert (down["active_warps"], down["eligible_warps"], down["issued"]) == (2.53, 0.68, 0.45)
    assert (linear["cycles_per_issue"], down["cycles_per_issue"]) == (3.26, 5.67)
    assert len(linear["stalls"]) == 19  # every stall state the report lists
    assert linear["stalls"]["wait"] == 0.70 and linear["stalls"]["selected"] == 1
    assert down["stalls"]["long_scoreboard"] == 1.03 and down["stalls"]["barrier"] == 0.50


def test_table_orders_stalls_by_their_sum_and_folds_the_rest() -> None:
    lines = render(read_launches(REPORT)).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    # wait 0.70 + 1.10, long scoreboard 0.57 + 1.03, short 0.43 + 0.48, barrier 0.16 + 0.50,
    # not selected 0 + 0.52, ... ; "selected" (the issue itself) is not a stall
    assert head[7:12] == ["wait", "long_scoreboard", "short_scoreboard", "barrier", "not_selected"]
    assert "selected" not in head and head[-1] == "other stalls"
    linear = [c.strip() for c in lines[2].strip("|").split("|")]
    assert linear[:7] == [
        "`_quantized_linear_kernel`",
        "112x1x1",
        "10.14",
        "61%",
        "1.00 / 0.31",
        "0.31",
        "3.26",
    ]
    # outside the eight shown: branch resolving 0.01, imc miss 0.10, no instruction 0.16
    assert linear[-1] == "0.27"


def test_a_report_without_stall_metrics_leaves_their_columns_out() -> None:
    no_stalls = "\n".join(line for line in REPORT.splitlines() if "issue_stalled" not in line)
    table = render(read_launches(no_stalls))
    assert "wait" not in table and "other stalls" not in table
    assert "| `_moe_token_down_kernel` | 7x1x80 | 36.99 | 76% |" in table


@pytest.mark.parametrize("text", ["", "==PROF== Disconnected from process 1\n"])
def test_a_report_without_launches_gives_an_empty_table(text: str) -> None:
    assert read_launches(text) == []
    assert len(render([]).splitlines()) == 2
