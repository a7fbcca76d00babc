"""Sampler: filtered distributions vs a float64 reference (exact and chi-square), greedy = argmax,
logprobs = raw log_softmax, and seed reproducibility independent of batch composition."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from scipy import stats
from sgl_dspark.srt.layers.sampler import (
    SAMPLER_STREAM,
    Sampler,
    SamplingBatchInfo,
    counter_uniform,
    processed_probs,
    sample_from_probs,
)
from sgl_dspark.srt.sampling import SamplingParams


def ref_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Spec of the module doc, written out with Python loops in float64."""
    z = logits.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept = order[: p.top_k] if p.top_k > 0 else order
    kept_mass = sum(probs[i] for i in kept)
    nucleus, mass_before = [], 0.0
    for i in kept:
        if p.top_p >= 1.0 or mass_before < p.top_p:
            nucleus.append(i)
        mass_before += probs[i] / kept_mass
    threshold = p.min_p * probs.max()
    final = [i for i in nucleus if probs[i] >= threshold]
    out = np.zeros_like(probs)
    out[final] = probs[final]
    return out / out.sum()


def boundary_margin(logits: np.ndarray, p: SamplingParams) -> float:
    """Distance of the top-p / min-p decisions from their thresholds (fp32 vs fp64 safety)."""
    z = logits.astype(np.float64) / p.temperature
    probs = np.sort(np.exp(z - z.max()) / np.exp(z - z.max()).sum())[::-1]
    kept = probs[: p.top_k] if p.top_k > 0 else probs
    before = np.cumsum(kept / kept.sum()) - kept / kept.sum()
    margins = [1.0]
    if p.top_p < 1.0:
        margins.append(np.abs(before - p.top_p).min())
    if p.min_p > 0.0:
        margins.append(np.abs(probs - p.min_p * probs[0]).min())
    return float(min(margins))


def random_case(rng: random.Random, vocab: int) -> tuple[np.ndarray, SamplingParams]:
    while True:
        logits = np.array([rng.gauss(0.0, 1.5) for _ in range(vocab)], dtype=np.float32)
        params = SamplingParams(
            temperature=rng.choice([0.5, 0.8, 1.0, 1.7]),
            top_k=rng.choice([-1, -1, 2, 4, vocab - 1, vocab + 5]),
            top_p=rng.choice([1.0, 1.0, 0.9, 0.6, 0.3]),
            min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
        )
        if boundary_margin(logits, params) > 1e-3:
            return logits, params


def _info(params, vocab, **kw):
    return SamplingBatchInfo.from_params(params, vocab, "cpu", **kw)


# ---------------------------------------------------------------- distribution (exact)


@pytest.mark.parametrize(
    ("probs", "params", "expected"),
    [
        ([0.5, 0.25, 0.125, 0.125], {"top_p": 0.6}, [2 / 3, 1 / 3, 0, 0]),
        ([0.5, 0.25, 0.125, 0.125], {"top_p": 0.8}, [4 / 7, 2 / 7, 1 / 7, 0]),
        ([0.5, 0.25, 0.125, 0.125], {"min_p": 0.3}, [2 / 3, 1 / 3, 0, 0]),
        # top-p applies to the top-k distribution renormalised: 4/7 >= 0.5 already.
        ([0.4, 0.3, 0.2, 0.1], {"top_k": 2, "top_p": 0.5}, [1, 0, 0, 0]),
        ([0.4, 0.3, 0.2, 0.1], {"top_k": 3}, [4 / 9, 3 / 9, 2 / 9, 0]),
        ([0.1, 0.3, 0.3, 0.3], {"top_k": 2}, [0, 0.5, 0.5, 0]),  # ties: lower id kept
        ([0.4, 0.3, 0.2, 0.1], {"temperature": 0.5}, [16 / 30, 9 / 30, 4 / 30, 1 / 30]),
    ],
)
def test_processed_probs_hand_cases(probs, params, expected):
    logits = torch.log(torch.tensor([probs], dtype=torch.float32))
    got = processed_probs(logits, _info([SamplingParams(**params)], len(probs)))
    torch.testing.assert_close(
        got[0], torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6
    )


def test_processed_probs_matches_reference_mixed_batch():
    rng = random.Random(0)
    for vocab in (5, 17, 64):
        cases = [random_case(rng, vocab) for _ in range(24)]
        logits = torch.from_numpy(np.stack([c[0] for c in cases]))
        got = processed_probs(logits, _info([c[1] for c in cases], vocab)).double().numpy()
        want = np.stack([ref_probs(*c) for c in cases])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        assert ((got == 0) == (want == 0)).all()


