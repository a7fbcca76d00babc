"""Statistics for paired A/B benchmarking; the distributions are scipy.stats'.

Contents:
- Student-t distribution (CDF, two-sided p-value, quantile).
- `paired_t`: two-sided paired t test with a confidence interval on the mean difference.
- `paired_bootstrap`: percentile bootstrap CI of the mean difference (seeded) and its p-value.
- `mcnemar`: exact (binomial) and chi-square-with-continuity McNemar tests on discordant pairs.
- `abba_schedule`: the launch order for n replicates of k arms (ABBA for k = 2, Williams otherwise).

Install with the `bench` extra (`pip install -e ".[bench]"`: scipy, matplotlib).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

__all__ = [
    "PairedStats",
    "McNemarResult",
    "t_cdf",
    "t_two_sided_p",
    "t_quantile",
    "paired_t",
    "paired_bootstrap",
    "mcnemar",
    "normal_quantile",
    "paired_proportion_lower_bound",
    "abba_schedule",
    "williams_sequences",
]


@dataclass(frozen=True, slots=True)
class PairedStats:
    """Inference on the mean of paired differences d_i = candidate_i - baseline_i."""

    method: str  # "t" or "bootstrap"
    n: int
    mean: float
    ci_low: float
    ci_high: float
    p_value: float
    confidence: float

    @property
    def ci_contains_zero(self) -> bool:
        return self.ci_low <= 0.0 <= self.ci_high


@dataclass(frozen=True, slots=True)
class McNemarResult:
    """McNemar test on discordant counts.

    `only_a` = items baseline got right and candidate wrong, `only_b` the reverse.
    """

    only_a: int
    only_b: int
    p_exact: float
    chi2: float
    p_chi2: float


# ----------------------------------------------------------------------------- t distribution


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be positive, got {df}")
    return float(2.0 * scipy_stats.t.sf(abs(t), df))


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be positive, got {df}")
    return float(scipy_stats.t.cdf(t, df))


def t_quantile(q: float, df: float) -> float:
    """Inverse CDF of Student's t."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile q must be in (0, 1), got {q}")
    return float(scipy_stats.t.ppf(q, df))


# ----------------------------------------------------------------------------- paired tests


