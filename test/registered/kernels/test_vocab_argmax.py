"""Vocab-parallel greedy argmax (`vocab_argmax`) vs torch.argmax on the concatenated logits (exact).

The launchers split each row into column chunks (one program each) and combine the chunk pairs in
a second pass; tests force chunk counts (one, several, more chunks than columns) and place ties
and NaNs exactly on chunk and shard boundaries."""

from __future__ import annotations

import importlib

import pytest
import torch
from sgl_dspark.kernels.sampling.reference import vocab_argmax_ref
from sgl_dspark.kernels.sampling.vocab_argmax import (
    _plan_chunks,
    combine_shard_argmax,
    shard_argmax_pairs,
    vocab_argmax,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The module (the package re-exports a function of the same name).
vocab_argmax_module = importlib.import_module("sgl_dspark.kernels.sampling.vocab_argmax")


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
@pytest.mark.parametrize("rows,width,parts", [(1, 20, 4), (5, 1000, 3), (13, 3000, 4), (3, 9, 9)])
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
    with pytest.raises(ValueError, match="num_chunks"):
        vocab_argmax(x, num_chunks=0)


def _boundary_rows(width: int, boundaries: list[int], gen: torch.Generator) -> torch.Tensor:
    """Rows whose deciding entries sit on the given column boundaries b (b-1 | b)."""
    rows = []
    for b in boundaries:
        base = torch.randn(width, generator=gen)
        tie = base.clone()
        tie[b - 1] = tie[b] = 50.0  # tie across the boundary -> b - 1
        after = base.clone()
        after[b] = after[width - 1] = 50.0  # first max right at the boundary -> b (or earlier)
        nan = base.clone()
        nan[b] = nan[b - 1] = float("nan")  # NaN pair across the boundary -> b - 1
        late_nan = base.clone()
        late_nan[b] = float("nan")  # the only NaN opens the later chunk -> b
        ninf = torch.full((width,), float("-inf"))  # all -inf: column 0
        rows += [tie, after, nan, late_nan, ninf]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "width,num_chunks", [(1000, 1), (1000, 3), (1000, 7), (4097, 2), (37, 40), (5, 8)]
)
def test_forced_chunks_with_ties_on_chunk_boundaries(width, num_chunks, dtype) -> None:
    gen = torch.Generator().manual_seed(width * 17 + num_chunks)
    chunk = -(-width // num_chunks)
    boundaries = [b for b in range(chunk, width, chunk)] or [width - 1]
    boundaries = sorted({boundaries[0], boundaries[len(boundaries) // 2], boundaries[-1]})
    x = torch.cat([_boundary_rows(width, boundaries, gen), torch.randn(3, width, generator=gen)])
    x = x.to(dtype).to(DEVICE)
    expected = vocab_argmax_ref([x])
    out = torch.full((x.shape[0],), -7, dtype=torch.int64, device=DEVICE)
    assert torch.equal(vocab_argmax(x, out=out, num_chunks=num_chunks), expected)
    pairs_out = torch.full((x.shape[0], 2), float("nan"), device=DEVICE)
    pairs = shard_argmax_pairs(x, 1000, out=pairs_out, num_chunks=num_chunks)
    assert pairs.data_ptr() == pairs_out.data_ptr()
    assert torch.equal(pairs[:, 1].long(), expected + 1000)
    picked = x.float().gather(1, expected[:, None])[:, 0]
    assert torch.equal(pairs[:, 0].isnan(), picked.isnan())
    assert torch.equal(pairs[:, 0].nan_to_num(), picked.nan_to_num())


@pytest.mark.parametrize("num_chunks", [None, 1, 2, 5])
def test_ties_on_shard_boundaries(num_chunks) -> None:
    gen = torch.Generator().manual_seed(77 + (num_chunks or 0))
    widths = [700, 1, 513, 1200]
    starts = [sum(widths[:i]) for i in range(1, len(widths))]
    x = _boundary_rows(sum(widths), starts, gen).to(DEVICE)
    shards = [s.contiguous() for s in torch.split(x, widths, dim=1)]
    expected = torch.argmax(x, -1)
    assert torch.equal(vocab_argmax(shards, num_chunks=num_chunks), expected)
    order = [2, 0, 3, 1]
    got = vocab_argmax(
        [shards[i] for i in order], [([0] + starts)[i] for i in order], num_chunks=num_chunks
    )
    assert torch.equal(got, expected)


def test_many_shards_mixed_dtypes_span_launches() -> None:
    # Six shards -> stage-1 launches of up to four same-dtype shards each.
    gen = torch.Generator().manual_seed(9)
    dtypes = [
        torch.float32,
        torch.float32,
        torch.bfloat16,
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    ]
    widths = [300, 517, 64, 1000, 2, 900]
    shards = [
        (torch.randint(-3, 4, (11, w), generator=gen).float()).to(d).to(DEVICE)
        for w, d in zip(widths, dtypes)
    ]
    expected = vocab_argmax_ref(shards)
    for num_chunks in (None, 3):
        assert torch.equal(vocab_argmax(shards, num_chunks=num_chunks), expected)


@pytest.mark.parametrize("parts,rows", [(300, 3), (5, 70), (1, 2)])
def test_combine_many_parts(parts: int, rows: int) -> None:
    # Per-part pairs from torch (independent of stage 1); the combine must loop over part
    # blocks (300 > 256 parts) and row blocks (70 > 64 rows).
    gen = torch.Generator().manual_seed(parts + rows)
    full = torch.randint(-4, 5, (rows, parts * 3), generator=gen).float()
    full[torch.rand(rows, parts * 3, generator=gen) < 0.01] = float("nan")
    pieces = full.reshape(rows, parts, 3)
    local = torch.argmax(pieces, -1)
    values = pieces.gather(2, local[..., None])[..., 0]
    index = (local + torch.arange(parts)[None, :] * 3).float()
    order = torch.randperm(parts, generator=gen)  # parts in any order, NaNs in several blocks
    pairs = torch.stack([values, index], -1).transpose(0, 1)[order].contiguous().to(DEVICE)
    out = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    got = combine_shard_argmax(pairs, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), torch.argmax(full, -1))


@pytest.mark.parametrize("rows", [1, 8, 32, 128])
def test_plan_spreads_the_dsv4_vocab(rows: int) -> None:
    # V = 129280 in 4 shards: M = 1 must launch more programs than a GPU of 132 SMs has SMs, and
    # every chunk but a shard's last is full.
    plan = _plan_chunks([32320] * 4, rows, None)
    programs = rows * sum(plan.counts)
    assert programs >= 132
    assert programs <= 2048
    assert all(c * (n - 1) < 32320 <= c * n for c, n in zip(plan.chunks, plan.counts))
    assert plan.block <= plan.chunks[0] and plan.chunks[0] % plan.block == 0
    single = _plan_chunks([129280], 4096, None)
    assert single.counts == [1]  # large M: one program per row, no combine launch


@pytest.mark.parametrize(
    "meta,dtype",
    [
        ({"per_row": 1, "max_block": 16, "num_warps": 4}, torch.float32),  # many blocks per chunk
        ({"per_row": 3, "max_block": 32, "num_warps": 2}, torch.bfloat16),
        ({"per_row": 1000, "max_block": 4096, "num_warps": 8}, torch.float32),  # 16-column chunks
    ],
    ids=["one_chunk_many_blocks", "three_chunks", "smallest_chunks"],
)
def test_launch_meta_never_changes_results(meta, dtype, monkeypatch) -> None:
    """Any meta `_chunk_meta` may return gives torch.argmax's ids: ties, NaNs and all -inf rows
    on block boundaries (the lanes of a block see columns b, b + BLOCK, ...)."""
    monkeypatch.setattr(vocab_argmax_module, "_chunk_meta", lambda total, rows: dict(meta))
    gen = torch.Generator().manual_seed(meta["per_row"] * 31 + meta["max_block"])
    width = 200
    x = torch.cat(
        [
            _boundary_rows(width, [16, 32, 33, 199], gen),
            torch.randn(2, width, generator=gen),
            torch.randint(-2, 3, (2, width), generator=gen).float(),
        ]
    )
    x[-1, [52, 84, 116]] = float("nan")  # one lane (BLOCK 16 or 32) sees three NaNs -> 52
    x[-2, [84, 52]] = float("inf")  # and two +inf -> 52
    x = x.to(dtype).to(DEVICE)
    expected = vocab_argmax_ref([x])
    assert torch.equal(vocab_argmax(x, out=torch.full_like(expected, -7)), expected)
    pairs = shard_argmax_pairs(x, 77, out=torch.full((x.shape[0], 2), float("nan"), device=DEVICE))
    assert torch.equal(pairs[:, 1].long(), expected + 77)
    picked = x.float().gather(1, expected[:, None])[:, 0]
    assert torch.equal(pairs[:, 0].isnan(), picked.isnan())
    assert torch.equal(pairs[:, 0].nan_to_num(), picked.nan_to_num())
    shards = [s.contiguous() for s in torch.split(x, [60, 1, 139], dim=1)]
    assert torch.equal(vocab_argmax(shards), expected)


def test_default_plan_covers_every_column_once() -> None:
    """Whatever the row count, the default plan's chunks tile the shard (chunk * count covers
    it, a chunk a whole number of loads, no empty chunk), chunks hold >= 512 columns unless the
    shard is narrower, and the programs stay within the grid limit."""
    for width in (1, 600, 32320, 129280):
        for rows in (1, 4, 8, 24, 32, 128, 1000):
            plan = _plan_chunks([width], rows, None)
            (chunk,), (count,) = plan.chunks, plan.counts
            assert chunk % plan.block == 0 and chunk * count >= width > chunk * (count - 1)
            assert chunk >= min(width, 512) and rows * count <= 65535 * 65535
