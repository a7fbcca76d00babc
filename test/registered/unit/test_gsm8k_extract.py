"""GSM8K answer extraction, ground-truth parsing, prompt format and the paired comparison."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from scipy import stats as sps

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # repo root, for `benchmark`

from benchmark.gsm8k import compare  # noqa: E402
from benchmark.gsm8k.data import STOP_STRINGS, build_prompt, fewshot_prefix, load_jsonl  # noqa: E402
from benchmark.gsm8k.extract import canonical_number, extract_answer, is_correct, parse_ground_truth  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "data" / "gsm8k_mini"

# (model output, expected canonical answer); expectations written by hand.
TRICKY = [
    ("The answer is 18.", "18"),
    ("She makes 9 * 2 = $18 every day.", "18"),
    ("Total: $1,234.50", "1234.5"),
    ("#### 1,000", "1000"),
    ("Some work 5 + 5 = 10\n#### 72\nmore text 99", "72"),
    ("The answer is: 42 apples, and 7 pears", "42"),
    ("So the answer is -3.", "-3"),
    ("He lost -$5 on the deal.", "-5"),
    ("The balance is $-12.", "-12"),
    ("It dropped to \u22127 degrees", "-7"),
    ("10-4=6", "6"),
    ("10 - 4 = 6", "6"),
    ("It costs 3.75 dollars.", "3.75"),
    ("It costs 3.750 dollars.", "3.75"),
    ("The result is 18.0", "18"),
    ("Answer: 0.50", "0.5"),
    ("I think 007 is it", "7"),
    ("Ratio 2,3 then", "3"),  # not a thousands group: two numbers, the last wins
    ("12,3456", "3456"),  # a comma group must be followed by a non-digit
    ("She needs 1,234,567 grains.", "1234567"),
    ("The final answer is \\boxed{25}.", "25"),
    ("First 2 + 3 = 5 and 10 - 4 = 6. So the total is 57,500 dollars.", "57500"),
    ("Therefore, the final answer is $276,000.", "276000"),
    ("THE ANSWER IS 12 and then 30 more", "12"),
    ("half is 3/4", "4"),
    ("50% of them", "50"),
    ("There is no number here.", None),
    ("", None),
]


@pytest.mark.parametrize("text,expected", TRICKY)
def test_extract_answer_table(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "raw,canon",
    [
        ("$1,234.50", "1234.5"),
        ("-0.0", "0"),
        ("007", "7"),
        ("18.", "18"),
        ("\u22123", "-3"),
        ("1e3", "1000"),
    ],
)
def test_canonical_number(raw: str, canon: str) -> None:
    assert canonical_number(raw) == canon


@pytest.mark.parametrize("raw", ["abc", "", "inf", "nan"])
def test_canonical_number_rejects_non_numbers(raw: str) -> None:
    with pytest.raises(ValueError):
        canonical_number(raw)


def test_ground_truth_of_fixture_matches_simple_parse() -> None:
    rows = load_jsonl(FIXTURE / "test.jsonl")
    assert len(rows) >= 20
    for row in rows:
        simple = str(int(row["answer"].split("####")[-1].strip().replace(",", "")))
        assert parse_ground_truth(row["answer"]) == simple
    with pytest.raises(ValueError, match="####"):
        parse_ground_truth("no marker 12")


def test_is_correct() -> None:
    assert is_correct("18", "18") and is_correct("18.0", "18") and is_correct("-3", "-3")
    assert not is_correct(None, "18") and not is_correct("17", "18") and not is_correct("-18", "18")


def test_prompt_format_is_sglangs() -> None:
    train = load_jsonl(FIXTURE / "train.jsonl")
    q = "How many?"
    expected = (
        f"Question: {train[0]['question']}\nAnswer: {train[0]['answer']}\n\n"
        f"Question: {train[1]['question']}\nAnswer: {train[1]['answer']}\n\n"
        f"Question: {q}\nAnswer:"
    )
    assert build_prompt(fewshot_prefix(train, 2), q) == expected
    assert build_prompt(fewshot_prefix(train, 0), q) == f"Question: {q}\nAnswer:"
    assert STOP_STRINGS == ("Question", "</s>", "<|im_end|>")
    with pytest.raises(ValueError, match="num_shots"):
        fewshot_prefix(train, len(train) + 1)


def _records(correct: list[bool], preds: list[str], outputs: list[str] | None = None) -> list[dict]:
    outputs = outputs or [f"out {p}" for p in preds]
    return [
        {"index": i, "question": f"q{i}", "correct": c, "pred": p, "output": o}
        for i, (c, p, o) in enumerate(zip(correct, preds, outputs))
    ]


def test_compare_counts_and_mcnemar() -> None:
    base = _records([True, True, False, False, True, True], ["1", "2", "9", "9", "5", "6"])
    cand = _records([True, False, True, False, True, False], ["1", "7", "3", "8", "5", "0"])
    pair = compare.compare_records(base, cand)
    assert pair == {
        "n": 6,
        "correct_baseline": 4,
        "correct_candidate": 3,
        "differing_answers": 4,
        "differing_outputs": 4,
        "only_baseline_correct": 2,
        "only_candidate_correct": 1,
    }
    verdict = compare.pooled_verdict([pair, pair], margin=0.5)
    assert verdict["n"] == 12 and verdict["correct_delta"] == -2
    assert verdict["mcnemar_p_exact"] == pytest.approx(sps.binomtest(2, 6, 0.5).pvalue)
    assert verdict["passed"]  # -2/12 with a 50 % margin
    assert not compare.pooled_verdict([pair], margin=0.01)["passed"]
    assert not compare.pooled_verdict([pair], require_identical=True)["passed"]
    same = compare.compare_records(base, base)
    assert same["differing_answers"] == 0
    assert compare.pooled_verdict([same], require_identical=True)["passed"]


def test_compare_rejects_different_questions() -> None:
    a = _records([True], ["1"])
    b = [dict(a[0], question="other")]
    with pytest.raises(ValueError, match="same questions"):
        compare.compare_records(a, b)


def test_compare_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _records([True, False, True], ["1", "2", "3"])
    cand = _records([True, False, True], ["1", "4", "3"])
    for name, recs in (("b", base), ("c", cand)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "per_question.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs)
        )
    out_json = tmp_path / "cmp.json"
    rc = compare.main(
        [
            "--baseline",
            str(tmp_path / "b"),
            "--candidate",
            str(tmp_path / "c"),
            "--aa",
            str(tmp_path / "b"),
            str(tmp_path / "b"),
            "--output-json",
            str(out_json),
        ]
    )
    text = capsys.readouterr().out
    assert (
        rc == 0 and "gate (lower bound > -0.01): PASS" in text and "A/A reference: 0 of 3" in text
    )
    assert json.loads(out_json.read_text())["pooled"]["differing_answers"] == 1
    rc = compare.main(
        [
            "--baseline",
            str(tmp_path / "b"),
            "--candidate",
            str(tmp_path / "c"),
            "--require-identical",
        ]
    )
    assert rc == 1 and "FAIL" in capsys.readouterr().out
