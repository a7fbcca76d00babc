"""Offline Engine on the built-in tiny model: the SGLang-style API, continuous batching
invariants (outputs do not depend on batch composition or chunking), stop conditions."""

from __future__ import annotations

import math

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.managers.scheduler import RequestRejected

PROMPTS = ["The capital of France is", "1 + 1 =", "Once upon a time", "x" * 70, "Hi"]
GREEDY = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    e = Engine(model_path="tiny", context_length=512, chunked_prefill_size=64)
    yield e
    e.shutdown()


def test_single_and_batch_shapes(engine):
    one = engine.generate(prompt=PROMPTS[0], sampling_params=GREEDY)
    assert isinstance(one, dict) and set(one) == {"text", "output_ids", "meta_info"}
    many = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
    assert isinstance(many, list) and len(many) == len(PROMPTS)
    assert many[0]["output_ids"] == one["output_ids"]
    for p, out in zip(PROMPTS, many):
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(engine.tokenizer.encode(p))
        assert meta["completion_tokens"] == len(out["output_ids"]) == 20
        assert meta["finish_reason"] == {"type": "length", "length": 20}
        assert out["text"] == engine.tokenizer.decode(out["output_ids"])


def test_outputs_independent_of_batching_and_chunking(engine):
    alone = [engine.generate(prompt=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    together = [o["output_ids"] for o in engine.generate(prompt=PROMPTS, sampling_params=GREEDY)]
    assert alone == together
    small_chunks = Engine(
        model_path="tiny", context_length=512, chunked_prefill_size=7, max_running_requests=2
    )
    assert [
        o["output_ids"] for o in small_chunks.generate(prompt=PROMPTS, sampling_params=GREEDY)
    ] == alone


def test_input_ids_and_logprobs(engine):
    ids = engine.tokenizer.encode(PROMPTS[2])
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(lp <= 0.0 and math.isfinite(lp) for lp, _, _ in lps)
    # first logprob equals log_softmax of a direct forward at the last prompt token
    from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode

    runner = engine.runner
    slot = runner.req_pool.alloc_slot()
    try:
        runner.req_pool.reserve(slot, len(ids))
        b = ForwardBatch.build(ForwardMode.EXTEND, [ids], [0], [slot], runner.req_pool.req_to_token)
        logits = runner.forward(b).logits[0]
    finally:
        runner.req_pool.free_slot(slot)
    assert out["output_ids"][0] == int(torch.argmax(logits))
    assert lps[0][0] == pytest.approx(float(torch.log_softmax(logits, -1).max()), abs=1e-5)


def test_stop_string_and_stop_token(engine):
    base = engine.generate(prompt=PROMPTS[1], sampling_params=GREEDY)
    text, ids = base["text"], base["output_ids"]
    stop = text[5:7]
    out = engine.generate(prompt=PROMPTS[1], sampling_params={**GREEDY, "stop": [stop]})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    out = engine.generate(prompt=PROMPTS[1], sampling_params={**GREEDY, "stop_token_ids": [ids[3]]})
    assert out["output_ids"] == ids[: ids.index(ids[3]) + 1]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_seeded_sampling_is_reproducible(engine):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    a = engine.generate(prompt=PROMPTS[0], sampling_params=sp)["output_ids"]
    b = engine.generate(prompt=PROMPTS, sampling_params=sp)[0]["output_ids"]
    assert a == b


def test_more_requests_than_slots_queue_and_finish():
    e = Engine(model_path="tiny", context_length=256, max_running_requests=3, max_total_tokens=1024)
    outs = e.generate(prompt=[f"request {i}" for i in range(10)], sampling_params=GREEDY)
    assert all(o["meta_info"]["completion_tokens"] == 20 for o in outs)
    assert e.runner.allocator.num_free_pages == e.runner.allocator.num_usable_pages


def test_bad_requests_raise_clear_errors(engine):
    with pytest.raises(RequestRejected, match="context length"):
        engine.generate(prompt="a" * 600, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(prompt="a", sampling_params={"temperature": -1})
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()
    with pytest.raises(RequestRejected, match="out of range"):
        engine.generate(input_ids=[1, 2, 99999], sampling_params=GREEDY)
    with pytest.raises(TypeError, match="unknown Engine arguments"):
        Engine(model_path="tiny", not_a_flag=1)


def test_hidden_state_taps(engine):
    """DSpark reads mean-over-streams residuals after chosen layers."""
    from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode

    runner = engine.runner
    ids = engine.tokenizer.encode(PROMPTS[0])
    slot = runner.req_pool.alloc_slot()
    try:
        runner.req_pool.reserve(slot, len(ids))
        b = ForwardBatch.build(ForwardMode.EXTEND, [ids], [0], [slot], runner.req_pool.req_to_token)
        taps = runner.forward(b, tap_layers=(1, 3)).hidden_taps
    finally:
        runner.req_pool.free_slot(slot)
    assert set(taps) == {1, 3}
    assert taps[1].shape == (len(ids), runner.model_cfg.hidden_size)
    assert not torch.equal(taps[1], taps[3]) and torch.isfinite(taps[3]).all()