# ---------------------------------------------------------------- sampling (chi-square)


def _chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("vocab", [6, 12])
def test_sampled_histograms_match_filtered_distribution(vocab):
    rng = random.Random(vocab)
    cases = [random_case(rng, vocab) for _ in range(8)]
    cases.append((cases[0][0], SamplingParams(temperature=0.0)))  # a greedy row in the mix
    draws = 12_000
    params = [c[1] for c in cases] * draws  # row r uses case r % len(cases)
    logits = torch.from_numpy(np.stack([c[0] for c in cases])).repeat(draws, 1)
    info = _info(params, vocab, generator=torch.Generator().manual_seed(vocab))
    ids = Sampler()(logits, info).next_token_ids.view(draws, len(cases)).numpy()
    for j, (case_logits, case_params) in enumerate(cases):
        counts = np.bincount(ids[:, j], minlength=vocab)
        expected = (
            ref_probs(case_logits, case_params)
            if not case_params.is_greedy
            else np.eye(vocab)[int(np.argmax(case_logits))]
        )
        assert (counts[expected == 0] == 0).all(), (j, counts, expected)
        if (expected > 0).sum() > 1:
            assert _chi_square_pvalue(counts, expected) > 1e-4, (j, counts, expected)


def test_seeded_sampling_over_counters_matches_distribution():
    vocab, steps = 8, 15_000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.1, -1.0, 0.7]])
    params = SamplingParams(temperature=1.3, top_k=6, seed=2024)
    info = _info([params] * steps, vocab, counters=range(steps))
    ids = Sampler()(logits.repeat(steps, 1), info).next_token_ids.numpy()
    counts = np.bincount(ids, minlength=vocab)
    expected = ref_probs(logits[0].numpy(), params)
    assert (counts[expected == 0] == 0).all()
    assert _chi_square_pvalue(counts, expected) > 1e-4


# ---------------------------------------------------------------- greedy and logprobs


def test_greedy_is_first_argmax_and_logprobs_are_temperature_scaled():
    """Logprobs as SGLang reports them: log_softmax(logits / temperature) (1 for greedy rows),
    before top-p."""
    gen = torch.Generator().manual_seed(3)
    vocab, batch = 50, 40
    logits = torch.randn(batch, vocab, generator=gen) * 3
    # Duplicate each row's maximum at a later index for half the rows: ties -> first index.
    for r in range(0, batch, 2):
        top = int(logits[r].argmax())
        logits[r, (top + 7) % vocab] = logits[r, top]
    rng = random.Random(3)
    params = [
        SamplingParams(temperature=0.0)
        if r % 3
        else SamplingParams(temperature=rng.choice([0.7, 2.0]), top_p=0.9)
        for r in range(batch)
    ]
    out = Sampler()(logits, _info(params, vocab, generator=gen))
    ref_logits = logits.double().numpy()
    for r, p in enumerate(params):
        row = ref_logits[r]
        if p.is_greedy:
            assert int(out.next_token_ids[r]) == int(np.argmax(row))  # numpy: first on ties
    temps = np.array([1.0 if p.is_greedy else p.temperature for p in params])[:, None]
    ref_logits = ref_logits / temps
    log_softmax = ref_logits - (
        np.log(np.exp(ref_logits - ref_logits.max(1, keepdims=True)).sum(1, keepdims=True))
        + ref_logits.max(1, keepdims=True)
    )
    chosen = log_softmax[np.arange(batch), out.next_token_ids.numpy()]
    np.testing.assert_allclose(out.next_token_logprobs.numpy(), chosen, rtol=1e-5, atol=1e-5)
    assert (
        out.next_token_ids.dtype == torch.int64 and out.next_token_logprobs.dtype == torch.float32
    )


def test_all_greedy_batch_and_edge_shapes():
    logits = torch.tensor([[0.0, 3.0, 3.0], [5.0, -1.0, 2.0]])
    info = _info([SamplingParams(top_k=1), SamplingParams(temperature=0)], 3)
    assert info.all_greedy
    assert Sampler()(logits, info).next_token_ids.tolist() == [1, 0]
    empty = Sampler()(torch.empty(0, 3), _info([], 3))
    assert empty.next_token_ids.shape == (0,)
    single = Sampler()(torch.tensor([[0.25]]), _info([SamplingParams(top_p=0.5)], 1))
    assert single.next_token_ids.tolist() == [0] and abs(float(single.next_token_logprobs)) < 1e-6


# ---------------------------------------------------------------- seeds


