"""Vocabulary-parallel embedding and LM head: each tensor-parallel rank holds `V / tp`
consecutive rows of the table.

The embedding looks up the rows it holds (zeros for the others) and the ranks' results are
summed: each row has exactly one non-zero term, so the sum is exact. The head's logits are
computed per shard; `gather_logits` assembles full rows (every rank then samples the same token
from the same values) and `shard_argmax` picks greedy tokens from `(max, index)` pairs instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgl_dspark.srt.distributed import Communicator
from sgl_dspark.srt.distributed.sharding import mark_shard, split_evenly


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


def shard_argmax(
    local: torch.Tensor, vocab_start: int, tp: Communicator, triton: bool = False
) -> torch.Tensor:
    """Greedy ids `[M]` (int64) of logits `[M, V / tp]` sharded over the vocabulary, equal to
    `torch.argmax` of the gathered rows (NaN above every number, the smallest index among
    ties) while only `(max, index)` pairs cross ranks (8 bytes per rank and row). `triton`:
    the `kernels/sampling` kernels, else the same rule in torch."""
    if triton:
        from sgl_dspark.kernels.sampling.vocab_argmax import (
            combine_shard_argmax,
            shard_argmax_pairs,
        )

        pairs = shard_argmax_pairs(local, vocab_start)
        return combine_shard_argmax(tp.all_gather(pairs.unsqueeze(0), dim=0))
    values = local.float()
    best = torch.argmax(values, dim=-1)  # NaN first, then the first maximum
    pairs = torch.stack(
        (values.gather(-1, best[:, None]).squeeze(-1), (best + vocab_start).float()), -1
    )
    return combine_pairs(tp.all_gather(pairs.unsqueeze(0), dim=0))


def combine_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """Winner of `[ranks, M, (value, global index)]`: a NaN first, then the largest value; the
    smallest index among equals (`combine_shard_argmax`'s rule, in torch)."""
    values, index = pairs[..., 0], pairs[..., 1]
    nan = torch.isnan(values)
    key_nan = torch.where(nan, index, torch.inf).min(0).values
    top = torch.where(nan, -torch.inf, values).max(0, keepdim=True).values
    key_top = torch.where((~nan) & (values == top), index, torch.inf).min(0).values
    return torch.where(torch.isfinite(key_nan), key_nan, key_top).long()
