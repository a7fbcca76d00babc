"""`benchmark/gpu/abba_summary.py`: an ABBA stage's rounds read together (means, speedup, whether
the greedy tokens agree), on hand-written round files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmark" / "gpu"))

from abba_summary import read_rounds, summary  # noqa: E402


def _round(root: Path, name: str, ms: float, ids: list[int], rows: int = 1) -> None:
    d = root / name
    d.mkdir()
    row = {"system": "plain", "bs": 1, "decode_ms_per_token": ms, "ids": [ids]}
    (d / "native_decode_cfg.json").write_text(json.dumps({"meta": {}, "rows": [row] * rows}))


def test_means_speedup_and_tokens(tmp_path: Path) -> None:
    _round(tmp_path, "1_base", 9.65, [1, 2, 3])
    _round(tmp_path, "2_head", 8.49, [1, 2, 4])
    _round(tmp_path, "3_head", 8.49, [1, 2, 4])
    _round(tmp_path, "4_base", 9.61, [1, 2, 3])
    (tmp_path / "unrelated.md").write_text("not a round")
    rounds = read_rounds(tmp_path)
    assert [(r["round"], r["side"]) for r in rounds] == [
        (1, "base"),
        (2, "head"),
        (3, "head"),
        (4, "base"),
    ]
    text = summary(rounds)
    # (9.65 + 9.61) / 2 = 9.63; 9.63 / 8.49 = 1.1343
    assert "base mean 9.630 ms/token, head mean 8.490: head speedup **1.134x**" in text
    assert "repeats of a side equal True; base and head equal False" in text
    assert "| 4 | base | plain | 9.610 |" in text


def test_a_repeat_that_differs_is_reported(tmp_path: Path) -> None:
    _round(tmp_path, "1_base", 5.0, [7, 8])
    _round(tmp_path, "2_head", 4.0, [7, 8])
    _round(tmp_path, "3_head", 4.0, [7, 9])
    text = summary(read_rounds(tmp_path))
    assert "head speedup **1.250x**" in text
    assert "repeats of a side equal False" in text


def test_a_missing_side_and_a_round_of_two_rows(tmp_path: Path) -> None:
    _round(tmp_path, "1_base", 5.0, [1])
    assert "a side has no rounds" in summary(read_rounds(tmp_path))
    _round(tmp_path, "2_head", 4.0, [1], rows=2)
    with pytest.raises(ValueError, match="expected one row, got 2"):
        read_rounds(tmp_path)
