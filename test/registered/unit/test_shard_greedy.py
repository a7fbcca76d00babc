"""`shard_greedy` (the greedy pick over vocabulary shards, one record per rank and row) in one
process: each rank's record is built by its own call, and a stand-in communicator gathers the
records the other ranks built, so the split-sum arithmetic runs without a process group. The
multi-process runs are test_vocab_parallel_head.py."""

from __future__ import annotations

import torch
from sgl_dspark.srt.layers.vocab_parallel import shard_greedy


class _Gathered:
    """A rank of `size` whose all-gather returns the records of every rank in rank order: its
    own, and the others' as recorded by earlier calls."""

    def __init__(self, rank: int, size: int, others: dict[int, torch.Tensor]) -> None:
        self.rank, self.size, self.others = rank, size, others

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self.others[self.rank] = x
        parts = [self.others.get(r, x) for r in range(self.size)]
        return torch.cat(parts, dim=dim)


def _pick(rows: torch.Tensor, widths: list[int], probes: torch.Tensor):
    """Every rank's pick of `rows` split into shards of `widths`; the last rank's call sees
    every record (the earlier calls only record theirs)."""
    records: dict[int, torch.Tensor] = {}
    starts = [sum(widths[:r]) for r in range(len(widths))]
    for rank in reversed(range(len(widths))):  # rank 0 last: it gathers every real record
        shard = rows[:, starts[rank] : starts[rank] + widths[rank]]
        tp = _Gathered(rank, len(widths), records)
        pick = shard_greedy(shard.contiguous(), starts[rank], tp, probe_ids=probes)  # type: ignore[arg-type]
    return pick


def test_a_massless_shard_adds_nothing_below_the_exp_range() -> None:
    """Rows whose max is far below zero (-100, -1000) beside a shard of only -inf: the logprob
    is log_softmax's, not the NaN of 0 * exp(0 - max) = 0 * inf; a row of only -inf and a row
    with a NaN stay NaN, as in log_softmax."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(5, 24, generator=gen)
    rows[0] -= 100.0
    rows[1] = rows[1] * 3 - 1000.0
    rows[:2, 16:] = float("-inf")  # the last rank's shard: no mass
    rows[2] += 5.0
    rows[3] = float("-inf")
    rows[4, 3] = float("nan")
    probes = torch.tensor([2, 5, 17, 0, 9])
    pick = _pick(rows, [8, 8, 8], probes)
    want = torch.log_softmax(rows, dim=-1)
    assert torch.equal(pick.ids, torch.argmax(rows, dim=-1))
    got = pick.logprobs
    torch.testing.assert_close(got[:3], want[torch.arange(3), pick.ids[:3]], rtol=1e-5, atol=1e-5)
    assert torch.isnan(got[3:]).all()
    assert pick.probe_logprobs is not None
    torch.testing.assert_close(
        pick.probe_logprobs[:3], want[torch.arange(3), probes[:3]], rtol=1e-5, atol=1e-5
    )
