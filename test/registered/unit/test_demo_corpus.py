"""The demo corpus builder: number-varied re-computations of worked solutions, generated
arithmetic, and the locally trained tokenizer (loaded by the engine's tokenizer loader)."""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction

import pytest
from sgl_dspark.srt.tokenizer.hf_tokenizer import get_tokenizer
from sgl_dspark.tools.build_demo_corpus import main as build_main
from sgl_dspark.tools.demo_corpus.arithmetic import arithmetic_problems
from sgl_dspark.tools.demo_corpus.tokenizer import MASK, SPECIAL_TOKENS
from sgl_dspark.tools.demo_corpus.variants import (
    CALC,
    FINAL,
    Problem,
    check_solution,
    evaluate,
    vary,
)

# Written for these tests in GSM8K's format.
ORCHARD = Problem(
    "An orchard has 36 rows of 25 trees. A storm knocks down 87 trees. How many trees are left?",
    "The orchard had 36*25 = <<36*25=900>>900 trees.\n"
    "After the storm 900-87 = <<900-87=813>>813 trees are left.\n#### 813",
)
BAKERY = Problem(
    "A bakery sells 45 muffins at $3 each and 18 pies at $11 each. How much does it earn?",
    "Muffins earn 45*3 = $<<45*3=135>>135.\nPies earn 18*11 = $<<18*11=198>>198.\n"
    "Together 135+198 = $<<135+198=333>>333.\n#### 333",
)


def test_evaluate_is_exact():
    assert evaluate("12/60", {}) == Fraction(1, 5)
    assert evaluate("(3+4)*2-1", {}) == 13
    assert evaluate("3 x 4", {}) == 12
    assert evaluate("1,200/4", {}) == 300
    with pytest.raises(ValueError):
        evaluate("2**10", {})


@pytest.mark.parametrize("problem", [ORCHARD, BAKERY])
def test_variants_recompute_every_step(problem):
    assert check_solution(problem)
    rng = random.Random(0)
    seen = set()
    for _ in range(20):
        v = vary(problem, rng)
        assert v is not None
        assert check_solution(v), v.answer
        seen.add(v.answer)
        final = FINAL.search(v.answer)
        assert final is not None
        # the final answer is recomputed from the new question numbers
        calcs = list(CALC.finditer(v.answer))
        assert Fraction(final.group(1)) == evaluate(calcs[-1].group(1), {})
    assert len(seen) > 10  # really varied


def test_orchard_variant_follows_the_question():
    v = vary(ORCHARD, random.Random(3))
    assert v is not None
    rows, per_row, fallen = (int(t) for t in re.findall(r"\d+", v.question))
    assert v.answer.endswith(f"#### {rows * per_row - fallen}")


def test_ambiguous_solutions_are_not_varied():
    # a result equal to a question number: the rewrite could not tell them apart
    ambiguous = Problem(
        "Tom has 40 cards and gets 20 more, then gives away 20. How many are left?",
        "40+20 = <<40+20=60>>60.\n60-20 = <<60-20=40>>40.\n#### 40",
    )
    assert vary(ambiguous, random.Random(0)) is None
    no_calcs = Problem("What is 5 and 6?", "It is 11.\n#### 11")
    assert vary(no_calcs, random.Random(0)) is None


def test_generated_arithmetic_is_correct():
    problems = arithmetic_problems(300, seed=1)
    assert all(check_solution(p) for p in problems)
    assert len({p.question for p in problems}) > 250


def test_build_writes_corpus_and_a_loadable_tokenizer(tmp_path):
    train = tmp_path / "train.jsonl"
    rows = [{"question": p.question, "answer": p.answer} for p in (ORCHARD, BAKERY)] * 3
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "corpus"
    stats = build_main(
        [
            "--gsm8k-train",
            str(train),
            "--output",
            str(out),
            "--arithmetic",
            "200",
            "--vocab-size",
            "512",
        ]
    )
    assert stats["gsm8k_train"] == 6 and stats["gsm8k_train_varied"] > 0
    records = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    assert len(records) == stats["records"]
    assert {r["source"] for r in records} == {"gsm8k_train", "gsm8k_train_varied", "arithmetic"}
    tok = get_tokenizer(str(out))
    assert tok.vocab_size == 512
    text = "Question: A bakery sells 45 muffins.\nAnswer: 45*3 = <<45*3=135>>135"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert [vocab[t] for t in SPECIAL_TOKENS] == [0, 1, 2, 3] and MASK in vocab
    assert (out / "DATA_LICENSE.md").is_file()
    with pytest.raises(ValueError, match="test split"):
        build_main(["--gsm8k-train", str(tmp_path / "test.jsonl"), "--output", str(out)])
