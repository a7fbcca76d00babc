"""Derived constants of Engram hashing: the primes that size each (n-gram, head) table slice,
their row offsets, and the per-layer odd multipliers. Pure functions of the config."""

from __future__ import annotations

import numpy as np

_INT64_MAX = int(np.iinfo(np.int64).max)
_MULTIPLIER_SEED = 10007


# Miller-Rabin with these bases is exact for every n below 3.4e14.
_WITNESSES = (2, 3, 5, 7, 11, 13, 17)
_EXACT_BELOW = 341_550_071_728_321


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for w in _WITNESSES:
        if n % w == 0:
            return n == w
    assert n < _EXACT_BELOW, f"primality of {n} is not certain with these witnesses"
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for w in _WITNESSES:
        x = pow(w, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(
    layer_ids: tuple[int, ...], max_ngram_size: int, n_heads: int, vocab_size: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Primes `[layer][n-gram size - 2][head]`: within one (layer, n-gram) run each head takes the
    next prime above the previous one, the run starting from `vocab_size - 1`; a prime used by an
    earlier (layer, n-gram, head) anywhere is skipped."""
    used: set[int] = set()
    out = []
    for _ in layer_ids:
        per_ngram = []
        for _ in range(max_ngram_size - 1):
            p = vocab_size - 1
            heads = []
            for _ in range(n_heads):
                p += 1
                while not is_prime(p) or p in used:
                    p += 1
                used.add(p)
                heads.append(p)
            per_ngram.append(tuple(heads))
        out.append(tuple(per_ngram))
    return tuple(out)


def engram_offsets(primes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Row offset of each (n-gram, head) slice of one layer's table (n-gram major): exclusive
    prefix sums of the layer's primes."""
    flat = [p for heads in primes for p in heads]
    return tuple(int(x) for x in np.cumsum([0, *flat[:-1]]))


def engram_multipliers(
    layer_id: int, max_ngram_size: int, compressed_vocab: int
) -> tuple[int, ...]:
    """Odd int64 multipliers of one engram layer (seeded by its layer index), small enough that
    `compressed id * multiplier` never overflows int64."""
    bound = max(1, (_INT64_MAX // compressed_vocab) // 2)
    rng = np.random.default_rng(_MULTIPLIER_SEED * layer_id)
    draws = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in draws)


__all__ = ["engram_multipliers", "engram_offsets", "engram_primes", "is_prime"]
