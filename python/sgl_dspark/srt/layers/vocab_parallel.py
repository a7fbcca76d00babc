"""Vocabulary-parallel embedding and LM head: each tensor-parallel rank holds `V / tp`
consecutive rows of the table.

The embedding looks up the rows it holds (zeros for the others) and the ranks' results are
summed: each row has exactly one non-zero term, so the sum is exact.

The head's logits are computed per shard, and a step reads them through `LogitsReader` in one
of two ways, chosen per request by what it needs (`needs_whole_rows`):

* whole rows (`LogitsReader.full`): the shards all-gathered, `4 * V` bytes per row. Sampling
  (top-k / top-p over the whole distribution), logits adjustments (penalties, biases, grammar
  masks), top-N / token-id logprobs and prompt logprobs read them; every rank then holds the
  same rows as one GPU would have computed from the same shards, so those results are exact.
* greedy picks (`LogitsReader.greedy`): each rank reduces its shard to one small record per row
  and only the records cross ranks (`shard_greedy`: 12 bytes per rank and row): the argmax by
  the shard-pair rule (bit-identical to `torch.argmax` of whole rows) and the chosen token's
  log-softmax (within fp32 rounding of `log_softmax` of whole rows).
* greedy ids alone (`LogitsReader.argmax`): the same pairs without the sums (`shard_argmax`:
  8 bytes per rank and row), for a reader that needs no logprob: the DSpark draft's greedy
  Markov steps (`speculative/dspark/sampling.py::markov_greedy_shard`).

A step whose requests are of both kinds reads each request's rows its own way under tensor
parallelism (`split_rows`): the greedy requests' rows through the picks, only the other
requests' rows gathered whole. One rank reads every step one way, as its rows are whole anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sgl_dspark.srt.core.host_copy import to_device_packed
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.distributed import Communicator
from sgl_dspark.srt.distributed.sharding import mark_shard, split_evenly
from sgl_dspark.srt.layers.sampler import greedy_argmax_impl, greedy_pick_impl

if TYPE_CHECKING:
    from sgl_dspark.srt.core.req import Req


class VocabParallelEmbedding(nn.Embedding):
    """`nn.Embedding(vocab, dim)` whose weight holds this rank's `vocab / tp` rows; the forward
    returns full embeddings on every rank."""

    def __init__(self, vocab: int, dim: int, tp: Communicator) -> None:
        local = split_evenly(vocab, tp.size, "vocab_size", "--tp-size")
        super().__init__(local, dim)
        self.tp = tp
        self.vocab_start = tp.rank * local
        self.full_vocab = vocab
        mark_shard(self.weight, 0, tp.rank, tp.size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(held, local, 0), self.weight)
        rows = torch.where(held.unsqueeze(-1), rows, 0)
        return self.tp.all_reduce(rows)


def vocab_parallel_head(vocab: int, dim: int, tp: Communicator) -> nn.Linear:
    """The LM head `nn.Linear(dim, vocab)` holding this rank's `vocab / tp` output rows."""
    head = nn.Linear(dim, split_evenly(vocab, tp.size, "vocab_size", "--tp-size"), bias=False)
    mark_shard(head.weight, 0, tp.rank, tp.size)
    return head


