"""Token selection in torch: greedy argmax over vocab shards (the reference of `vocab_argmax.py`)
and the fixed-point inverse CDF that draws a token from a distribution (the sampling rule of
plain and speculative decoding, and of `spec/accept.py`).

Drawing a token (`sample_inverse_cdf_ref`) is bit-exact on every backend because no float is
ever summed:
  1. Fixed point (`to_fixed_point`): ``w[k] = int64(trunc(x[k] * 2**40))`` with x >= 0 (one exact
     power-of-two scale, then truncation: elementwise, no contraction).
  2. ``S = sum(w)`` and the running CDF ``C[k] = w[0] + ... + w[k]`` in int64: integer addition
     is associative, so any reduction/scan tree (torch.cumsum, tl.cumsum, block carries) gives
     the same integers. Overflow-free while sum(x) < 2**23.
  3. ``u24 = min(trunc(u * 2**24), 2**24 - 1)`` (exact: a float32 uniform has 24 bits) and the
     threshold ``t = floor(S * u24 / 2**24)``, computed as
     ``(S >> 24) * u24 + (((S & (2**24 - 1)) * u24) >> 24)`` (exact, no overflow); t < S.
  4. token = smallest k with ``C[k] > t`` = number of k with ``C[k] <= t``; intervals are
     half-open, so a uniform exactly on a boundary picks the upper token. ``S == 0`` -> token 0
     (invalid input).
Quantisation drops token mass below 2**-40 (at most V * 2**-40 ~ 1.2e-7 in total variation at
V = 129280). Why fixed point: a float CDF (torch.cumsum vs a blocked tl.cumsum) can differ in the
last ulp and move a boundary past a uniform within ~1e-7 of it; integers cannot, so a kernel and
this reference draw the same token from the same uniform.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FIXED_POINT_BITS = 40
UNIFORM_BITS = 24


def vocab_argmax_ref(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.argmax`` over the shards concatenated in column order -> int64 [M] (NaN is larger
    than every number; ties and NaNs go to the smallest global index)."""
    return torch.argmax(torch.cat([s.float() for s in shards], dim=-1), dim=-1)


def greedy_logprobs_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ids int64 [M] of logits [M, V] and `log_softmax` (fp32) of each row at its id."""
    rows = logits.float()
    ids = torch.argmax(rows, dim=-1)
    return ids, torch.log_softmax(rows, dim=-1).gather(1, ids[:, None]).squeeze(1)


def to_fixed_point(x: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 masses -> int64 fixed-point weights ``trunc(x * 2**40)`` (step 1)."""
    return (x.float() * float(1 << FIXED_POINT_BITS)).to(torch.int64)


def sample_inverse_cdf_ref(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from int64 fixed-point weights [N, V] (`to_fixed_point`) and fp32
    uniforms [N] in [0, 1), by the module doc's rule -> int64 [N]."""
    total = weights.sum(-1)
    u24 = (uniforms.float() * float(1 << UNIFORM_BITS)).to(torch.int64)
    u24 = u24.clamp(0, (1 << UNIFORM_BITS) - 1)
    low_mask = (1 << UNIFORM_BITS) - 1
    threshold = (total >> UNIFORM_BITS) * u24 + (((total & low_mask) * u24) >> UNIFORM_BITS)
    # The integer CDF is exact and non-decreasing: the count of entries <= t by binary search.
    cdf = weights.cumsum(-1)
    token = torch.searchsorted(cdf, threshold[:, None], right=True)[:, 0]
    return torch.where(total > 0, token, torch.zeros_like(token))
