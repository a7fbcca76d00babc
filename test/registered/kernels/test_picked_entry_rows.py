"""A top-k selection's pool rows and validity in one launch (`picked_entry_rows`) against its
reference, every integer equal: selections read in place as the leading columns of a sorted
row, picks scored -inf dropped (row 0) wherever they fall, entry ids past the request table's
width (clamped, then masked), int32 and int64 ids and tables, requests in any order, empty
selections; bad arguments name the field. And the whole top-k selection in one launch
(`topk_entry_rows`, its sort included) against `topk_entry_rows_ref`."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.compressor.entry_rows import picked_entry_rows, topk_entry_rows
from sgl_dspark.kernels.compressor.reference import picked_entry_rows_ref, topk_entry_rows_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _selection(tokens: int, width: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, width, generator=g)
    scores[torch.rand(tokens, width, generator=g) < 0.3] = float("-inf")
    scores[0] = float("-inf")  # a row with nothing visible
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(
    ("tokens", "width", "k", "ratio"), [(1, 5, 3, 2), (4, 40, 16, 1), (7, 300, 64, 2), (3, 9, 9, 4)]
)
def test_matches_reference(index_dtype, tokens, width, k, ratio):
    g = torch.Generator().manual_seed(tokens * 31 + width + k + ratio)
    values, indices = _selection(tokens, width, k, seed=width + k)
    assert not values.is_contiguous() or k == width or tokens == 1
    # Pages are multiples of the ratio: a block start's slot is too. Narrower than width *
    # ratio: ids past the table clamp to its last column.
    table = torch.randint(0, 500, (6, max(1, (width * ratio) // 2)), generator=g) * ratio
    table = table.to(index_dtype)
    token_slot = torch.randint(0, 6, (tokens,), generator=g)
    want_rows, want_valid = picked_entry_rows_ref(
        values, indices.to(index_dtype), table, token_slot, ratio
    )
    rows, valid = picked_entry_rows(
        values.to(DEVICE),
        indices.to(index_dtype).to(DEVICE),
        table.to(DEVICE),
        token_slot.to(DEVICE),
        ratio,
    )
    assert rows.dtype == torch.int64 and valid.dtype == torch.bool
    assert torch.equal(valid.cpu(), want_valid) and torch.equal(rows.cpu(), want_rows)
    assert not valid[0].any() and (rows[0] == 0).all()


def test_empty_and_bad_arguments():
    values, indices = _selection(2, 4, 0, seed=1)
    table, slots = torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    rows, valid = picked_entry_rows(values, indices, table, slots, 2)
    assert rows.shape == (2, 0) and valid.shape == (2, 0)
    values, indices = _selection(2, 4, 3, seed=2)
    with pytest.raises(ValueError, match="values"):
        picked_entry_rows(values.double(), indices, table, slots, 2)
    with pytest.raises(ValueError, match="values"):
        picked_entry_rows(values, indices[:, :2], table, slots, 2)
    with pytest.raises(ValueError, match="token_slot"):
        picked_entry_rows(values, indices, table, slots[:1], 2)


@pytest.mark.parametrize(
    ("tokens", "width", "k", "ratio"),
    [(1, 7, 3, 2), (3, 150, 64, 2), (2, 1000, 512, 2), (4, 33, 33, 1), (2, 4097, 100, 2)],
)
def test_topk_entry_rows_sorts_and_addresses_as_the_reference(tokens, width, k, ratio):
    """`topk_entry_rows` (sort and addressing in one launch; past TOPK_SORT_MAX = 4096 entries
    torch's sort then one launch) gives the reference's integers: scores on a coarse grid so
    ties are common (the lower entry first), -inf picks dropped wherever they land, -0.0 tied
    with +0.0, a row with nothing visible."""
    g = torch.Generator().manual_seed(tokens * 7 + width + k)
    scores = torch.randint(-3, 4, (tokens, width), generator=g).float() * 0.5
    scores[torch.rand(tokens, width, generator=g) < 0.3] = float("-inf")
    scores[0, :2] = torch.tensor([-0.0, 0.0])
    scores[-1] = float("-inf") if tokens > 1 else scores[-1]
    table = torch.randint(0, 500, (5, width * ratio + 4), generator=g).to(torch.int32) * ratio
    token_slot = torch.randint(0, 5, (tokens,), generator=g)
    on = lambda t: t.to(DEVICE)
    got_rows, got_valid = topk_entry_rows(on(scores), k, on(table), on(token_slot), ratio)
    want_rows, want_valid = topk_entry_rows_ref(scores, k, table, token_slot, ratio)
    assert got_rows.dtype == torch.int64 and got_valid.dtype == torch.bool
    assert torch.equal(got_rows.cpu(), want_rows) and torch.equal(got_valid.cpu(), want_valid)
    assert want_valid.any() and (tokens == 1 or not want_valid[-1].any())
    # The stable order by hand on the first row: its best scores, lower entries first.
    order = sorted(range(width), key=lambda j: (-scores[0, j].item(), j))[:k]
    best = [j for j in order if scores[0, j] > float("-inf")]
    rows = table[token_slot[0], [j * ratio for j in best]].long() // ratio
    assert got_rows[0, : len(best)].cpu().tolist() == rows.tolist()


def test_topk_entry_rows_bad_arguments():
    scores = torch.zeros(2, 8, device=DEVICE)
    table = torch.zeros(3, 20, dtype=torch.int32, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="k: expected"):
        topk_entry_rows(scores, 9, table, slots, 2)
    with pytest.raises(ValueError, match="scores"):
        topk_entry_rows(scores.double(), 4, table, slots, 2)
    with pytest.raises(ValueError, match="token_slot"):
        topk_entry_rows(scores, 4, table, slots[:1], 2)
