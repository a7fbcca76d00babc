"""Engram's embedding gather (`engram_gather`) against its reference, bit for bit: ids read in
place from contiguous, column-sliced and transposed 2-D views, fp32/bf16 tables, row widths that
are not powers of two, an output poisoned before the launch; bad arguments name the field."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.engram.gather import engram_gather
from sgl_dspark.kernels.engram.reference import engram_gather_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(kind: str, t: int, k: int, v: int, g: torch.Generator) -> torch.Tensor:
    if kind == "contiguous":
        return torch.randint(0, v, (t, k), generator=g)
    if kind == "column_slice":  # ids of one n-gram order, inside a wider row
        return torch.randint(0, v, (t, k + 5), generator=g)[:, 2 : 2 + k]
    return torch.randint(0, v, (k, t), generator=g).t()  # transposed: token stride 1


@pytest.mark.parametrize("kind", ["contiguous", "column_slice", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "k", "v", "e"), [(1, 1, 7, 16), (5, 4, 50, 32), (9, 12, 300, 24)])
def test_gather_matches_reference(kind, dtype, t, k, v, e):
    g = torch.Generator().manual_seed(t * 131 + k * 7 + e)
    table = torch.randn(v, e, generator=g).to(dtype)
    ids = _ids(kind, t, k, v, g)
    assert kind == "contiguous" or min(t, k) == 1 or not ids.is_contiguous()
    for index_dtype in (torch.int64, torch.int32):
        want = engram_gather_ref(table, ids)
        out = torch.full((t, k * e), float("nan"), dtype=dtype, device=DEVICE)
        got = engram_gather(table.to(DEVICE), ids.to(index_dtype).to(DEVICE), out=out)
        assert got is out
        assert torch.equal(got.cpu(), want)


def test_bad_arguments_name_the_field():
    table = torch.randn(10, 8)
    with pytest.raises(ValueError, match="ids"):
        engram_gather(table, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="out"):
        engram_gather(table, torch.zeros(3, 2, dtype=torch.int64), out=torch.empty(3, 8))