def _batch_with(
    target: SamplingParams,
    target_logits: torch.Tensor,
    step: int,
    rng: random.Random,
    gen: torch.Generator,
) -> tuple[torch.Tensor, SamplingBatchInfo, int]:
    """A random batch containing the target row at a random position."""
    vocab = target_logits.shape[0]
    size = rng.randint(1, 6)
    others = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.6, 1.5]),
            top_k=rng.choice([-1, 3, 50]),
            top_p=rng.choice([1.0, 0.5]),
            min_p=rng.choice([0.0, 0.1]),
            seed=rng.choice([None, rng.randrange(2**63)]),
        )
        for _ in range(size)
    ]
    pos = rng.randint(0, size)
    params = others[:pos] + [target] + others[pos:]
    logits = torch.randn(size + 1, vocab, generator=gen)
    logits[pos] = target_logits
    counters = [rng.randrange(10**6) for _ in params]
    counters[pos] = step
    return logits, _info(params, vocab, counters=counters, generator=gen), pos


@pytest.mark.parametrize(
    "target_kwargs",
    [{"temperature": 1.5}, {"top_p": 0.8, "top_k": 100}, {"min_p": 0.02, "temperature": 0.9}],
)
def test_seeded_request_independent_of_batch(target_kwargs):
    gen = torch.Generator().manual_seed(11)
    rng = random.Random(11)
    vocab, steps = 300, 40
    target = SamplingParams(seed=987654321, **target_kwargs)
    step_logits = torch.randn(steps, vocab, generator=gen) * 2
    alone = [
        int(
            Sampler()(step_logits[s : s + 1], _info([target], vocab, counters=[s])).next_token_ids[
                0
            ]
        )
        for s in range(steps)
    ]
    for trial in range(3):
        mixed = []
        for s in range(steps):
            logits, info, pos = _batch_with(target, step_logits[s], s, rng, gen)
            mixed.append(int(Sampler()(logits, info).next_token_ids[pos]))
        assert mixed == alone, trial
    other_seed = SamplingParams(seed=987654322, **target_kwargs)
    changed = [
        int(
            Sampler()(
                step_logits[s : s + 1], _info([other_seed], vocab, counters=[s])
            ).next_token_ids[0]
        )
        for s in range(steps)
    ]
    assert changed != alone  # 40 draws from a high-entropy row: equal by chance ~never
    assert len(set(alone)) > 5  # the counter advances the stream


def test_counters_required_with_seed_and_validated():
    with pytest.raises(ValueError, match="counters"):
        _info([SamplingParams(seed=1)], 4)
    with pytest.raises(ValueError, match="counters"):
        _info([SamplingParams(), SamplingParams()], 4, counters=[0])
    with pytest.raises(ValueError, match="counters"):
        _info([SamplingParams()], 4, counters=[-1])
    with pytest.raises(ValueError, match="vocab_size"):
        _info([SamplingParams()], 0)


def test_unseeded_rows_use_generator():
    params = [SamplingParams(temperature=2.0)] * 64
    logits = torch.zeros(64, 100)
    draw = lambda s: Sampler()(
        logits, _info(params, 100, generator=torch.Generator().manual_seed(s))
    ).next_token_ids.tolist()
    assert draw(5) == draw(5) and draw(5) != draw(6)


def test_select_keeps_each_rows_record_and_the_batch_flags():
    """A narrowed record (tensor parallelism samples only the rows it gathered whole): each
    kept row has its own parameters, seed and counter, an unseeded row the key it was drawn in
    the whole batch, and the host flags stay the batch's."""
    params = [
        SamplingParams(temperature=0.7, top_k=5, seed=11),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_p=0.8),
        SamplingParams(temperature=1.2, min_p=0.1, seed=4),
    ]
    whole = _info(params, 50, counters=[3, 9, 6, 2], generator=torch.Generator().manual_seed(1))
    # The unseeded rows' keys are drawn in row order (here rows 1 and 2) from the generator.
    keys = torch.randint(0, 2**63 - 1, (2,), generator=torch.Generator().manual_seed(1)).tolist()
    got = whole.select(torch.tensor([3, 2, 0]))
    assert got.batch_size == 3
    torch.testing.assert_close(got.temperatures, torch.tensor([1.2, 1.5, 0.7]))
    assert got.top_ks.tolist() == [50, 50, 5]
    torch.testing.assert_close(got.top_ps, torch.tensor([1.0, 0.8, 1.0]))
    torch.testing.assert_close(got.min_ps, torch.tensor([0.1, 0.0, 0.0]))
    assert got.is_greedy.tolist() == [False, False, False]
    assert got.seeds.tolist() == [4, keys[1], 11] and got.counters.tolist() == [2, 6, 3]
    want = counter_uniform(torch.tensor([4, keys[1], 11]), torch.tensor([2, 6, 3]), 7)
    assert torch.equal(got.uniforms(7), want)
    assert (got.all_greedy, got.need_top_k, got.need_top_p, got.need_min_p) == (
        False,
        True,
        True,
        True,
    )
    assert whole.select(torch.tensor([1])).is_greedy.tolist() == [True]


