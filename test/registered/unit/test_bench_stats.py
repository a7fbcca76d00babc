"""benchmark.stats against scipy and hand-derived values; run-order (ABBA / Williams) properties."""

from __future__ import annotations

import itertools
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # repo root, for `benchmark`

from benchmark import stats  # noqa: E402


@pytest.mark.parametrize("df", [1, 2, 3, 4.5, 7, 30, 250])
def test_t_distribution_matches_scipy(df: float) -> None:
    for t in [-12.0, -3.1, -0.4, 0.0, 0.05, 1.0, 2.2, 6.0, 40.0]:
        assert stats.t_cdf(t, df) == pytest.approx(sps.t.cdf(t, df), abs=1e-12)
        assert stats.t_two_sided_p(t, df) == pytest.approx(
            2 * sps.t.sf(abs(t), df), rel=1e-10, abs=1e-15
        )
    for q in [0.005, 0.025, 0.1, 0.5, 0.8, 0.95, 0.975, 0.995, 0.9995]:
        assert stats.t_quantile(q, df) == pytest.approx(sps.t.ppf(q, df), rel=1e-9, abs=1e-12)


def test_t_distribution_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="df"):
        stats.t_two_sided_p(1.0, 0)
    with pytest.raises(ValueError, match="quantile"):
        stats.t_quantile(1.0, 3)


@pytest.mark.parametrize("seed", range(6))
def test_paired_t_matches_scipy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for n in (2, 3, 4, 7, 40):
        base = rng.normal(1000.0, 50.0, n)
        cand = base + rng.normal(rng.uniform(-20, 20), rng.uniform(1, 30), n)
        for conf in (0.9, 0.95, 0.99):
            ours = stats.paired_t(base, cand, conf)
            ref = sps.ttest_rel(cand, base)
            ci = ref.confidence_interval(conf)
            assert ours.n == n and ours.method == "t"
            assert ours.mean == pytest.approx(np.mean(cand - base), rel=1e-12)
            assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-8)
            assert ours.ci_low == pytest.approx(ci.low, rel=1e-8)
            assert ours.ci_high == pytest.approx(ci.high, rel=1e-8)
            assert ours.ci_contains_zero == (ci.low <= 0 <= ci.high)


def test_paired_t_hand_derived() -> None:
    # d = 1, 2, 3, 4: mean 2.5, sd sqrt(5/3), se sqrt(5/12), t = 2.5 / sqrt(5/12) = sqrt(15).
    res = stats.paired_t([10.0, 10.0, 10.0, 10.0], [11.0, 12.0, 13.0, 14.0])
    se = math.sqrt(5.0 / 12.0)
    q = sps.t.ppf(0.975, 3)
    assert res.mean == pytest.approx(2.5)
    assert res.ci_low == pytest.approx(2.5 - q * se) and res.ci_high == pytest.approx(2.5 + q * se)
    assert res.p_value == pytest.approx(2 * sps.t.sf(math.sqrt(15.0), 3))


