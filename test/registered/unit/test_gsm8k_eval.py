"""GSM8K evaluation end to end against the fake server (20-question fixture subset)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # repo root, for `benchmark`
sys.path.insert(0, str(HERE))

from fake_openai_server import gsm8k_is_wrong, running_fake  # noqa: E402

from benchmark.gsm8k import compare  # noqa: E402
from benchmark.gsm8k.data import load_jsonl  # noqa: E402
from benchmark.gsm8k.run_eval import EvalConfig, run_eval  # noqa: E402

FIXTURE = HERE / "data" / "gsm8k_mini"
N_QUESTIONS = 20
ERROR_RATE = 0.3


def _eval(base_url: str, out_dir: Path, backend: str = "openai") -> tuple[list[dict], dict]:
    cfg = EvalConfig(
        base_url=base_url,
        train_path=str(FIXTURE / "train.jsonl"),
        test_path=str(FIXTURE / "test.jsonl"),
        backend=backend,
        num_shots=5,
        num_questions=N_QUESTIONS,
        max_new_tokens=64,
        parallel=8,
        output_dir=str(out_dir),
        progress=False,
    )
    return run_eval(cfg)


def _fake_flags(seed: int, *extra: str) -> list[str]:
    return [
        "--solve-gsm8k",
        str(FIXTURE / "test.jsonl"),
        "--gsm8k-error-rate",
        str(ERROR_RATE),
        "--gsm8k-error-seed",
        str(seed),
        "--delay-ms",
        "0.2",
        "--prefill-delay-ms",
        "0",
        *extra,
    ]


def _expected_wrong(seed: int) -> list[bool]:
    questions = [r["question"].strip() for r in load_jsonl(FIXTURE / "test.jsonl")[:N_QUESTIONS]]
    return [gsm8k_is_wrong(q, ERROR_RATE, seed) for q in questions]


def test_gsm8k_end_to_end_with_and_without_dspark(tmp_path: Path) -> None:
    wrong = _expected_wrong(seed=1)
    assert 0 < sum(wrong) < N_QUESTIONS  # the fixture exercises both outcomes
    with running_fake(tmp_path / "plain.log", *_fake_flags(1)) as url:
        records, summary = _eval(url, tmp_path / "plain")
        sg_records, _ = _eval(url, tmp_path / "plain_sglang", backend="sglang")
    with running_fake(
        tmp_path / "dspark.log",
        *_fake_flags(
            1,
            "--speculative-algorithm",
            "DSpark",
            "--speculative-dspark-simulate-accept-len",
            "2.5",
        ),
    ) as url:
        _, spec_summary = _eval(url, tmp_path / "dspark")

    # Accuracy follows the fake's deterministic right/wrong rule, question by question.
    assert [r["correct"] for r in records] == [not w for w in wrong]
    assert summary["accuracy"] == pytest.approx(1 - sum(wrong) / N_QUESTIONS)
    assert summary["failed"] == 0 and summary["invalid"] == 0
    assert [r["pred"] for r in sg_records] == [r["pred"] for r in records]
    # Stop strings are honoured: no output runs into the next "Question".
    assert all("Question" not in r["output"] for r in records)

    saved = [
        json.loads(line)
        for line in (tmp_path / "plain" / "per_question.jsonl").read_text().splitlines()
    ]
    assert [r["index"] for r in saved] == list(range(N_QUESTIONS))
    assert json.loads((tmp_path / "plain" / "summary.json").read_text())[
        "correct"
    ] == N_QUESTIONS - sum(wrong)
    assert spec_summary["accept_length"] is None  # /v1/completions carries no acceptance counters

    # Greedy with and without DSpark: the paired comparison reports 0 differing answers.
    rc = compare.main(
        [
            "--baseline",
            str(tmp_path / "plain"),
            "--candidate",
            str(tmp_path / "dspark"),
            "--require-identical",
            "--output-json",
            str(tmp_path / "cmp.json"),
        ]
    )
    pooled = json.loads((tmp_path / "cmp.json").read_text())["pooled"]
    assert rc == 0 and pooled["differing_answers"] == 0 and pooled["mcnemar_p_exact"] == 1.0


def test_gsm8k_comparison_detects_differing_answers(tmp_path: Path) -> None:
    wrong_a, wrong_b = _expected_wrong(seed=1), _expected_wrong(seed=2)
    with running_fake(tmp_path / "a.log", *_fake_flags(1)) as url:
        _eval(url, tmp_path / "a")
    with running_fake(tmp_path / "b.log", *_fake_flags(2)) as url:
        _eval(url, tmp_path / "b")
    pair = compare.compare_records(
        compare.load_records(tmp_path / "a"), compare.load_records(tmp_path / "b")
    )
    only_a = sum(wb and not wa for wa, wb in zip(wrong_a, wrong_b))
    only_b = sum(wa and not wb for wa, wb in zip(wrong_a, wrong_b))
    assert pair["only_baseline_correct"] == only_a and pair["only_candidate_correct"] == only_b
    assert pair["differing_answers"] == sum(wa != wb for wa, wb in zip(wrong_a, wrong_b)) > 0
    assert (
        compare.main(
            [
                "--baseline",
                str(tmp_path / "a"),
                "--candidate",
                str(tmp_path / "b"),
                "--require-identical",
            ]
        )
        == 1
    )
