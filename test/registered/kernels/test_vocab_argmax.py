"""K14: vocab-parallel greedy argmax vs torch.argmax on the concatenated logits (exact, X0)."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.vocab_argmax import (
    combine_shard_argmax,
    shard_argmax_pairs,
    vocab_argmax,
    vocab_argmax_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_logits(
    rows: int, width: int, dtype: torch.dtype, gen: torch.Generator, mode: str
) -> torch.Tensor:
    if mode == "ties":
        # Few distinct values: many equal maxima, across blocks and shard boundaries.
        x = torch.randint(-2, 3, (rows, width), generator=gen).float()
    else:
        x = torch.randn(rows, width, generator=gen) * 4
    if mode == "nan":
        x[torch.rand(rows, width, generator=gen) < 3.0 / max(width, 1)] = float("nan")
    if mode == "inf":
        x[torch.rand(rows, width, generator=gen) < 0.01] = float("inf")
        x[torch.rand(rows, width, generator=gen) < 0.3] = float("-inf")
    return x.to(dtype).to(DEVICE)


def _split(width: int, parts: int, gen: torch.Generator) -> list[int]:
    cuts = sorted(torch.randperm(width - 1, generator=gen)[: parts - 1].add(1).tolist())
    bounds = [0, *cuts, width]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["randn", "ties", "nan", "inf"])
@pytest.mark.parametrize("rows,width", [(0, 64), (1, 1), (1, 5000), (4, 7), (37, 300), (8, 9001)])
def test_single_tensor_matches_torch_argmax(rows, width, mode, dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 7919 + width)
    logits = _random_logits(rows, width, dtype, gen, mode)
    out = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    got = vocab_argmax(logits, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, vocab_argmax_ref([logits]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["randn", "ties", "nan", "inf"])
@pytest.mark.parametrize("rows,width,parts", [(1, 20, 4), (5, 1000, 3), (37, 10000, 4), (3, 9, 9)])
def test_unequal_shards_match_concatenated_argmax(rows, width, parts, mode, dtype) -> None:
    gen = torch.Generator().manual_seed(1000 + rows * 31 + width + parts)
    full = _random_logits(rows, width, dtype, gen, mode)
    widths = _split(width, parts, gen)
    shards = list(torch.split(full, widths, dim=1))
    shards = [s.contiguous() for s in shards]
    expected = vocab_argmax_ref(shards)
    assert torch.equal(expected, torch.argmax(full.float(), -1))
    assert torch.equal(vocab_argmax(shards), expected)

    # Stage 1 per shard, then stage 2 on the pairs stacked in a shuffled rank order.
    offsets = [sum(widths[:i]) for i in range(parts)]
    pairs = [shard_argmax_pairs(s, o) for s, o in zip(shards, offsets)]
    for shard, offset, pair in zip(shards, offsets, pairs):
        local = vocab_argmax_ref([shard])
        assert torch.equal(pair[:, 1].long(), local + offset)
        picked = shard.float().gather(1, local[:, None])[:, 0]
        assert torch.equal(pair[:, 0].isnan(), picked.isnan())
        assert torch.equal(pair[:, 0].nan_to_num(), picked.nan_to_num())
    order = torch.randperm(parts, generator=gen).tolist()
    stacked = torch.stack([pairs[i] for i in order]).contiguous()
    assert torch.equal(combine_shard_argmax(stacked), expected)
    # Explicit offsets with the shard list itself permuted.
    got = vocab_argmax([shards[i] for i in order], vocab_offsets=[offsets[i] for i in order])
    assert torch.equal(got, expected)


def test_hand_built_edge_rows() -> None:
    nan, inf = float("nan"), float("inf")
    rows = [
        [1.0, 3.0, 3.0, 2.0, 3.0, 0.0],  # tie inside one shard and across shards -> 1
        [0.0, 1.0, 2.0, nan, 5.0, nan],  # NaN beats 5.0; first NaN -> 3
        [-inf] * 6,  # all -inf -> 0
        [-0.0, 0.0, 0.0, -1.0, 0.0, -0.0],  # -0.0 == +0.0 -> 0
        [1.0, 2.0, inf, 4.0, inf, nan],  # NaN beats +inf -> 5
        [nan, nan, 0.0, 0.0, nan, 1.0],  # first NaN overall -> 0
        [0.0, 0.0, 0.0, 7.0, 0.0, 7.0],  # max only in later shards, tie -> 3
    ]
    full = torch.tensor(rows, device=DEVICE)
    shards = [full[:, :2].contiguous(), full[:, 2:3].contiguous(), full[:, 3:].contiguous()]
    expected = torch.tensor([1, 3, 0, 0, 5, 0, 3], device=DEVICE)
    assert torch.equal(vocab_argmax_ref(shards), expected)
    assert torch.equal(vocab_argmax(shards), expected)
    assert torch.equal(vocab_argmax(full), expected)


def test_strided_padded_last_shard() -> None:
    # The last TP shard carries padded columns: pass a [:, :valid] slice (row stride > width).
    gen = torch.Generator().manual_seed(5)
    padded = torch.randn(9, 5000, generator=gen).to(DEVICE)
    padded[:, 4321:] = 1e9  # must never be scanned
    first = torch.randn(9, 4100, generator=gen).to(DEVICE)
    last = padded[:, :4321]
    assert last.stride(0) == 5000
    expected = torch.argmax(torch.cat([first, last], -1), -1)
    assert torch.equal(vocab_argmax([first, last]), expected)


def test_bad_arguments_raise() -> None:
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="logits"):
        shard_argmax_pairs(x.t(), 0)
    with pytest.raises(ValueError, match="vocab_offset"):
        shard_argmax_pairs(x, 1 << 24)
    with pytest.raises(ValueError, match="rows"):
        vocab_argmax([x, torch.randn(4, 8, device=DEVICE)])
    with pytest.raises(ValueError, match="pairs"):
        combine_shard_argmax(torch.zeros(2, 3, 3, device=DEVICE))
