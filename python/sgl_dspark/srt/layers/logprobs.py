"""The logprobs a request gets back, as SGLang 0.5.23 reports them (its default, without
`SGLANG_RETURN_ORIGINAL_LOGPROB`):

* output tokens: `log_softmax(adjusted_logits / temperature)` of the row the token was sampled
  from: after penalties, logit biases, `min_new_tokens` and the grammar mask
  (`logits_adjust.py`), scaled by the request's temperature (1 for greedy requests), before
  top-k / top-p / min-p. The chosen token's value, its top-N alternatives
  (`top_logprobs_num`) and the values at given ids (`token_ids_logprob`) all come from this
  one distribution. With DSpark every committed token's values come from its verify row of
  the target's logits (adjusted for that position), so they equal plain decoding's.
* prompt tokens: `log_softmax(logits)` of the raw logits at the position before the token (no
  temperature, no adjustments: the prompt was not sampled).

Values are clamped below at fp32's most negative finite number, so a token the grammar or
`min_new_tokens` forbids reports -3.4e38 rather than -inf (JSON has no infinities).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

_MIN_LOGPROB = torch.finfo(torch.float32).min


def row_logprobs(logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] fp32 log-probabilities of logits [N, V], each row divided by its temperature
    ([N], None = 1) first; clamped as the module doc says."""
    scaled = logits.float() if temperatures is None else logits.float() / temperatures[:, None]
    return torch.log_softmax(scaled, dim=-1).clamp(min=_MIN_LOGPROB)


class LogprobExtras(NamedTuple):
    top_ids: torch.Tensor  # [N, K] int64, most probable first (K = widest request)
    top_values: torch.Tensor  # [N, K] fp32
    id_values: torch.Tensor  # [N, M] fp32 at each row's requested ids (padded with id 0)


def logprob_extras(
    logprobs: torch.Tensor, top_k: int, token_ids: Sequence[Sequence[int]] | None
) -> LogprobExtras:
    """Top-`top_k` tokens (ties: lower id first) and the values at `token_ids[row]` of
    logprobs [N, V]; the host keeps each row's own prefix (`split_extras`)."""
    rows, vocab = logprobs.shape
    k = min(max(top_k, 0), vocab)
    if k > 0:
        # A stable descending sort keeps equal values in id order (torch.topk does not promise).
        values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
        values, ids = values[:, :k], ids[:, :k]
    else:
        values = logprobs.new_zeros((rows, 0))
        ids = torch.zeros((rows, 0), dtype=torch.int64, device=logprobs.device)
    width = max((len(t) for t in token_ids or ()), default=0)
    if width:
        assert token_ids is not None
        padded = [list(t) + [0] * (width - len(t)) for t in token_ids]
        index = torch.tensor(padded, dtype=torch.int64).clamp(0, vocab - 1).to(logprobs.device)
        id_values = logprobs.gather(1, index)
    else:
        id_values = logprobs.new_zeros((rows, 0))
    return LogprobExtras(ids, values, id_values)


def split_extras(
    top_ids: list[list[int]],
    top_values: list[list[float]],
    id_values: list[list[float]],
    top_nums: Sequence[int],
    num_ids: Sequence[int],
) -> tuple[list[tuple[tuple[int, float], ...]], list[tuple[float, ...]]]:
    """Host lists of `LogprobExtras` rows -> per row ((id, logprob), ...) of its own top-N and
    the values at its own ids."""
    tops = [tuple(zip(ids[:n], vals[:n])) for ids, vals, n in zip(top_ids, top_values, top_nums)]
    ids_out = [tuple(vals[:m]) for vals, m in zip(id_values, num_ids)]
    return tops, ids_out