def test_paired_t_degenerate_differences() -> None:
    same = stats.paired_t([5.0, 6.0, 7.0], [5.0, 6.0, 7.0])
    assert (same.mean, same.ci_low, same.ci_high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    shifted = stats.paired_t([5.0, 6.0, 7.0], [7.0, 8.0, 9.0])
    assert shifted.ci_low == shifted.ci_high == pytest.approx(2.0) and shifted.p_value == 0.0
    assert not shifted.ci_contains_zero


@pytest.mark.parametrize(
    "base,cand,match",
    [
        ([1.0], [2.0], "at least 2"),
        ([1.0, 2.0], [1.0], "equally long"),
        ([1.0, math.nan], [1.0, 2.0], "finite"),
    ],
)
def test_paired_inputs_are_validated(base: list[float], cand: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        stats.paired_t(base, cand)
    with pytest.raises(ValueError, match=match):
        stats.paired_bootstrap(base, cand)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bootstrap_matches_scipy_percentile(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    base = rng.normal(100.0, 5.0, 30)
    cand = base + rng.normal(1.0, 2.0, 30)
    d = cand - base
    ours = stats.paired_bootstrap(base, cand, 0.95, n_resamples=40_000, seed=seed)
    ref = sps.bootstrap(
        (d,),
        np.mean,
        confidence_level=0.95,
        n_resamples=40_000,
        method="percentile",
        random_state=np.random.default_rng(seed + 7),
    ).confidence_interval
    se = d.std(ddof=1) / math.sqrt(d.size)
    # Two independent Monte Carlo estimates of the same quantiles: agree to a few % of the SE.
    assert ours.ci_low == pytest.approx(ref.low, abs=0.05 * se)
    assert ours.ci_high == pytest.approx(ref.high, abs=0.05 * se)
    assert ours.mean == pytest.approx(d.mean())


def test_bootstrap_is_seeded_and_p_value_behaves() -> None:
    rng = np.random.default_rng(5)
    base = rng.normal(0.0, 1.0, 12)
    shifted = base + rng.normal(3.0, 0.5, 12)
    a = stats.paired_bootstrap(base, shifted, seed=11)
    b = stats.paired_bootstrap(base, shifted, seed=11)
    c = stats.paired_bootstrap(base, shifted, seed=12)
    assert a == b and (a.ci_low, a.ci_high) != (c.ci_low, c.ci_high)
    assert a.p_value < 1e-3 and not a.ci_contains_zero
    # Differences symmetric around 0: the bootstrap mean falls on either side equally often.
    sym = stats.paired_bootstrap([0.0] * 6, [-3.0, -2.0, -1.0, 1.0, 2.0, 3.0], seed=3)
    assert sym.p_value > 0.8 and sym.ci_contains_zero


def test_mcnemar_exact_and_chi2_match_scipy() -> None:
    pairs = [(0, 1), (1, 0), (0, 5), (3, 12), (7, 7), (10, 4), (40, 61), (300, 341), (650, 700)]
    for only_a, only_b in pairs:
        res = stats.mcnemar(only_a, only_b)
        n, k = only_a + only_b, min(only_a, only_b)
        assert res.p_exact == pytest.approx(sps.binomtest(k, n, 0.5).pvalue, rel=1e-9)
        chi2 = max(abs(only_a - only_b) - 1, 0) ** 2 / n
        assert res.chi2 == pytest.approx(chi2)
        assert res.p_chi2 == pytest.approx(sps.chi2.sf(chi2, 1), rel=1e-9)


def test_mcnemar_hand_derived() -> None:
    res = stats.mcnemar(0, 5)  # all five discordant pairs favour one side: 2 * (1/2)^5
    assert res.p_exact == pytest.approx(0.0625)
    assert res.chi2 == pytest.approx(16.0 / 5.0)
    none = stats.mcnemar(0, 0)
    assert (none.p_exact, none.p_chi2) == (1.0, 1.0)
    with pytest.raises(ValueError, match="discordant"):
        stats.mcnemar(-1, 2)


def test_normal_quantile_and_paired_proportion_bound() -> None:
    for q in (0.01, 0.05, 0.5, 0.9, 0.95, 0.999):
        assert stats.normal_quantile(q) == pytest.approx(sps.norm.ppf(q), abs=1e-9)
    # n = 100, 6 only-baseline, 2 only-candidate: diff -0.04, var = (8 - 16/100) / 100^2.
    diff, lower = stats.paired_proportion_lower_bound(6, 2, 100, alpha=0.05)
    assert diff == pytest.approx(-0.04)
    assert lower == pytest.approx(-0.04 - sps.norm.ppf(0.95) * math.sqrt(7.84) / 100)
    assert stats.paired_proportion_lower_bound(0, 0, 50) == (0.0, 0.0)
    with pytest.raises(ValueError):
        stats.paired_proportion_lower_bound(30, 30, 50)


def test_abba_schedule_two_arms() -> None:
    order = stats.abba_schedule(6, ["A", "B"])
    assert [arm for _, arm in order] == list("ABBAABBAABBA")
    assert sorted(order) == sorted(itertools.product(range(6), ["A", "B"]))
    firsts = [order[2 * r][1] for r in range(6)]
    assert Counter(firsts) == {"A": 3, "B": 3}  # never baseline-first every time
    with pytest.raises(ValueError):
        stats.abba_schedule(0, ["A", "B"])
    with pytest.raises(ValueError):
        stats.abba_schedule(2, ["A", "A"])


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_williams_design_is_balanced(k: int) -> None:
    seqs = stats.williams_sequences(k)
    assert len(seqs) == (2 * k if k % 2 and k > 1 else k)
    for s in seqs:
        assert sorted(s) == list(range(k))
    for pos in range(k):  # each arm equally often in each position
        counts = Counter(s[pos] for s in seqs)
        assert set(counts) == set(range(k)) and len(set(counts.values())) == 1
    neighbours = Counter((s[i], s[i + 1]) for s in seqs for i in range(k - 1))
    if k > 1:  # first-order carry-over: every ordered pair of distinct arms equally often
        assert set(neighbours) == {(a, b) for a in range(k) for b in range(k) if a != b}
        assert len(set(neighbours.values())) == 1


def test_three_arm_schedule_covers_each_replicate() -> None:
    order = stats.abba_schedule(6, ["base", "cand", "aa"])
    assert len(order) == 18
    for rep in range(6):
        assert sorted(arm for r, arm in order if r == rep) == ["aa", "base", "cand"]
    firsts = Counter(order[3 * r][1] for r in range(6))
    assert firsts == {"base": 2, "cand": 2, "aa": 2}
