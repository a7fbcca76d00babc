"""Interleaved tail RoPE with full-row write (`rope_tail`) vs its reference (bit-exact)."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from sgl_dspark.kernels.rope.epilogue import rotate_rounded_tail
from sgl_dspark.kernels.rope.reference import rope_tail_ref
from sgl_dspark.kernels.rope.tail import rope_tail

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
    got = rope_tail(
        x_view.to(DEVICE), cos_view.to(DEVICE), sin_view.to(DEVICE), out=bucket[:tokens]
    )
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
    assert rope_tail_ref(x, cos, sin, inverse=True).tolist() == [
        [[1.0, 2.0, 4.0, -3.0, -5.0, -6.0]]
    ]
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


# ---- Fused pre-norm (norm_eps / norm_weight): a tolerance against rms_norm_ref -> rope. ----

_EPS = 1e-6
_RSTD_ULPS = 8  # rstd may differ from torch's in its last bits (summation order, rsqrt)


def _norm_inputs(
    tokens: int, heads: int, head_dim: int, rope_dim: int, dtype, seed: int, weighted: bool
):
    x, cos, sin = _inputs(tokens, heads, head_dim, rope_dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    x = x + (torch.rand(tokens, heads, 1, generator=gen) * 4).to(dtype)  # rows of varied scale
    # No exact zeros: `_normed_by_kernel`'s identity rotation keeps every value but the sign of
    # a zero (a * 0 + -0.0 is +0.0 for a > 0).
    x = torch.where(x == 0, torch.ones_like(x), x)
    weight = torch.randn(head_dim, generator=gen) * 0.5 + 1.0 if weighted else None
    return x, cos, sin, weight


def _to(device, *tensors):
    return tuple(None if t is None else t.to(device) for t in tensors)


def _normed_by_kernel(x, cos, eps, weight):
    """The kernel's own normed rows: the identity rotation (cos 1, sin 0) with the same rope
    width returns them exactly (a * 1 - b * 0 = a, a * 0 + b * 1 = b, already in x's dtype);
    the rstd is the same as in any other call on these rows, since it does not depend on the
    angles."""
    ones = torch.ones_like(cos)
    out = torch.full_like(x, float("nan"))
    rope_tail(x, ones, ones * 0, out=out, norm_eps=eps, norm_weight=weight)
    assert not torch.isnan(out.float()).any()
    return out


def _assert_norm_after_rstd(normed, x, eps, weight) -> None:
    """Every row equals rms_norm_ref's operations after the rstd (weighted dtype(w * (x * r)),
    weightless x * dtype(r)) for some r within _RSTD_ULPS fp32 ulps of torch's rstd."""
    x, normed = x.cpu(), normed.cpu()
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    cands, up, down = [rstd], rstd, rstd
    for _ in range(_RSTD_ULPS):
        up, down = torch.nextafter(up, up * 2), torch.nextafter(down, down * 0)
        cands += [up, down]
    bits = _BITS[x.dtype]
    matched = torch.zeros(x.shape[:-1], dtype=torch.bool)
    for r in cands:
        if weight is None:
            y = x * r.to(x.dtype)
        else:
            y = (weight.cpu().float() * (x.float() * r)).to(x.dtype)
        matched |= (y.view(bits) == normed.view(bits)).all(-1)
    assert matched.all(), f"{(~matched).sum()} rows are no rounded norm of x"


def _assert_close_to_composition(got, want) -> None:
    """Against rms_norm_ref -> rope_tail_ref: fp32 within 1e-5 relative (plus 1e-6 of the row's
    largest magnitude, for rotated values that cancel); bf16 within one ulp at the row's scale
    (a last-bit rstd change moves the rounding of a few elements) and nearly all equal."""
    assert got.dtype == want.dtype
    is_fp32 = want.dtype == torch.float32
    rtol, atol = (1e-5, 1e-6) if is_fp32 else (2.0**-8, 2.0**-8)
    got, want = got.cpu().float(), want.cpu().float()
    if want.numel():
        scale = want.abs().amax(-1, keepdim=True)
        assert ((got - want).abs() <= rtol * want.abs() + atol * scale).all()
        if not is_fp32:
            assert (got == want).float().mean() >= 0.9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [0, 1, 5, 33])
@pytest.mark.parametrize("heads,head_dim,rope_dim", [(1, 128, 64), (3, 64, 32), (16, 96, 32)])
def test_weightless_norm_per_head(tokens, heads, head_dim, rope_dim, dtype) -> None:
    """q: HF's UnweightedRMSNorm of every head, then the rope tail, in one launch."""
    x, cos, sin, _ = _norm_inputs(
        tokens, heads, head_dim, rope_dim, dtype, seed=7 * tokens + heads, weighted=False
    )
    want = rope_tail_ref(x, cos, sin, norm_eps=_EPS)
    x, cos, sin = _to(DEVICE, x, cos, sin)
    out = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    got = rope_tail(x, cos, sin, out=out, norm_eps=_EPS)
    assert got is out and not torch.isnan(out.float()).any()
    normed = _normed_by_kernel(x, cos, _EPS, None)
    _assert_norm_after_rstd(normed, x, _EPS, None)
    # Nope channels are the normed values, the tail is their reference rotation, bit for bit.
    _assert_bits_equal(got, rope_tail_ref(normed, cos, sin))
    _assert_close_to_composition(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [0, 1, 5, 33])
