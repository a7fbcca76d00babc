"""DSpark sampling is lossless: the distribution of the first three generated tokens with DSpark
equals the target's (chi-square, p > 0.01), for DeepSeek-V4 and DeepSeek-V4.1 targets.

* Random targets with a 12-token vocabulary (every sequence of three tokens has a visible
  probability) and a random draft whose Markov head is sharpened, so its proposals are
  confident and often wrong: V4 at temperature 1.0 and 0.7 and with top-k/top-p; V4.1 (three
  layers: window-only, ratio 2, ratio 1 with candidate blocks; no Engram, whose token map needs
  the byte tokenizer's vocabulary) at temperature 1.0 (the sampler's processing is the same code
  for every target).
* The built-in V4.1 pair (`tiny-v41` + `tiny-v41-dspark`: every layer role, Engram included) at
  temperature 2.0 with top-k 6, which keeps the support small enough to enumerate over its
  512-token vocabulary.

The reference distribution is computed exactly from target logits processed by the
non-speculative sampler's rule (`processed_probs`); token 1 comes from prefill sampling, tokens 2
and 3 from DSpark steps (accepted drafts, corrections or the bonus)."""

from __future__ import annotations

import pytest
from sgl_dspark import Engine
from spec_utils import (
    assert_first_three_tokens_follow_target,
    sharpen_markov_head,
    write_random_draft,
    write_random_target,
    write_random_v41_target,
)

V = 12
RANDOM_PROMPT = [5, 9, 4, 7]


def _v4_pair(root) -> dict:
    # A flatter target (narrow lm_head) so that many sequences have visible probability.
    target = write_random_target(str(root / "t"), vocab_size=V, seed=11)
    draft = write_random_draft(target, str(root / "d"), block_size=3, seed=12)
    sharpen_markov_head(draft)
    return {"model_path": target, "speculative_draft_model_path": draft}


def _v41_pair(root) -> dict:
    target = write_random_v41_target(
        str(root / "t"),
        seed=11,
        vocab_size=V,
        engram_layer_ids=[],
        num_hidden_layers=3,
        compress_ratios=[0, 2, 1],
        kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2],
        candidate_source_layer_id=2,
    )
    draft = write_random_draft(target, str(root / "d"), block_size=3, seed=12)
    sharpen_markov_head(draft)
    return {"model_path": target, "speculative_draft_model_path": draft}


def _builtin_v41_pair(root) -> dict:
    return {"model_path": "tiny-v41", "speculative_dspark_block_size": 3}


PAIRS = {"v4": _v4_pair, "v41": _v41_pair, "tiny-v41": _builtin_v41_pair}
CASES = [
    # (pair, prompt, sampling parameters, samples)
    pytest.param("v4", RANDOM_PROMPT, {"temperature": 1.0}, 20000, id="v4-t1.0"),
    pytest.param("v4", RANDOM_PROMPT, {"temperature": 0.7}, 20000, id="v4-t0.7"),
    pytest.param(
        "v4",
        RANDOM_PROMPT,
        {"temperature": 1.0, "top_k": 6, "top_p": 0.85},
        20000,
        id="v4-topk_topp",
    ),
    pytest.param("v41", RANDOM_PROMPT, {"temperature": 1.0}, 12000, id="v41-t1.0"),
    pytest.param(
        "tiny-v41",
        [72, 101, 108, 108],
        {"temperature": 2.0, "top_k": 6},
        6000,
        id="tiny-v41-t2.0-topk6",
    ),
]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Engine arguments of each pair, written on first use."""
    made: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in made:
            made[name] = PAIRS[name](tmp_path_factory.mktemp(f"sampling_{name}"))
        return made[name]

    return get


@pytest.mark.parametrize("pair,prompt,sampling,n_samples", CASES)
def test_first_three_tokens_follow_target(pairs, pair, prompt, sampling, n_samples):
    engine = Engine(
        **pairs(pair),
        skip_tokenizer_init=True,
        context_length=64,
        max_running_requests=1024,
        max_total_tokens=1024 * 64,
        speculative_algorithm="DSpark",
        random_seed=7,
    )
    try:
        assert_first_three_tokens_follow_target(engine, prompt, sampling, n_samples)
    finally:
        engine.shutdown()
