"""Small-M linear (`kernels/linear/small_m.py`) against its fp32-accumulating reference.

Within a tolerance: the kernel sums each dot product in BLOCK_K chunks on the matrix unit, the reference in
torch's order, so fp32 outputs agree to ~1e-5 relative (K up to a few thousand) and bf16 outputs
to one bf16 ulp on the rare value that sits at a rounding boundary (interpreter: numpy matmul
in fp32, same bound)."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.linear.reference import small_m_grouped_linear_ref, small_m_linear_ref
from sgl_dspark.kernels.linear.small_m import MAX_M, small_m_grouped_linear, small_m_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEVICE)
    return x, w


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got).any()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
        assert (got == want).float().mean().item() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 16, 256),
        (1, 1160, 1024),
        (3, 100, 300),
        (8, 37, 64),
        (16, 520, 513),
        (5, 9000, 40),
        (2, 1, 1),
    ],
)
def test_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x, w = _inputs(m, n, k, dtype, seed=m * 1000 + n + k)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    got = small_m_linear(x, w, out=out)
    assert got is out
    _check(got, small_m_linear_ref(x, w))


def test_strided_rows_and_batch_invariance() -> None:
    """A column block of a wider activation is read in place; a row's bits do not depend on
    the other rows or on M."""
    x, w = _inputs(6, 48, 200, torch.bfloat16, seed=3)
    wide = torch.randn(6, 300).to(torch.bfloat16).to(DEVICE)
    wide[:, 50:250] = x
    got = small_m_linear(wide[:, 50:250], w)
    assert torch.equal(got, small_m_linear(x, w))
    for r in range(6):
        assert torch.equal(small_m_linear(x[r : r + 1], w), got[r : r + 1])


def test_empty_and_bad_inputs() -> None:
    x, w = _inputs(0, 32, 64, torch.float32, seed=1)
    assert small_m_linear(x, w).shape == (0, 32)
    x, w = _inputs(2, 32, 64, torch.float32, seed=2)
    with pytest.raises(ValueError, match="weight"):
        small_m_linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="K="):
        small_m_linear(x, w[:, :32])


# ---- the grouped variant (V4's grouped output projection) ------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,groups,n,k", [(1, 4, 256, 512), (5, 8, 40, 72), (16, 1, 24, 300), (3, 3, 16, 256)]
)
def test_grouped_matches_reference_and_per_group_calls(
    m: int, groups: int, n: int, k: int, dtype: torch.dtype
) -> None:
    """Each group equals `small_m_linear` on its own columns bit for bit (the same program per
    column block, moved by the group strides), and the reference within its tolerance. x is a view of
    the attention's output rows (head-major), as the layer passes it."""
    g = torch.Generator().manual_seed(m * 100 + groups)
    rows = torch.randn(m, groups * k + 8, generator=g).to(dtype).to(DEVICE)  # a wider row
    x = rows[:, : groups * k].view(m, groups, k)
    w = (torch.randn(groups, n, k, generator=g) * k**-0.5).to(dtype).to(DEVICE)
    got = small_m_grouped_linear(x, w)
    assert got.shape == (m, groups, n) and got.is_contiguous()
    for group in range(groups):
        assert torch.equal(got[:, group], small_m_linear(x[:, group], w[group]))
    _check(got, small_m_grouped_linear_ref(x, w))


def test_grouped_empty_and_bad_inputs() -> None:
    x = torch.randn(2, 4, 32).to(DEVICE)
    w = torch.randn(4, 16, 32).to(DEVICE)
    assert small_m_grouped_linear(x[:0], w).shape == (0, 4, 16)
    with pytest.raises(ValueError, match="G, N, K"):
        small_m_grouped_linear(x, w[:3])
    with pytest.raises(ValueError, match="dtype"):
        small_m_grouped_linear(x, w.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [MAX_M + 1, 40])
def test_rows_past_one_tile_run_as_calls_of_their_own(m: int, dtype: torch.dtype) -> None:
    """Any M runs, in 16-row blocks that each have the bits of a call of their own; with the
    row-position invariance of the tile (bf16 anywhere, fp32 compiled: the interpreter's fp32
    dot is numpy's BLAS, whose sums depend on a row's place in the tile) a row's result never
    depends on the batch (`--enable-deterministic-inference`)."""
    x, w = _inputs(m, 48, 200, dtype, seed=m)
    got = small_m_linear(x, w)
    _check(got, small_m_linear_ref(x, w))
    for b in range(0, m, MAX_M):
        assert torch.equal(got[b : b + MAX_M], small_m_linear(x[b : b + MAX_M], w))
    if dtype == torch.bfloat16 or DEVICE == "cuda":
        for r in (0, 15, 16, m - 1):
            assert torch.equal(got[r : r + 1], small_m_linear(x[r : r + 1], w))
    g = torch.Generator().manual_seed(m)
    xg = torch.randn(m, 3, 40, generator=g).to(dtype).to(DEVICE)
    wg = torch.randn(3, 24, 40, generator=g).to(dtype).to(DEVICE)
    grouped = small_m_grouped_linear(xg, wg)
    torch.testing.assert_close(grouped, small_m_grouped_linear_ref(xg, wg), rtol=2e-2, atol=2e-2)
    for b in range(0, m, MAX_M):
        assert torch.equal(grouped[b : b + MAX_M], small_m_grouped_linear(xg[b : b + MAX_M], wg))
