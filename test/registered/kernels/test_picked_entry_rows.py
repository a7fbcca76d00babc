"""A top-k selection's pool rows and validity in one launch (`picked_entry_rows`) against its
reference, every integer equal: selections read in place as the leading columns of a sorted
row, picks scored -inf dropped (row 0) wherever they fall, entry ids past the request table's
width (clamped, then masked), int32 and int64 ids and tables, requests in any order, empty
selections; bad arguments name the field."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.compressor.entry_rows import picked_entry_rows
from sgl_dspark.kernels.compressor.reference import picked_entry_rows_ref

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