def gather_logits(local: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """Full logits rows `[..., V]` from every rank's shard `[..., V / tp]` (rank order)."""
    return tp.all_gather(local.contiguous(), dim=-1)


def needs_whole_rows(req: Req) -> bool:
    """Whether a request's logits rows must be read whole (`LogitsReader.full`) rather than
    as greedy picks: it samples, adjusts its logits (penalties, biases, min_new_tokens, a
    grammar) or asks for top-N / token-id logprobs. A greedy request's own token and its
    logprob come from the picks; prompt logprobs are the caller's to add (only a prefill step
    knows whether it scores prompt positions). Host flags only: every rank decides the same."""
    return not req.params.is_greedy or req.params.adjusts_logits or req.logprob_extras


def needs_full_logits(reqs: Sequence[Req]) -> bool:
    """Whether any request of `reqs` reads whole rows (`needs_whole_rows`)."""
    return any(needs_whole_rows(r) for r in reqs)


class RowSplit:
    """A step's positions (requests, or logits rows) in two groups read two ways under tensor
    parallelism: `greedy` through the greedy picks, `whole` gathered whole (`split_rows`).
    Together they are the positions 0..n-1, each list in step order: host values, with their
    device copies (one transfer) and the order that puts the two groups' results back in step
    order (`merge`)."""

    def __init__(self, greedy: Sequence[int], whole: Sequence[int], device: torch.device) -> None:
        self.greedy = tuple(greedy)
        self.whole = tuple(whole)
        # Position p's place in cat(greedy results, whole results).
        place = {p: i for i, p in enumerate(self.greedy + self.whole)}
        order = [place[p] for p in sorted(place)]
        self.greedy_t, self.whole_t, self._order = to_device_packed(
            [self.greedy, self.whole, order], torch.int64, device
        )

    def merge(self, greedy: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """The groups' results (leading dimension: their positions, in group order) back in
        step order."""
        return torch.cat((greedy, whole))[self._order]


def split_rows(
    reader: LogitsReader, whole: Sequence[bool], device: torch.device
) -> RowSplit | None:
    """The split of a step whose positions need whole rows where `whole` is set (host flags,
    so every rank splits the same way), or None when the step reads every position one way:
    on one rank (its rows are whole: `full` is the identity, and the picks are the sampler's
    own ops), or when the positions are all of one kind."""
    if not reader.sharded or all(whole) or not any(whole):
        return None
    return RowSplit(
        [i for i, w in enumerate(whole) if not w], [i for i, w in enumerate(whole) if w], device
    )


class GreedyPick(NamedTuple):
    """Per logits row: the greedy token and log-softmax values of the row."""

    ids: torch.Tensor  # [M] int64, torch.argmax of the whole row
    logprobs: torch.Tensor  # [M] fp32, log_softmax of the row at `ids`
    probe_logprobs: torch.Tensor | None  # [M] fp32 at the caller's probe ids (None: none asked)


class LogitsReader:
    """How a forward's logits rows are read on this rank (see the module doc): the model's
    head builds one, and every consumer of a forward's logits goes through it.

    Without tensor parallelism the rows are whole: `full` is the identity and `greedy` runs the
    sampler's own greedy pick (`greedy_pick_impl`: the "sampling" family's argmax and the
    logprob at it), so one GPU pays nothing for the reader and its picks equal the sampler's
    bit for bit."""

    def __init__(self, vocab: int, tp: Communicator, kernels: KernelChoice) -> None:
        self.tp = tp
        self.vocab = vocab
        self.shard_width = split_evenly(vocab, tp.size, "vocab_size", "--tp-size")
        self.vocab_start = tp.rank * self.shard_width
        self.sharded = tp.size > 1
        self.triton = kernels.of("sampling") == "triton"
        self._argmax = greedy_argmax_impl(kernels)
        self._greedy_pick = greedy_pick_impl(kernels)

    def full(self, rows: torch.Tensor) -> torch.Tensor:
        """Whole rows `[..., V]` of this rank's rows `[..., V / tp]` (a collective under TP)."""
        return gather_logits(rows, self.tp) if self.sharded else rows

    def greedy(self, rows: torch.Tensor, probe_ids: torch.Tensor | None = None) -> GreedyPick:
        """Greedy ids and their logprobs of rows `[M, V / tp]`, and with `probe_ids` [M] the
        logprob of each row at its probe id; no logits row crosses ranks."""
        if self.sharded:
            return shard_greedy(rows, self.vocab_start, self.tp, self.triton, probe_ids)
        ids, picked = self._greedy_pick(rows)
        probed = None
        if probe_ids is not None:
            rows = rows.float()
            row_max = rows.gather(1, ids[:, None]).squeeze(1)
            at = rows.gather(1, probe_ids.clamp(0, rows.shape[1] - 1)[:, None]).squeeze(1)
            probed = logprob_at(at, row_max, picked)
        return GreedyPick(ids, picked, probed)

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        """Greedy ids `[M]` of rows `[M, V / tp]`, `torch.argmax` of the whole rows (ties to
        the first index, NaN above every number); under TP only the (max, index) pairs cross
        ranks (`shard_argmax`), on one rank the sampler's own argmax."""
        if self.sharded:
            return shard_argmax(rows, self.vocab_start, self.tp, self.triton)
        return self._argmax(rows)


# Columns of the per-rank record `shard_greedy` gathers.
_MAX, _INDEX, _SUMEXP, _PROBE = range(4)


def shard_greedy(
    rows: torch.Tensor,
    vocab_start: int,
    tp: Communicator,
    triton: bool = False,
    probe_ids: torch.Tensor | None = None,
) -> GreedyPick:
    """`GreedyPick` of logits `[M, V_s]` sharded over the vocabulary (this rank's columns
    start at `vocab_start`; shard widths may differ between ranks), through one all-gather of
    an fp32 record per rank and row: (shard max, its global index, the shard's sum of
    `exp(x - shard max)`[, the logit at the probe id when this rank holds it]).

    Why each value is exact:
    * ids: `torch.argmax` of the whole row is the first index of the row's largest value, NaN
      above every number. A shard's (max, first index of it) pair keeps all that rule needs,
      and the combine (`combine_pairs`, or the `kernels/sampling` kernels with `triton`)
      applies the same order to the pairs: the first NaN, else the largest value with the
      smallest index among equals (-0.0 == +0.0; an all -inf row gives column 0). Only
      comparisons are involved, so the ids equal `torch.argmax` of the gathered rows bit for
      bit, ties and NaN included.
    * logprobs: `log_softmax(x)[i] = (x_i - m) - log(sum_j exp(x_j - m))` with m the row max.
      The sum splits over shards as `sum_r s_r * exp(m_r - m)` (`s_r` shifted by the shard's
      own max `m_r`; the factor is exactly 1 on the shard that holds m), and every other term
      is the one `log_softmax` computes, so the values differ from `log_softmax` of the
      gathered rows only by the fp32 rounding of the split sum. A row with a NaN, a +inf or
      only -inf is NaN throughout, as in `log_softmax`.
    """
    rows = rows.float()
    if rows.shape[0] == 0:  # every rank has the same rows: none of them gathers
        empty = rows.new_zeros((0,))
        return GreedyPick(empty.long(), empty, None if probe_ids is None else empty)
    pairs = _shard_pairs(rows, vocab_start, triton)
    shift = _finite_or_zero(pairs[:, _MAX])
    sumexp = torch.exp(rows - shift[:, None]).sum(dim=-1)
    columns = [pairs, sumexp[:, None]]
    if probe_ids is not None:
        local_probe = probe_ids - vocab_start
        held = (local_probe >= 0) & (local_probe < rows.shape[1])
        at = rows.gather(1, local_probe.clamp(0, max(rows.shape[1] - 1, 0))[:, None]).squeeze(1)
        # Exactly one rank holds a probe id; the others send -inf, which the max over ranks
        # ignores (a held -inf or NaN survives it).
        columns.append(torch.where(held, at, float("-inf"))[:, None])
    record = torch.cat(columns, dim=1).unsqueeze(0)
    gathered = tp.all_gather(record, dim=0)  # [ranks, M, columns]
    ids = _combine(gathered[..., :2], triton)
    maxima, index = gathered[..., _MAX], gathered[..., _INDEX]
    # The row max is the winning rank's max (global indices are unique across ranks).
    row_max = torch.where(index == ids.float(), maxima, float("-inf")).amax(0)
    # A row whose max is not finite (a NaN, +inf, only -inf) is NaN throughout in
    # `log_softmax`; the shifts below only serve finite rows.
    finite = torch.isfinite(row_max)
    row_shift = _finite_or_zero(row_max)
    scale = torch.exp(_finite_or_zero(maxima) - row_shift)
    # A rank without mass (its shard all -inf: shift 0) adds exactly 0, also where its factor
    # exp(0 - row_shift) overflows (a row max below about -88), which 0 * inf would make NaN.
    sums = gathered[..., _SUMEXP]
    log_total = torch.log(torch.where(sums == 0, 0.0, sums * scale).sum(0))
    nan = torch.full_like(row_max, float("nan"))
    logprobs = torch.where(finite, -log_total, nan)  # (max - max) - log(sum)
    probed = None
    if probe_ids is not None:
        probed = logprob_at(gathered[..., _PROBE].amax(0), row_max, logprobs)
    return GreedyPick(ids, logprobs, probed)


def logprob_at(at: torch.Tensor, row_max: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """`log_softmax` at a column of each row from its logit `at`, the row's max and `picked`,
    the logprob at the max (-log(sum_j exp(x_j - max))): (at - max) - log(sum), the order of
    `log_softmax`'s own arithmetic; NaN for a row whose max is not finite, as there."""
    finite = torch.isfinite(row_max)
    shifted = at - torch.where(finite, row_max, torch.zeros_like(row_max))
    return torch.where(finite, shifted + picked, torch.full_like(picked, float("nan")))


def shard_argmax(
    rows: torch.Tensor, vocab_start: int, tp: Communicator, triton: bool = False
) -> torch.Tensor:
    """`torch.argmax` ids `[M]` of the whole rows of logits `[M, V_s]` sharded over the
    vocabulary (this rank's columns start at `vocab_start`; widths may differ between ranks):
    `shard_greedy`'s ids, by the same pairs and the same combine, through one all-gather of
    only the (shard max, its global index) pair per rank and row, without the sums a logprob
    needs. Exact for the reasons `shard_greedy` gives (comparisons only: ties to the smallest
    global index, the first NaN above every number, an all -inf row gives column 0)."""
    if rows.shape[0] == 0:  # every rank has the same rows: none of them gathers
        return torch.zeros((0,), dtype=torch.int64, device=rows.device)
    pairs = _shard_pairs(rows.float(), vocab_start, triton)
    return _combine(tp.all_gather(pairs.unsqueeze(0), dim=0), triton)  # [ranks, M, 2]


def _shard_pairs(rows: torch.Tensor, vocab_start: int, triton: bool) -> torch.Tensor:
    """fp32 `[M, 2]`: per row of this rank's columns `[M, V_s]` (fp32) its maximum (NaN when it
    holds one) and the global index of the first occurrence."""
    if triton:
        from sgl_dspark.kernels.sampling.vocab_argmax import shard_argmax_pairs

        return shard_argmax_pairs(rows, vocab_start)
    local = torch.argmax(rows, dim=-1)  # NaN first, then the first maximum
    top = rows.gather(1, local[:, None]).squeeze(1)
    # Global indices below 2**24 (any real vocabulary) are exact in fp32.
    return torch.stack((top, (local + vocab_start).float()), dim=-1)


def _combine(pairs: torch.Tensor, triton: bool) -> torch.Tensor:
    """Global ids `[M]` of the gathered pairs `[ranks, M, 2]`."""
    if triton:
        from sgl_dspark.kernels.sampling.vocab_argmax import combine_shard_argmax

        return combine_shard_argmax(pairs.contiguous())
    return combine_pairs(pairs)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """The shift `torch.logsumexp` uses: the max itself, or 0 where it is +-inf or NaN."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def combine_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """Winner of `[ranks, M, (value, global index)]`: a NaN first, then the largest value; the
    smallest index among equals (`combine_shard_argmax`'s rule, in torch)."""
    values, index = pairs[..., 0], pairs[..., 1]
    nan = torch.isnan(values)
    key_nan = torch.where(nan, index, torch.inf).min(0).values
    top = torch.where(nan, -torch.inf, values).max(0, keepdim=True).values
    key_top = torch.where((~nan) & (values == top), index, torch.inf).min(0).values
    return torch.where(torch.isfinite(key_nan), key_nan, key_top).long()