# ---------------------------------------------------------------- uniforms and inverse CDF


def test_counter_uniform_is_uniform_and_deterministic():
    n = 50_000
    by_counter = counter_uniform(torch.full((n,), 12345), torch.arange(n), SAMPLER_STREAM)
    by_seed = counter_uniform(torch.arange(n) * 7 + 3, torch.full((n,), 9), SAMPLER_STREAM)
    big = counter_uniform(torch.full((n,), 2**62 + 5), torch.arange(n) + 2**40, SAMPLER_STREAM)
    for u in (by_counter, by_seed, big):
        assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
        assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-4
    assert abs(np.corrcoef(by_counter[:-1], by_counter[1:])[0, 1]) < 0.03
    again = counter_uniform(torch.full((n,), 12345), torch.arange(n), SAMPLER_STREAM)
    assert torch.equal(by_counter, again)
    other_stream = counter_uniform(torch.full((n,), 12345), torch.arange(n), SAMPLER_STREAM + 1)
    assert abs(np.corrcoef(by_counter, other_stream)[0, 1]) < 0.03


def test_inverse_cdf_never_picks_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.4999, 0.5, 1.0 - 2.0**-24])
    assert sample_from_probs(probs, u).tolist() == [1, 1, 3, 3]
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(2000, 30, generator=gen) * (torch.rand(2000, 30, generator=gen) < 0.2)
    probs[:, 7] += 1e-3  # every row keeps some mass
    extremes = torch.tensor([0.0, 1.0 - 2.0**-24]).repeat(1000)
    for u in (torch.rand(2000, generator=gen), extremes):
        picked = sample_from_probs(probs, u)
        assert (probs.gather(1, picked[:, None]) > 0).all()


def test_temperature_limit_is_sharp():
    logits = torch.tensor([[1.0, 1.2, 0.9]])
    info = _info([SamplingParams(temperature=1e-5, seed=1)], 3, counters=[0])
    assert Sampler()(logits, info).next_token_ids.tolist() == [1]
    assert math.isclose(float(processed_probs(logits, info)[0, 1]), 1.0)


# ---------------------------------------------------------------- totality


def _extreme_params(vocab: int) -> list[dict]:
    """Values SamplingParams accepts at the edges of its ranges (and past fp32's)."""
    return [
        {"top_p": 1e-46},  # rounds to 0 in fp32
        {"top_p": 5e-324},  # the smallest positive double
        {"top_p": 1e-30, "top_k": 3},
        {"top_k": vocab},
        {"top_k": vocab + 1},
        {"top_k": 2**63 - 1},
        {"top_k": 2**63},
        {"top_k": 2**64},
        {"top_k": 10**30, "top_p": 1e-46},
        {"temperature": 1.0000001e-6},  # just above the greedy threshold
        {"temperature": 1e-5, "top_p": 1e-46},
        {"temperature": 1e5},
        {"temperature": 1e300},  # past fp32's range
        {"temperature": 1.7e308, "min_p": 1.0},
        {"min_p": 1e-46},
        {"min_p": 1.0},
        {"min_p": 1.0, "top_p": 1e-46, "top_k": 1},
    ]


def test_sampler_total_over_extreme_validated_values():
    """Every accepted parameter value yields a distribution with mass and a token in the
    vocabulary; a top_p that underflows fp32 (or min_p 1) keeps exactly the most probable token."""
    vocab = 64
    gen = torch.Generator().manual_seed(3)
    extremes = _extreme_params(vocab)
    params = [SamplingParams(seed=i, **kw) for i, kw in enumerate(extremes)]
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    info = _info(params, vocab, counters=list(range(len(params))))
    probs = processed_probs(logits, info)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(params)))
    out = Sampler()(logits, info)
    ids = out.next_token_ids
    assert ((ids >= 0) & (ids < vocab)).all()
    assert torch.isfinite(out.next_token_logprobs).all()
    argmax = logits.argmax(-1)
    for row, kw in enumerate(extremes):
        narrow = kw.get("top_p", 1.0) < 1e-29 or kw.get("min_p") == 1.0 or kw.get("top_k") == 1
        if narrow and kw.get("temperature", 1.0) < 1e300:  # (at 1e300 every token ties)
            assert int(ids[row]) == int(argmax[row]), kw
            if not params[row].is_greedy:  # (greedy rows carry neutral filters)
                assert float(probs[row, argmax[row]]) == 1.0, kw
        if kw.get("temperature", 1.0) >= 1e300:
            # The infinite-temperature limit: uniform over the vocabulary (min_p 1 keeps all).
            torch.testing.assert_close(probs[row], torch.full((vocab,), 1 / vocab))


