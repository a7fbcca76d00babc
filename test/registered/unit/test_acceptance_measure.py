"""The acceptance measurement's own logic on hand-made data: the n-gram lookup control, the
repetition-loop check, run summaries, greedy comparison and policy specs."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # repo root, for `benchmark`

from benchmark.acceptance.configs import (  # noqa: E402
    PolicySpec,
    SpecConfig,
    parse_policy,
    spec_engine_kwargs,
)
from benchmark.acceptance.decode import summarise, token_mismatches  # noqa: E402
from benchmark.acceptance.loops import repetition_period  # noqa: E402
from benchmark.acceptance.ngram import (  # noqa: E402
    prompt_lookup_acceptance,
    propose_prompt_lookup,
)

# ---- n-gram lookup ----------------------------------------------------------------------------


def test_proposal_follows_the_matched_ngram_up_to_the_context_end():
    ctx = [1, 2, 3, 4, 1, 2]  # (4, 1, 2) never recurs; (1, 2) did at 0
    assert propose_prompt_lookup(ctx, 3) == [3, 4, 1]
    assert propose_prompt_lookup(ctx, 9) == [3, 4, 1, 2]


def test_proposal_takes_the_most_recent_occurrence():
    ctx = [5, 1, 9, 7, 1, 8, 2, 1]  # 1 occurs at 1 and 4 before the end
    assert propose_prompt_lookup(ctx, 2) == [8, 2]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    ctx = [1, 2, 3, 9, 2, 3, 5, 1, 2, 3]  # (1, 2, 3) at 0; (2, 3) most recently at 4
    assert propose_prompt_lookup(ctx, 2) == [9, 2]
    assert propose_prompt_lookup(ctx, 2, max_ngram=2) == [5, 1]


def test_no_recurring_ngram_proposes_nothing():
    assert propose_prompt_lookup([4, 5, 6, 7], 3) == []
    assert propose_prompt_lookup([], 3) == []


def test_a_run_of_one_token_matches_itself_shifted():
    assert propose_prompt_lookup([7, 7, 7], 4) == [7]


def _naive_proposal(ctx: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(ctx) <= n:
            continue
        suffix = ctx[-n:]
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start : start + n] == suffix:
                return ctx[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_equals_a_full_scan_on_random_sequences(seed: int):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 20])
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    k = rng.randrange(1, 8)
    # Replay with the naive proposer and compare step by step with the library's result.
    ctx, pos, committed, steps = [*prompt, output[0]], 1, 0, 0
    while pos < len(output):
        draft = _naive_proposal(ctx, k, 3, 1)
        assert draft == propose_prompt_lookup(ctx, k)
        acc = 0
        while acc < min(len(draft), len(output) - pos - 1) and draft[acc] == output[pos + acc]:
            acc += 1
        ctx += output[pos : pos + acc + 1]
        pos, committed, steps = pos + acc + 1, committed + acc + 1, steps + 1
    got = prompt_lookup_acceptance(prompt, output, k)
    assert (got.committed, got.steps) == (committed, steps)
    assert got.committed == len(output) - 1


def test_acceptance_of_an_output_copying_the_prompt():
    # After the prefill token 10, (10) recurs at 0: drafts 11 12 13, all accepted, + bonus 14;
    # then (12, 13, 14) recurs: draft 15 10 11, but only the bonus fits (15): 5 tokens, 2 steps.
    got = prompt_lookup_acceptance([10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 14, 15], 3)
    assert (got.committed, got.steps, got.accept_length) == (5, 2, 2.5)


def test_acceptance_stops_at_the_first_wrong_draft():
    # (1) recurs: draft 2 3 4 against 2 9: one accepted + bonus; then nothing recurs.
    got = prompt_lookup_acceptance([1, 2, 3, 4], [1, 2, 9, 9], 3)
    assert (got.committed, got.steps) == (3, 2)


def test_new_tokens_only_commit_one_per_step():
    got = prompt_lookup_acceptance([1, 2, 3], [4, 5, 6, 7], 5)
    assert (got.committed, got.steps, got.accept_length) == (3, 3, 1.0)


def test_outputs_without_verify_steps():
    assert prompt_lookup_acceptance([1], [], 3).accept_length is None
    assert prompt_lookup_acceptance([1], [1], 3).steps == 0
    with pytest.raises(ValueError, match="num_draft_tokens"):
        prompt_lookup_acceptance([1], [1, 2], 0)


# ---- repetition loops -------------------------------------------------------------------------


def test_loop_periods():
    assert repetition_period([1, 2, 3] * 30) == 3
    assert repetition_period([5] * 64) == 1
    noise = random.Random(0)
    prefix = [noise.randrange(1000) for _ in range(50)]
    assert repetition_period(prefix + [1, 2] * 32) == 2
    unit17 = list(range(17))
    assert repetition_period(unit17 * 5) is None
    assert repetition_period(unit17 * 5, max_period=17) == 17


def test_not_loops():
    noise = random.Random(1)
    assert repetition_period([noise.randrange(1000) for _ in range(200)]) is None
    assert repetition_period([1, 2] * 31 + [1]) is None  # 63 tokens: too short
    assert repetition_period([1, 2] * 40 + [3]) is None  # the loop broke at the end
    with pytest.raises(ValueError):
        repetition_period([1] * 10, window=8, max_period=8)


# ---- summaries and the greedy check -----------------------------------------------------------


def _rec(index, ids, committed, verify, loop=None, correct=True, finish="stop"):
    return {
        "index": index,
        "question": f"q{index}",
        "output_ids": ids,
        "completion_tokens": len(ids),
        "committed": committed,
        "verify_steps": verify,
        "loop_period": loop,
        "correct": correct,
        "pred": "1" if correct else None,
        "finish": finish,
    }


def test_summary_pools_acceptance_and_leaves_loops_out():
    recs = [
        _rec(0, [1] * 7, 6, 3),
        _rec(1, [2] * 3, 2, 2, correct=False),
        _rec(2, [3] * 11, 10, 2, loop=1, finish="length"),
    ]
    s = summarise(recs, speculative=True)
    assert s["accept_length"] == pytest.approx(18 / 7)
    assert s["accept_length_no_loops"] == pytest.approx(8 / 5)
    assert s["accept_length_loops_only"] == pytest.approx(5.0)
    assert (s["tokens"], s["correct"], s["loops"]) == (21, 2, 1)
    assert s["loop_rate"] == pytest.approx(1 / 3)
    assert s["hit_token_limit_rate"] == pytest.approx(1 / 3)
    assert s["no_answer_rate"] == pytest.approx(1 / 3)
    assert "accept_length" not in summarise(recs, speculative=False)


def test_token_mismatches_name_the_first_difference():
    a = [_rec(0, [1, 2, 3], 0, 0), _rec(1, [4, 5], 0, 0), _rec(2, [6], 0, 0)]
    b = [_rec(0, [1, 2, 3], 0, 0), _rec(1, [4, 9], 0, 0), _rec(2, [6, 7], 0, 0)]
    got = token_mismatches(a, b)
    assert got["outputs_differing"] == 2
    assert got["examples"] == [
        {"index": 1, "first_difference_at": 1},
        {"index": 2, "first_difference_at": 1},
    ]
    assert token_mismatches(a, a)["outputs_differing"] == 0


# ---- policy specs -----------------------------------------------------------------------------


def test_policy_specs_parse():
    assert parse_policy("full") == PolicySpec("full")
    assert parse_policy("static") == PolicySpec("static")
    assert parse_policy("static:3") == PolicySpec("static", width=3)
    assert parse_policy("confidence") == PolicySpec("confidence", confidence_mode="sync")
    assert parse_policy("confidence:async").label == "confidence:async"
    for bad in ("fast", "static:0", "static:x", "full:2", "confidence:maybe"):
        with pytest.raises(ValueError, match="policy"):
            parse_policy(bad)


def test_policy_engine_arguments(tmp_path: Path):
    static = SpecConfig("draft", "d", parse_policy("static:3"), 4)
    kw = spec_engine_kwargs(static, tmp_path, None, 4)
    assert kw["speculative_dspark_verify_policy"] == "static"
    assert kw["speculative_dspark_block_size"] == 4
    table = Path(kw["speculative_dspark_width_table_path"]).read_text()
    assert '"1": 3' in table
    with pytest.raises(ValueError, match="exceeds the full verify width 3"):
        spec_engine_kwargs(SpecConfig("draft", "d", parse_policy("static:4"), 2), tmp_path, None, 2)
    conf = SpecConfig("draft", None, parse_policy("confidence:async"), None)
    with pytest.raises(ValueError, match="SPS table"):
        spec_engine_kwargs(conf, tmp_path, None, 5)
    kw = spec_engine_kwargs(conf, tmp_path, "sps.json", 5)
    assert kw["speculative_dspark_sps_table_path"] == "sps.json"
    assert kw["speculative_dspark_confidence_mode"] == "async"