@pytest.mark.parametrize("head_dim,rope_dim", [(512, 64), (96, 32)])
def test_weighted_norm_scatter_into_pool(tokens, head_dim, rope_dim, dtype) -> None:
    """The KV row: weighted norm, rope tail and the write into the paged pool at shuffled
    slots in one launch; every other pool row keeps its poison."""
    x, cos, sin, weight = _norm_inputs(
        tokens, 1, head_dim, rope_dim, dtype, seed=11 * tokens + head_dim, weighted=True
    )
    if dtype == torch.bfloat16 and head_dim == 96:
        weight = weight.to(dtype)  # a weight stored in x's dtype
    want = rope_tail_ref(x, cos, sin, norm_eps=_EPS, norm_weight=weight)
    x, cos, sin, weight = _to(DEVICE, x, cos, sin, weight)
    pool = torch.full((48, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.randperm(48, generator=torch.Generator().manual_seed(tokens))[:tokens]
    slots = slots.to(DEVICE)
    rope_tail(x, cos, sin, out=pool.unsqueeze(1), out_rows=slots, norm_eps=_EPS, norm_weight=weight)
    got = pool[slots].unsqueeze(1)
    normed = _normed_by_kernel(x, cos, _EPS, weight)
    _assert_norm_after_rstd(normed, x, _EPS, weight)
    _assert_bits_equal(got, rope_tail_ref(normed, cos, sin))
    _assert_close_to_composition(got, want)
    others = torch.ones(48, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.isnan(pool[others].float()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,out_heads", [(3, 8), (16, 10)])
def test_norm_with_head_padding_and_in_place(heads, out_heads, dtype) -> None:
    """Pad heads stay +0.0 (not normed zeros times a negative weight), dropped heads are not
    written; in place (out = x) the row is read whole before it is written."""
    x, cos, sin, weight = _norm_inputs(6, heads, 64, 16, dtype, seed=heads, weighted=True)
    weight = -weight  # negative weights: w * 0 would be -0.0 on the pad heads
    x, cos, sin, weight = _to(DEVICE, x, cos, sin, weight)
    normed = _normed_by_kernel(x, cos, _EPS, weight)
    _assert_norm_after_rstd(normed, x, _EPS, weight)
    out = torch.full((6, out_heads, 64), float("nan"), dtype=dtype, device=DEVICE)
    rope_tail(x, cos, sin, out=out, norm_eps=_EPS, norm_weight=weight)
    _assert_bits_equal(out, rope_tail_ref(normed, cos, sin, out_heads=out_heads))
    x_copy = x.clone()
    got = rope_tail(x_copy, cos, sin, out=x_copy, norm_eps=_EPS, norm_weight=weight)
    _assert_bits_equal(got, rope_tail_ref(normed, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "weighted,heads,head_dim,rope_dim",
    [(False, 16, 128, 64), (False, 5, 96, 32), (True, 1, 512, 64)],
)
def test_norm_rows_do_not_depend_on_batch(weighted, heads, head_dim, rope_dim, dtype) -> None:
    """Speculative verify rows must reproduce decode rows: each row of a T = 8 call equals, bit
    for bit, the same row run alone (T = 1); and a row does not change when the other rows do."""
    x, cos, sin, weight = _norm_inputs(
        8, heads, head_dim, rope_dim, dtype, seed=head_dim, weighted=weighted
    )
    x, cos, sin, weight = _to(DEVICE, x, cos, sin, weight)
    batch = torch.full_like(x, float("nan"))
    rope_tail(x, cos, sin, out=batch, norm_eps=_EPS, norm_weight=weight)
    assert not torch.isnan(batch.float()).any()
    for m in range(8):
        one = rope_tail(
            x[m : m + 1], cos[m : m + 1], sin[m : m + 1], norm_eps=_EPS, norm_weight=weight
        )
        _assert_bits_equal(batch[m : m + 1], one)
    other = _norm_inputs(8, heads, head_dim, rope_dim, dtype, seed=head_dim + 1, weighted=False)[
        0
    ].to(DEVICE)
    h = heads // 2
    other[3, h] = x[3, h]
    again = rope_tail(other, cos, sin, norm_eps=_EPS, norm_weight=weight)
    _assert_bits_equal(again[3, h], batch[3, h])
    assert not torch.equal(again[2].float(), batch[2].float())


# eps 0: the empty rows of the head block have rstd inf (masked, never stored); numpy warns.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_norm_reference_against_hand_derived_values() -> None:
    # Row (2, 2, 2, 2): mean square 4, rstd 1/2 (eps 0) -> (1, 1, 1, 1); weight (1, 2, 3, 4)
    # -> (1, 2, 3, 4); a quarter turn of the tail pair (3, 4) -> (-4, 3).
    x = torch.full((1, 1, 4), 2.0)
    cos, sin = torch.tensor([[0.0]]), torch.tensor([[1.0]])
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0])
    want = [[[1.0, 2.0, -4.0, 3.0]]]
    assert rope_tail_ref(x, cos, sin, norm_eps=0.0, norm_weight=weight).tolist() == want
    got = rope_tail(*_to(DEVICE, x, cos, sin), norm_eps=0.0, norm_weight=weight.to(DEVICE))
    assert got.cpu().tolist() == want
    # Weightless, bf16: rstd of (3, 4, 0, 0) is 1/sqrt(6.25) = 0.4 -> bf16 0.400390625.
    x = torch.tensor([[[3.0, 4.0, 0.0, 0.0]]], dtype=torch.bfloat16)
    r = 0.400390625
    want_bf16 = torch.tensor([[[3 * r, 4 * r, 0.0, 0.0]]]).to(torch.bfloat16)
    got = rope_tail(*_to(DEVICE, x, torch.tensor([[1.0]]), torch.tensor([[0.0]])), norm_eps=0.0)
    _assert_bits_equal(got, want_bf16)


def test_norm_bad_arguments_raise() -> None:
    x = torch.randn(2, 3, 16, device=DEVICE)
    cos = torch.randn(2, 4, device=DEVICE)
    weight = torch.rand(16, device=DEVICE)
    with pytest.raises(ValueError, match="norm_weight needs norm_eps"):
        rope_tail(x, cos, cos, norm_weight=weight)
    with pytest.raises(ValueError, match="inverse"):
        rope_tail(x, cos, cos, inverse=True, norm_eps=_EPS)
    with pytest.raises(ValueError, match="inverse"):
        rope_tail_ref(x, cos, cos, inverse=True, norm_eps=_EPS)
    for bad in (
        weight[:8],
        torch.rand(2, 16, device=DEVICE),
        weight.double(),
        weight.half(),
        torch.rand(32, device=DEVICE)[::2],
    ):
        with pytest.raises(ValueError, match="norm_weight must be"):
            rope_tail(x, cos, cos, norm_eps=_EPS, norm_weight=bad)
    for bad_eps in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="norm_eps"):
            rope_tail(x, cos, cos, norm_eps=bad_eps)
    # Validated before the empty-batch early return too.
    with pytest.raises(ValueError, match="norm_weight must be"):
        rope_tail(x[:0], cos[:0], cos[:0], norm_eps=_EPS, norm_weight=weight[:8])


@triton.jit
def _rotate_rows_kernel(v_ptr, cos_ptr, sin_ptr, out_ptr, rows_ok, BLOCK_D: tl.constexpr):
    # 16 rows of BLOCK_D channels, rd = 32; rows >= rows_ok index 2^40 rows past the table.
    rows = tl.arange(0, 16)
    cols = tl.arange(0, BLOCK_D)
    v = tl.load(v_ptr + rows[:, None] * BLOCK_D + cols[None, :])
    ok = rows < rows_ok
    cs_rows = tl.where(ok, rows.to(tl.int64), rows.to(tl.int64) + (1 << 40))
    # cos/sin: column views of one [16, 32] table (row stride 32).
    out = rotate_rounded_tail(
        v, cs_rows, ok, cos_ptr, sin_ptr, 32, 0, BLOCK_D, 32, 16, BLOCK_D, True, 0, False
    )
    tl.store(out_ptr + rows[:, None] * BLOCK_D + cols[None, :], out)


def test_rotate_rounded_tail_reads_no_table_row_of_a_masked_row() -> None:
    """The epilogue helper loads table rows only where `row_ok`: a caller's unstored rows (a row
    block's tail) may carry any row index, here 2^40 rows past the table, which a read would
    fault on. The other rows equal `rope_tail(..., inverse=True)` of the same values."""
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(16, 64, generator=gen).to(DEVICE)
    table = torch.randn(16, 32, generator=gen).to(DEVICE)
    cos, sin = table[:, :16], table[:, 16:]
    out = torch.full_like(v, float("nan"))
    # Without FMA contraction, as the attention kernels launch it (a contracted rotation rounds
    # once where rope_tail rounds twice).
    _rotate_rows_kernel[(1,)](v, cos, sin, out, 10, BLOCK_D=64, enable_fp_fusion=False)
    want = rope_tail(v[:10, None], cos[:10], sin[:10], inverse=True)[:, 0]
    assert torch.equal(out[:10], want)
    assert torch.equal(out[10:, :32], v[10:, :32])  # masked rows: nope channels pass through