def test_extreme_rows_leave_the_other_rows_of_the_batch_unchanged():
    vocab = 64
    gen = torch.Generator().manual_seed(4)
    normal = [SamplingParams(temperature=0.9, top_p=0.8, seed=100 + i) for i in range(4)]
    extreme = [SamplingParams(seed=i, **kw) for i, kw in enumerate(_extreme_params(vocab))]
    logits_n = torch.randn(len(normal), vocab, generator=gen)
    logits_x = torch.randn(len(extreme), vocab, generator=gen) * 3
    alone = Sampler()(logits_n, _info(normal, vocab, counters=[5] * len(normal)))
    mixed = Sampler()(
        torch.cat([logits_x[:8], logits_n, logits_x[8:]]),
        _info(extreme[:8] + normal + extreme[8:], vocab, counters=[5] * (len(extreme) + 4)),
    )
    assert mixed.next_token_ids[8:12].tolist() == alone.next_token_ids.tolist()
    assert torch.equal(mixed.next_token_logprobs[8:12], alone.next_token_logprobs)


def test_inverse_cdf_of_nan_or_massless_rows_stays_in_the_vocabulary():
    probs = torch.tensor(
        [
            [float("nan")] * 5,
            [0.0, float("nan"), 0.5, float("nan"), 0.5],
            [0.0] * 5,
            [float("inf"), 0.0, 0.25, 0.0, 0.0],
        ]
    )
    for u in (0.0, 0.5, 1.0 - 2.0**-24):
        picked = sample_from_probs(probs, torch.full((4,), u)).tolist()
        assert picked[0] == 0 and picked[2] == 0
        assert picked[1] in (2, 4) and picked[3] == 2


# ---------------------------------------------------------------- greedy picks by kernel family


@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 3000)])
def test_greedy_pick_of_the_triton_family_and_the_logits_reader(rows, vocab):
    """An all-greedy batch on the triton "sampling" family (the logprob summed in the argmax
    launches) against the torch family: the same ids, logprobs within fp32 rounding, NaN where
    log_softmax gives NaN. The one-rank LogitsReader returns the sampler's picks bit for bit
    and the logprob at probe ids within rounding of log_softmax; under batch invariance the
    triton family keeps log_softmax itself."""
    from sgl_dspark.srt.core.kernel_choice import KernelChoice
    from sgl_dspark.srt.distributed.communicator import SingleProcessCommunicator
    from sgl_dspark.srt.layers.vocab_parallel import LogitsReader

    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton compiled, or interpreted
    gen = torch.Generator().manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    if rows > 1:
        logits[0, vocab // 2] = float("nan")
    logits = logits.to(device)
    info = SamplingBatchInfo.from_params([SamplingParams(temperature=0)] * rows, vocab, device)
    triton = KernelChoice(backend="triton")
    want = Sampler()(logits, info)
    got = Sampler(triton)(logits, info)
    assert torch.equal(got.next_token_ids, want.next_token_ids)
    torch.testing.assert_close(got.next_token_logprobs, want.next_token_logprobs, equal_nan=True)
    assert torch.isnan(got.next_token_logprobs[0]).item() == (rows > 1)

    probes = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    full = torch.log_softmax(logits, -1)
    for kernels in (KernelChoice(), triton):
        pick = LogitsReader(vocab, SingleProcessCommunicator(), kernels).greedy(logits, probes)
        sampler = Sampler(kernels)(logits, info)
        assert torch.equal(pick.ids, sampler.next_token_ids)
        assert torch.equal(
            pick.logprobs.view(torch.int32), sampler.next_token_logprobs.view(torch.int32)
        )
        assert pick.probe_logprobs is not None
        want_probe = full.gather(1, probes[:, None]).squeeze(1)
        torch.testing.assert_close(pick.probe_logprobs, want_probe, equal_nan=True)

    invariant = KernelChoice(backend="triton", batch_invariant=True)
    fixed = Sampler(invariant)(logits, info).next_token_logprobs
    assert torch.equal(fixed.view(torch.int32), want.next_token_logprobs.view(torch.int32))
