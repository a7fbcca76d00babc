"""With DSpark, a sampled request's randomness is its own: the same `seed` gives the same output on
every run, alone or inside a busy batch of other sampled and greedy requests, with or without the
overlap schedule; `min_p` is accepted. (Every draw -- the draft's proposal, the acceptance coins,
the bonus token -- is a function of the request's seed and the output position it decides.)"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark import Engine

SEEDED = {
    "temperature": 0.9,
    "top_p": 0.95,
    "min_p": 0.02,
    "seed": 1234,
    "max_new_tokens": 12,
    "ignore_eos": True,
}
PROMPT = [17, 42, 99, 5]


def _engine(**kw) -> Engine:
    return Engine(
        model_path="tiny",
        device="cpu",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=8,
        speculative_algorithm="DSpark",
        speculative_dspark_block_size=4,
        **kw,
    )


def _busy_batch(seed: int) -> tuple[list[list[int]], list[dict]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 250, (int(n),), generator=g).tolist() for n in (3, 9, 6)]
    params = [
        {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True},
        {"temperature": 1.1, "max_new_tokens": 14, "ignore_eos": True},
        {"temperature": 0.7, "top_k": 20, "seed": 5, "max_new_tokens": 5, "ignore_eos": True},
    ]
    return prompts, params


@pytest.mark.parametrize("overlap", [True, False])
def test_seeded_request_is_reproducible_alone_and_in_a_busy_batch(overlap):
    with _engine(disable_overlap_schedule=not overlap) as engine:
        alone = [
            engine.generate(input_ids=PROMPT, sampling_params=SEEDED)["output_ids"]
            for _ in range(2)
        ]
        assert alone[0] == alone[1]
        assert len(alone[0]) == SEEDED["max_new_tokens"]
        for batch_seed, position in ((1, 0), (2, 3)):
            prompts, params = _busy_batch(batch_seed)
            prompts.insert(position, PROMPT)
            params.insert(position, SEEDED)
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            assert outs[position]["output_ids"] == alone[0], batch_seed
        steps = engine.spec.metrics.summary().request_steps
        assert steps > 0  # speculative steps ran
    # Another seed gives another output (the request's seed decides, not the engine's state).
    with _engine(disable_overlap_schedule=not overlap) as engine:
        again = engine.generate(input_ids=PROMPT, sampling_params=SEEDED)["output_ids"]
        other = engine.generate(input_ids=PROMPT, sampling_params={**SEEDED, "seed": 99})
    assert again == alone[0] and other["output_ids"] != alone[0]


def test_min_p_is_accepted_and_applied():
    """min_p 1 keeps only the most probable token: sampling then equals greedy decoding."""
    with _engine() as engine:
        greedy = engine.generate(
            input_ids=PROMPT, sampling_params={"temperature": 0.0, "max_new_tokens": 12}
        )["output_ids"]
        only_top = engine.generate(
            input_ids=PROMPT,
            sampling_params={"temperature": 1.3, "min_p": 1.0, "seed": 3, "max_new_tokens": 12},
        )["output_ids"]
    assert only_top == greedy
