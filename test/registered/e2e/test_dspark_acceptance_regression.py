"""Regression on real acceptance: a target and its DSpark draft decode eight GSM8K test prompts
(zero-shot, greedy, as `python -m benchmark.acceptance` does); the DSpark outputs equal the
outputs without speculation token for token, and the pooled acceptance length (tokens committed
per verify step) reaches the pair's floor.

A pair's floor is its measured acceptance on these prompts minus a margin; a random draft's floor
is 1.0 (every verify step commits at least its bonus token)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from sgl_dspark import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # repo root, for `benchmark`

from benchmark.acceptance.decode import (  # noqa: E402
    decode,
    pooled_accept_length,
    token_mismatches,
)
from benchmark.gsm8k.data import load_jsonl  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "data" / "gsm8k_test8" / "test.jsonl"
MAX_NEW_TOKENS = 32

# (target, draft, floor on the pooled acceptance length)
PAIRS = [
    pytest.param("tiny-v41", "tiny-v41-dspark", 1.0, id="tiny-v41-random-draft"),
    # the shipped demo with its trained draft (the target directory's dspark/): 1.70 measured
    # on these prompts (CPU, fp32), floor 0.2 below
    pytest.param("demo", None, 1.5, id="demo-trained-draft"),
]


def greedy_gsm8k(engine: Engine, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    records, _ = decode(
        engine,
        rows,
        temperature=0.0,
        max_new_tokens=MAX_NEW_TOKENS,
        batch_size=len(rows),
        seed=0,
        loop_window=64,
        loop_max_period=16,
    )
    return records


def check_dspark_acceptance(model_path: str, draft_path: str | None, floor: float) -> float:
    """Decodes the eight prompts without and with DSpark; asserts identical greedy outputs and an
    acceptance length >= `floor`; returns the acceptance length."""
    rows = load_jsonl(PROMPTS)
    assert len(rows) == 8
    common = {"model_path": model_path, "device": "cpu", "max_running_requests": len(rows)}
    with Engine(**common) as engine:
        plain = greedy_gsm8k(engine, rows)
    with Engine(
        **common, speculative_algorithm="DSpark", speculative_draft_model_path=draft_path
    ) as engine:
        spec = greedy_gsm8k(engine, rows)
    assert all(r["completion_tokens"] > 1 for r in plain)
    assert all(r["verify_steps"] > 0 for r in spec)
    mismatches = token_mismatches(plain, spec)
    assert mismatches["outputs_differing"] == 0, mismatches
    accept = pooled_accept_length(spec)
    assert accept is not None and accept >= floor, (accept, floor)
    return accept


@pytest.mark.parametrize(("model_path", "draft_path", "floor"), PAIRS)
def test_dspark_acceptance_on_gsm8k_prompts(model_path: str, draft_path: str | None, floor: float):
    check_dspark_acceptance(model_path, draft_path, floor)


def test_measurement_keeps_the_runs_finished_before_it_stops(tmp_path, monkeypatch):
    """`python -m benchmark.acceptance` rewrites acceptance.json after every run: a measurement
    stopped at a time limit keeps the runs it finished, marked incomplete; a finished one is
    marked complete and holds every run with its greedy check."""
    from benchmark.acceptance import run as acceptance_run

    options = {
        "--model-path": "tiny-v41",
        "--draft-path": "tiny-v41-dspark",
        "--data": str(PROMPTS),
        "--limit": "2",
        "--batch-size": "2",
        "--device": "cpu",
        "--max-new-tokens": "6",
        "--policies": "full,static:2",
        "--temperatures": "0",
        "--random-draft": "none",
    }
    argv = [part for pair in options.items() for part in pair]
    real_decode = acceptance_run.decode
    calls = []

    def stopping_decode(engine, rows, **kw):
        calls.append(kw["label"])
        if len(calls) == 3:  # the third run (static) is cut by the time limit
            raise KeyboardInterrupt
        return real_decode(engine, rows, **kw)

    monkeypatch.setattr(acceptance_run, "decode", stopping_decode)
    partial = tmp_path / "partial"
    with pytest.raises(KeyboardInterrupt):
        acceptance_run.main([*argv, "--out", str(partial)])
    saved = json.loads((partial / "acceptance.json").read_text())
    assert saved["meta"]["complete"] is False
    assert [r["policy"] for r in saved["runs"]] == ["no-spec", "full"]
    assert saved["runs"][1]["greedy_check"]["outputs_differing"] == 0
    assert saved["ngram_control"] and saved["meta"]["device"].startswith("cpu")
    assert "| draft | full |" in (partial / "acceptance.md").read_text()

    monkeypatch.setattr(acceptance_run, "decode", real_decode)
    done = tmp_path / "done"
    assert acceptance_run.main([*argv, "--out", str(done)]) == 0
    saved = json.loads((done / "acceptance.json").read_text())
    assert saved["meta"]["complete"] is True
    assert [r["policy"] for r in saved["runs"]] == ["no-spec", "full", "static:2"]
    assert all(r["greedy_check"]["outputs_differing"] == 0 for r in saved["runs"][1:])