def _paired_diffs(baseline: Sequence[float], candidate: Sequence[float]) -> np.ndarray:
    a = np.asarray(baseline, dtype=np.float64)
    b = np.asarray(candidate, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(
            f"baseline and candidate must be 1-D and equally long, got {a.shape} and {b.shape}"
        )
    if a.size < 2:
        raise ValueError(f"need at least 2 pairs for a paired test, got {a.size}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("baseline and candidate must be finite")
    return b - a


def paired_t(
    baseline: Sequence[float], candidate: Sequence[float], confidence: float = 0.95
) -> PairedStats:
    """Two-sided paired t test of mean(candidate - baseline) = 0, with a `confidence` CI.

    When every difference is identical the standard error is 0: the CI collapses onto the mean and
    p is 1 if that mean is 0, else 0 (scipy returns NaN here).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    d = _paired_diffs(baseline, candidate)
    n = d.size
    mean = float(d.mean())
    se = float(d.std(ddof=1)) / math.sqrt(n)
    if se == 0.0:
        return PairedStats("t", n, mean, mean, mean, 1.0 if mean == 0.0 else 0.0, confidence)
    t = mean / se
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * se
    return PairedStats("t", n, mean, mean - half, mean + half, t_two_sided_p(t, n - 1), confidence)


def paired_bootstrap(
    baseline: Sequence[float],
    candidate: Sequence[float],
    confidence: float = 0.95,
    n_resamples: int = 10_000,
    seed: int = 0,
) -> PairedStats:
    """Percentile bootstrap of mean(candidate - baseline), resampling pairs with replacement.

    p-value: twice the smaller bootstrap tail mass on either side of 0 (capped at 1), the test that
    matches the percentile interval. With few pairs (n = 4 has 35 distinct resamples) the
    interval is too narrow; the t interval is the primary result and this one is a cross-check.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_resamples < 100:
        raise ValueError(f"n_resamples must be >= 100, got {n_resamples}")
    d = _paired_diffs(baseline, candidate)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(n_resamples, d.size))
    means = d[idx].mean(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    below = float(np.mean(means <= 0.0))
    above = float(np.mean(means >= 0.0))
    p = min(1.0, 2.0 * min(below, above))
    return PairedStats("bootstrap", d.size, float(d.mean()), float(lo), float(hi), p, confidence)


def mcnemar(only_a: int, only_b: int) -> McNemarResult:
    """McNemar test for paired binary outcomes (e.g. per-question correctness of two runs).

    Args:
        only_a: pairs where only the baseline was correct. only_b: only the candidate.
    Returns:
        p_exact: two-sided exact binomial test, min(1, 2 * P[X <= min(only_a, only_b)]) with
            X ~ Binomial(only_a + only_b, 1/2).
        chi2, p_chi2: Edwards' continuity-corrected statistic (|only_a - only_b| - 1)^2 / (only_a +
            only_b) (0 when the counts are equal) on one degree of freedom.
        Both p-values are 1 when there are no discordant pairs.
    """
    if only_a < 0 or only_b < 0:
        raise ValueError(f"discordant counts must be >= 0, got {only_a}, {only_b}")
    n = only_a + only_b
    if n == 0:
        return McNemarResult(only_a, only_b, 1.0, 0.0, 1.0)
    k = min(only_a, only_b)
    # Binomial(n, 1/2) is symmetric: the two-sided p is twice the lower tail, capped at 1.
    p_exact = min(1.0, 2.0 * float(scipy_stats.binom.cdf(k, n, 0.5)))
    chi2 = max(abs(only_a - only_b) - 1, 0) ** 2 / n
    p_chi2 = float(scipy_stats.chi2.sf(chi2, 1))
    return McNemarResult(only_a, only_b, p_exact, chi2, p_chi2)


def normal_quantile(q: float) -> float:
    """Inverse standard-normal CDF."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile q must be in (0, 1), got {q}")
    return float(scipy_stats.norm.ppf(q))


def paired_proportion_lower_bound(
    only_a: int, only_b: int, n: int, alpha: float = 0.05
) -> tuple[float, float]:
    """One-sided (1 - alpha) Wald lower bound on p_b - p_a for n paired binary outcomes.

    Returns (difference, lower bound) with difference = (only_b - only_a) / n and variance
    ((only_a + only_b) - (only_b - only_a)^2 / n) / n^2 (the paired-proportion formula). Candidate
    b is non-inferior at margin m when the lower bound is > -m.
    """
    if n < 1 or only_a < 0 or only_b < 0 or only_a + only_b > n:
        raise ValueError(f"need 0 <= only_a + only_b <= n and n >= 1, got {only_a}, {only_b}, {n}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    diff = (only_b - only_a) / n
    var = ((only_a + only_b) - (only_b - only_a) ** 2 / n) / n**2
    return diff, diff - normal_quantile(1.0 - alpha) * math.sqrt(max(var, 0.0))


# ----------------------------------------------------------------------------- run order


def williams_sequences(n_arms: int) -> list[list[int]]:
    """Williams design: each arm once per position and (for the full set) each ordered pair of
    neighbours equally often, so first-order carry-over (warm caches, thermal state) cancels.

    Returns n_arms sequences for an even count, 2 * n_arms for an odd count (mirror images added).
    """
    if n_arms < 1:
        raise ValueError(f"n_arms must be >= 1, got {n_arms}")
    first = [0]
    low, high = 1, n_arms - 1
    while len(first) < n_arms:
        first.append(low)
        low += 1
        if len(first) < n_arms:
            first.append(high)
            high -= 1
    rows = [[(x + shift) % n_arms for x in first] for shift in range(n_arms)]
    if n_arms % 2 == 1 and n_arms > 1:
        rows += [list(reversed(r)) for r in rows]
    return rows


def abba_schedule(n_replicates: int, arms: Sequence[str]) -> list[tuple[int, str]]:
    """Launch order: a list of (replicate index, arm name), one launch per arm per replicate.

    Two arms give A B | B A | A B | ... (ABBA); more arms cycle through Williams sequences. The
    first arm is never first in every replicate. Balance is exact when n_replicates is a multiple
    of the cycle length (2 for two arms, 6 for three).
    """
    if n_replicates < 1:
        raise ValueError(f"n_replicates must be >= 1, got {n_replicates}")
    if len(set(arms)) != len(arms) or not arms:
        raise ValueError(f"arms must be distinct and non-empty, got {list(arms)}")
    seqs = williams_sequences(len(arms))
    order: list[tuple[int, str]] = []
    for rep in range(n_replicates):
        order += [(rep, arms[i]) for i in seqs[rep % len(seqs)]]
    return order
