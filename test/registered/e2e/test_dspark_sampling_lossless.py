"""DSpark sampling is lossless: the distribution of the first three generated tokens with DSpark
equals the target's (chi-square over >= 20k samples, tiny vocabulary, p > 0.01), at temperature
1.0 and 0.7 and with top-k/top-p, with a random draft that disagrees with the target often.

The reference distribution is computed exactly from target logits processed by the
non-speculative sampler's rule (`processed_probs`); token 1 comes from prefill sampling, tokens 2
and 3 from DSpark steps (accepted drafts, corrections or the bonus)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare
from sgl_dspark import Engine
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.layers.sampler import SamplingBatchInfo, processed_probs
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from spec_utils import write_random_draft, write_random_target

V = 12
N_SAMPLES = 20000
PROMPT = [5, 9, 4, 7]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    # A flatter target (narrow lm_head) so that many sequences have visible probability.
    target = write_random_target(str(root / "t"), vocab_size=V, seed=11)
    draft = write_random_draft(target, str(root / "d"), block_size=3, seed=12)
    # Sharpen the Markov head so the draft's proposals are confident and often wrong.
    from safetensors.torch import load_file, save_file

    path = str(root / "d" / "model.safetensors")
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("markov_head.head.weight"))
    tensors[key] = tensors[key] * 400.0
    save_file(tensors, path)
    return target, draft


def _exact_joint(engine: Engine, sp: SamplingParams) -> np.ndarray:
    """p(t1, t2, t3) for the prompt under the target with the sampler's processing."""
    runner = engine.runner
    seqs = (
        [PROMPT]
        + [PROMPT + [a] for a in range(V)]
        + [PROMPT + [a, b] for a in range(V) for b in range(V)]
    )
    slots = []
    try:
        for s in seqs:
            slots.append(runner.req_pool.alloc_slot())
            runner.req_pool.reserve(slots[-1], len(s))
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, seqs, [0] * len(seqs), slots, runner.req_pool.req_to_token
        )
        logits = runner.forward(batch).logits
    finally:
        for s in slots:
            runner.req_pool.free_slot(s)
    info = SamplingBatchInfo.from_params(
        [sp] * len(seqs), V, logits.device, counters=[0] * len(seqs)
    )
    p = processed_probs(logits, info).double().numpy()
    p1, p2, p3 = p[0], p[1 : 1 + V], p[1 + V :].reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize(
    "sp",
    [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 1.0, "top_k": 6, "top_p": 0.85},
    ],
    ids=["t1.0", "t0.7", "topk_topp"],
)
def test_first_three_tokens_follow_target(pair, sp):
    target, draft = pair
    engine = Engine(
        model_path=target,
        skip_tokenizer_init=True,
        context_length=64,
        max_running_requests=1024,
        max_total_tokens=1024 * 64,
        speculative_algorithm="DSpark",
        speculative_draft_model_path=draft,
        random_seed=7,
    )
    # 4 new tokens: after token 1 the step verifies anchor + 2 drafts, so tokens 2 and 3 come
    # from one verify (accepted drafts, a correction, or the bonus).
    params = {**sp, "max_new_tokens": 4, "ignore_eos": True}
    outs = engine.generate(input_ids=[PROMPT] * N_SAMPLES, sampling_params=params)
    counts = np.zeros((V, V, V))
    for o in outs:
        t = o["output_ids"]
        assert len(t) == 4
        counts[t[0], t[1], t[2]] += 1
    # the draft really was tried and often rejected, and sometimes accepted
    summary = engine.spec.metrics.summary()
    assert summary.verified_drafts >= 2 * N_SAMPLES
    assert 0 < summary.correct_drafts < 0.75 * summary.verified_drafts  # >= 25% rejected
    expected = _exact_joint(engine, SamplingParams.from_dict({**params, "max_new_tokens": 3}))
    expected = expected * N_SAMPLES
    assert counts[expected == 0].sum() == 0, "sampled a sequence the target gives probability 0"
    # chi-square over cells with expected >= 5; the rest pooled into one cell
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    keep = exp > 0
    p = chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue
    assert p > 0.01, f"chi-square p={p:.2e}"
