"""K13: interleaved tail RoPE with full-row write vs its reference (bit-exact, X1)."""

from __future__ import annotations

import math

import pytest
import torch
from sgl_dspark.kernels.rope import rope_tail, rope_tail_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    # Bit patterns, so -0.0 vs +0.0 and rounding ties count as differences.
    assert torch.equal(got.cpu().view(_BITS[got.dtype]), want.cpu().view(_BITS[want.dtype]))


def _tables(positions: torch.Tensor, rope_dim: int, theta: float = 10000.0):
    freqs = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = positions.double()[:, None] * freqs[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def _inputs(tokens: int, heads: int, head_dim: int, rope_dim: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, heads, head_dim, generator=gen) * 3).to(dtype)
    cos, sin = _tables(torch.randint(0, 70000, (tokens,), generator=gen), rope_dim)
    return x, cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize(
    "tokens,heads,out_heads,head_dim,rope_dim",
    [
        (0, 4, 4, 64, 16),
        (1, 1, 1, 8, 8),  # whole head rotates (no pass-through channels)
        (4, 3, 8, 24, 8),  # heads padded to a multiple of 8
        (37, 5, 5, 96, 32),
        (6, 16, 64, 512, 64),  # DSV4 per-rank q: 16 heads padded to 64, 448 + 64 channels
        (5, 12, 10, 40, 6),  # un-padding (attention output), rd/2 not a power of two
    ],
)
def test_matches_reference(tokens, heads, out_heads, head_dim, rope_dim, inverse, dtype) -> None:
    x, cos, sin = _inputs(tokens, heads, head_dim, rope_dim, dtype, seed=tokens * 31 + heads)
    want = rope_tail_ref(x, cos, sin, inverse=inverse, out_heads=out_heads)
    out = torch.full((tokens, out_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    got = rope_tail(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), inverse=inverse, out=out)
    assert got.data_ptr() == out.data_ptr()
    _assert_bits_equal(got, want)


def test_strided_views_and_preallocated_bucket() -> None:
    tokens, heads, head_dim, rope_dim = 9, 6, 64, 16
    x, cos, sin = _inputs(tokens, heads + 2, head_dim + 8, rope_dim, torch.bfloat16, seed=3)
    x_view = x[:, 1 : heads + 1, :head_dim]  # head stride 72, token stride 576
    table = torch.cat([cos, sin], dim=1)  # cos/sin as column slices of one table (row stride 16)
    cos_view, sin_view = table[:, : rope_dim // 2], table[:, rope_dim // 2 :]
    bucket = torch.full((tokens + 4, 8, head_dim), float("nan"), dtype=torch.bfloat16)
    bucket = bucket.to(DEVICE)
    got = rope_tail(x_view.to(DEVICE), cos_view.to(DEVICE), sin_view.to(DEVICE),
                    out=bucket[:tokens])
    _assert_bits_equal(got, rope_tail_ref(x_view, cos_view, sin_view, out_heads=8))
    assert torch.isnan(bucket[tokens:].float()).all()  # rows past M untouched


def test_in_place() -> None:
    x, cos, sin = _inputs(7, 4, 32, 16, torch.bfloat16, seed=5)
    want = rope_tail_ref(x, cos, sin)
    x_dev = x.to(DEVICE)
    got = rope_tail(x_dev, cos.to(DEVICE), sin.to(DEVICE), out=x_dev)
    _assert_bits_equal(got, want)
    _assert_bits_equal(x_dev, want)


def test_reference_against_hand_derived_rotation() -> None:
    # Quarter turn (cos 0, sin 1): (a, b) -> (-b, a); a half turn on the second pair: -> (-a, -b).
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]])
    cos = torch.tensor([[0.0, -1.0]])
    sin = torch.tensor([[1.0, 0.0]])
    assert rope_tail_ref(x, cos, sin).tolist() == [[[1.0, 2.0, -4.0, 3.0, -5.0, -6.0]]]
    assert rope_tail_ref(x, cos, sin, inverse=True).tolist() == [[[1.0, 2.0, 4.0, -3.0, -5.0, -6.0]]]
    got = rope_tail(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), out_heads=2)
    assert got.cpu().tolist() == [[[1.0, 2.0, -4.0, 3.0, -5.0, -6.0], [0.0] * 6]]


def test_inverse_undoes_forward() -> None:
    # Rotation is orthogonal: inverse(forward(x)) == x up to fp32 rounding (two roundings).
    x, cos, sin = _inputs(11, 3, 64, 64, torch.float32, seed=8)
    x, cos, sin = x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)
    back = rope_tail(rope_tail(x, cos, sin), cos, sin, inverse=True)
    torch.testing.assert_close(back, x, rtol=0, atol=4 * 3 * 8 * 2.0**-23 * math.sqrt(2))


def test_bad_arguments_raise() -> None:
    x = torch.randn(2, 3, 16, device=DEVICE)
    cos = torch.randn(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_tail(x, cos, cos[:1])
    with pytest.raises(ValueError, match="cos/sin"):
        rope_tail(x, cos.double(), cos.double())
    with pytest.raises(ValueError, match="out"):
        rope_tail(x, cos, cos, out=torch.empty(2, 3, 16, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        rope_tail(x.transpose(1, 2).contiguous().transpose(1, 2), cos, cos)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5])
def test_scatter_rows_into_a_pool(tokens: int, dtype) -> None:
    """out_rows: each token's rotated row lands at its pool row, bit for bit as the reference
    followed by an index_put; every other pool row keeps its poison."""
    x, cos, sin = (t.to(DEVICE) for t in _inputs(tokens, 1, 64, 32, dtype, seed=60 + tokens))
    pool = torch.full((40, 1, 64), float("nan"), dtype=dtype, device=DEVICE)
    rows = torch.randperm(40, generator=torch.Generator().manual_seed(tokens))[:tokens]
    rows = rows.to(DEVICE)
    got = rope_tail(x, cos, sin, out=pool, out_rows=rows)
    assert got is pool
    _assert_bits_equal(pool[rows], rope_tail_ref(x, cos, sin))
    others = torch.ones(40, dtype=torch.bool, device=DEVICE)
    others[rows] = False
    assert torch.isnan(pool[others].float()).all()
    with pytest.raises(ValueError, match="out_rows"):
        rope_tail(x, cos, sin, out_rows=rows)
