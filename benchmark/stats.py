"""Statistics for paired A/B benchmarking, written without scipy so the harness runs anywhere.

Contents:
- Student-t distribution (CDF, two-sided p-value, quantile) via the regularised incomplete beta.
- `paired_t`: two-sided paired t test with a confidence interval on the mean difference.
- `paired_bootstrap`: percentile bootstrap CI of the mean difference (seeded) and its p-value.
- `mcnemar`: exact (binomial) and chi-square-with-continuity McNemar tests on discordant pairs.
- `abba_schedule`: the launch order for n replicates of k arms (ABBA for k = 2, Williams otherwise).

The tests check every number here against scipy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction for the incomplete beta (modified Lentz); converges for x < (a+1)/(a+b+2)."""
    tiny = 1e-300
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 10_000):
        # Even step of the fraction.
        num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        result *= d * c
        # Odd step.
        num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        result *= delta
        if abs(delta - 1.0) < 1e-15:
            return result
    raise RuntimeError(f"incomplete beta did not converge (a={a}, b={b}, x={x})")


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    # Use the symmetry I_x(a,b) = 1 - I_{1-x}(b,a) where the fraction converges fastest.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be positive, got {df}")
    if math.isinf(t):
        return 0.0
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * t_two_sided_p(t, df)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(q: float, df: float) -> float:
    """Inverse CDF of Student's t, found by bisection on `t_cdf` (monotone, so always converges)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile q must be in (0, 1), got {q}")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
        if hi > 1e300:
            raise RuntimeError(f"t quantile diverged (q={q}, df={df})")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


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
    # Exact integer arithmetic: 2**n overflows a float for n > 1023, the integer ratio does not.
    p_exact = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)
    chi2 = max(abs(only_a - only_b) - 1, 0) ** 2 / n
    p_chi2 = math.erfc(math.sqrt(chi2 / 2.0))  # chi-square(1) survival = P(|Z| >= sqrt(chi2))
    return McNemarResult(only_a, only_b, p_exact, chi2, p_chi2)


def normal_quantile(q: float) -> float:
    """Inverse standard-normal CDF by bisection on 0.5 * erfc(-x / sqrt(2))."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile q must be in (0, 1), got {q}")
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


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
