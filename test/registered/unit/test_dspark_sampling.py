"""Markov-head sampling, confidence head and target/draft probability processing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from sgl_dspark.srt.layers.sampler import SamplingBatchInfo, sample_from_probs
from sgl_dspark.srt.sampling import SamplingParams
from sgl_dspark.srt.speculative.dspark.sampling import (
    confidence_head,
    draft_probs,
    markov_sample,
)
from sgl_dspark.srt.speculative.dspark.sampling import target_probs as _target_probs

TOP_K_ALL = 1 << 30  # a top-k larger than any vocabulary: no truncation


def _params(temperature, top_k, top_p) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p))
        for t, k, p in zip(temperature, top_k, top_p)
    ]


def target_probs(logits, temperature, top_k, top_p):
    params = _params(temperature, top_k, top_p)
    info = SamplingBatchInfo.from_params(
        params, logits.shape[-1], logits.device, counters=[0] * len(params)
    )
    return _target_probs(logits, info)


def _inputs(batch: int, gamma: int, vocab: int, rank: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn((batch, gamma, vocab), generator=gen) * 2
    w1 = torch.randn((vocab, rank), generator=gen)
    w2 = torch.randn((vocab, rank), generator=gen) * 0.5
    anchors = torch.randint(0, vocab, (batch,), generator=gen)
    return gen, base, w1, w2, anchors


def _naive_markov(base, w1, w2, anchors, temperature, greedy, uniforms):
    batch, gamma, _ = base.shape
    drafts, logits, embeds = [], [], []
    for b in range(batch):
        prev = int(anchors[b])
        row_x, row_z, row_e = [], [], []
        for k in range(gamma):
            e = w1[prev]
            z = base[b, k] + w2 @ e
            if greedy[b]:
                x = int(torch.argmax(z))
            else:
                probs = torch.softmax(z / max(float(temperature[b]), 1e-5), -1)
                x = int(sample_from_probs(probs[None], uniforms[b, k : k + 1])[0])
            row_x.append(x), row_z.append(z), row_e.append(e)
            prev = x
        drafts.append(row_x), logits.append(torch.stack(row_z)), embeds.append(torch.stack(row_e))
    return torch.tensor(drafts), torch.stack(logits), torch.stack(embeds)


@pytest.mark.parametrize("batch, gamma, vocab, rank", [(1, 1, 7, 2), (5, 4, 50, 8), (9, 7, 33, 16)])
def test_markov_loop_matches_naive(batch, gamma, vocab, rank):
    gen, base, w1, w2, anchors = _inputs(batch, gamma, vocab, rank, seed=batch * 100 + gamma)
    temperature = torch.rand(batch, generator=gen) + 0.3
    temperature[0] = 0.0  # clamped to 1e-5, still a valid sampled row
    greedy = torch.rand(batch, generator=gen) < 0.4
    uniforms = torch.rand((batch, gamma), generator=gen)
    out = markov_sample(base, w1, w2, anchors, temperature, greedy, uniforms=uniforms)
    want_x, want_z, want_e = _naive_markov(base, w1, w2, anchors, temperature, greedy, uniforms)
    assert out.drafts.dtype == torch.int64 and out.step_logits.dtype == torch.float32
    assert torch.equal(out.drafts, want_x)
    torch.testing.assert_close(out.step_logits, want_z, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.markov_embeds, want_e)
    # e_1 = W1[anchor], e_k = W1[x_{k-1}].
    prev = torch.cat([anchors.view(-1, 1), out.drafts[:, :-1]], dim=1)
    assert torch.equal(out.markov_embeds, w1[prev])


def test_step_logits_written_into_a_given_buffer():
    """`step_logits_out` (a graph's shared buffer, strided: rows of a wider block) receives the
    step logits and is what the output returns; the draws are those of the naive loop."""
    gen, base, w1, w2, anchors = _inputs(3, 4, 30, 6, seed=7)
    temperature = torch.tensor([0.7, 1.2, 0.9])
    greedy = torch.tensor([False, True, False])
    uniforms = torch.rand((3, 4), generator=gen)
    block = torch.full((5, 6, 30), -3.0)
    out = markov_sample(
        base, w1, w2, anchors, temperature, greedy, uniforms, step_logits_out=block[:3, :4]
    )
    want_x, want_z, _ = _naive_markov(base, w1, w2, anchors, temperature, greedy, uniforms)
    assert torch.equal(out.drafts, want_x)
    assert out.step_logits.data_ptr() == block.data_ptr()
    torch.testing.assert_close(block[:3, :4], want_z, rtol=1e-5, atol=1e-5)
    assert torch.all(block[3:] == -3.0) and torch.all(block[:, 4:] == -3.0)  # nothing else
    with pytest.raises(ValueError, match="step_logits_out"):
        markov_sample(base, w1, w2, anchors, temperature, greedy, uniforms, block[:3, :3])


def test_uniforms_decide_the_draws():
    _, base, w1, w2, anchors = _inputs(4, 3, 20, 4, seed=1)
    temperature, greedy = torch.full((4,), 0.8), torch.zeros(4, dtype=torch.bool)
    u = torch.rand((4, 3), generator=torch.Generator().manual_seed(9))
    a = markov_sample(base, w1, w2, anchors, temperature, greedy, uniforms=u)
    b = markov_sample(base, w1, w2, anchors, temperature, greedy, uniforms=u.clone())
    c = markov_sample(base, w1, w2, anchors, temperature, greedy, uniforms=1 - u)
    assert torch.equal(a.drafts, b.drafts) and not torch.equal(a.drafts, c.drafts)
    # Without uniforms every row is greedy: the same drafts as greedy rows given uniforms.
    all_g = torch.ones(4, dtype=torch.bool)
    d = markov_sample(base, w1, w2, anchors, temperature, all_g)
    e = markov_sample(base, w1, w2, anchors, temperature, all_g, uniforms=u)
    assert torch.equal(d.drafts, e.drafts) and torch.equal(d.step_logits, e.step_logits)


def test_markov_draws_follow_softmax():
    # Two steps of one context, 30k samples: the joint (x1, x2) histogram must match
    # softmax(z1 / T)[x1] * softmax(z2(x1) / T)[x2] -- the Markov bias conditions step 2 on x1.
    vocab, temp, n = 6, 0.7, 30_000
    _, base, w1, w2, anchors = _inputs(1, 2, vocab, 3, seed=5)
    base, w1, w2 = base * 0.25, w1 * 0.6, w2 * 0.6  # flat enough for >= 5 expected per cell
    base, anchors = base.expand(n, 2, vocab), anchors.expand(n)
    gen = torch.Generator().manual_seed(17)
    out = markov_sample(
        base,
        w1,
        w2,
        anchors,
        torch.full((n,), temp),
        torch.zeros(n, dtype=torch.bool),
        uniforms=torch.rand((n, 2), generator=gen),
    )
    z1 = base[0, 0] + w2 @ w1[anchors[0]]
    p1 = torch.softmax(z1.double() / temp, -1)
    joint = torch.stack(
        [p1[a] * torch.softmax((base[0, 1] + w2 @ w1[a]).double() / temp, -1) for a in range(vocab)]
    )
    observed = torch.bincount(
        out.drafts[:, 0] * vocab + out.drafts[:, 1], minlength=vocab * vocab
    ).double()
    expected = joint.reshape(-1) * n
    assert expected.min() > 5  # chi-square validity
    p_value = stats.chisquare(
        observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()
    ).pvalue
    assert p_value > 0.01


def test_confidence_uses_previous_token_embedding():
    batch, gamma, vocab, rank, d = 6, 4, 30, 5, 7
    gen, base, w1, w2, anchors = _inputs(batch, gamma, vocab, rank, seed=2)
    out = markov_sample(
        base, w1, w2, anchors, torch.ones(batch), torch.ones(batch, dtype=torch.bool)
    )
    hidden = torch.randn((batch, gamma, d), generator=gen)
    w_y, w_e = torch.randn(d, generator=gen), torch.randn(rank, generator=gen)
    weight = torch.cat([w_y, w_e]).view(1, -1)
    temps = torch.tensor([0.5, 1.0, 2.0, 3.0])
    conf = confidence_head(hidden, out.markov_embeds, weight, bias=0.25, temperatures=temps)
    prev = torch.cat([anchors.view(-1, 1), out.drafts[:, :-1]], dim=1)
    raw_prev = hidden @ w_y + w1[prev] @ w_e + 0.25
    raw_self = hidden @ w_y + w1[out.drafts] @ w_e + 0.25
    torch.testing.assert_close(conf.raw, raw_prev, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(conf.raw, raw_self, atol=1e-3)
    torch.testing.assert_close(
        conf.confidence, torch.sigmoid(raw_prev / temps), rtol=1e-5, atol=1e-6
    )
    no_bias = confidence_head(hidden, out.markov_embeds, weight.view(-1))
    torch.testing.assert_close(no_bias.raw, raw_prev - 0.25, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="d \\+ r"):
        confidence_head(hidden, out.markov_embeds, torch.ones(d))


def _naive_target(logits_row, temp, top_k, top_p):
    if top_k <= 1 or temp <= 0:
        out = torch.zeros_like(logits_row, dtype=torch.float64)
        out[int(torch.argmax(logits_row))] = 1
        return out
    probs = torch.softmax(logits_row.double() / max(temp, 1e-5), -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept = order[: min(top_k, len(probs))]
    mass = sum(probs[i] for i in kept)
    renorm = {i: probs[i] / mass for i in kept}
    nucleus, acc = [], 0.0
    for i in kept:
        if acc < top_p or not nucleus:
            nucleus.append(i)
        acc += renorm[i]
    out = torch.zeros(len(probs), dtype=torch.float64)
    total = sum(renorm[i] for i in nucleus)
    for i in nucleus:
        out[i] = renorm[i] / total
    return out


def test_target_probs_match_naive():
    gen = torch.Generator().manual_seed(8)
    batch, width, vocab = 7, 3, 12
    logits = torch.randn((batch, width, vocab), generator=gen) * 3
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.0, 0.9, 1.0, 0.5])
    top_k = torch.tensor([TOP_K_ALL, 3, TOP_K_ALL, TOP_K_ALL, 1, 5, 2])
    top_p = torch.tensor([1.0, 1.0, 0.6, 1.0, 1.0, 0.8, 0.3])
    probs = target_probs(logits, temperature, top_k, top_p)
    for b in range(batch):
        for w in range(width):
            want = _naive_target(
                logits[b, w], float(temperature[b]), int(top_k[b]), float(top_p[b])
            )
            torch.testing.assert_close(probs[b, w].double(), want, rtol=1e-5, atol=1e-6)
    greedy = [p.is_greedy for p in _params(temperature, top_k, top_p)]
    assert greedy == [False, False, False, True, True, False, False]
    # A row without truncation is the plain tempered softmax.
    torch.testing.assert_close(probs[0], torch.softmax(logits[0], -1))


def test_target_probs_hand_derived():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    one = torch.ones(1)
    k2 = target_probs(logits, one, torch.tensor([2]), one)
    torch.testing.assert_close(k2[0, 0], torch.tensor([0.625, 0.375, 0.0]))
    p6 = target_probs(logits, one, torch.tensor([TOP_K_ALL]), torch.tensor([0.6]))
    torch.testing.assert_close(p6[0, 0], torch.tensor([0.625, 0.375, 0.0]))
    p4 = target_probs(logits, one, torch.tensor([TOP_K_ALL]), torch.tensor([0.4]))
    torch.testing.assert_close(p4[0, 0], torch.tensor([1.0, 0.0, 0.0]))


def test_draft_probs():
    gen = torch.Generator().manual_seed(4)
    z = torch.randn((3, 2, 5), generator=gen)
    drafts = torch.randint(0, 5, (3, 2), generator=gen)
    temperature = torch.tensor([0.5, 2.0, 1.0])
    greedy = torch.tensor([False, False, True])
    q = draft_probs(z, temperature, greedy, drafts)
    torch.testing.assert_close(q[0], torch.softmax(z[0] / 0.5, -1))
    torch.testing.assert_close(q[1], torch.softmax(z[1] / 2.0, -1))
    assert torch.equal(q[2], torch.nn.functional.one_hot(drafts[2], 5).float())
    assert math.isclose(float(q.sum()), 6.0, rel_tol=1e-5)
    _ = np  # numpy used by scipy interop only


def test_no_host_sync_on_meta_tensors():
    m, batch, gamma, vocab, rank = "meta", 3, 4, 11, 5
    out = markov_sample(
        torch.empty((batch, gamma, vocab), device=m),
        torch.empty((vocab, rank), device=m),
        torch.empty((vocab, rank), device=m),
        torch.empty(batch, dtype=torch.int64, device=m),
        torch.empty(batch, device=m),
        torch.empty(batch, dtype=torch.bool, device=m),
        uniforms=torch.empty((batch, gamma), device=m),
    )
    conf = confidence_head(
        torch.empty((batch, gamma, 7), device=m), out.markov_embeds, torch.empty(7 + rank, device=m)
    )
    info = SamplingBatchInfo.from_params(
        [SamplingParams(temperature=0.7, top_p=0.9)] * batch, vocab, m, counters=[0] * batch
    )
    probs = _target_probs(torch.empty((batch, 2, vocab), device=m), info)
    assert out.drafts.device.type == conf.confidence.device.type == probs.device.type == "meta"
