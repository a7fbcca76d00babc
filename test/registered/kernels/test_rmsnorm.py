"""`kernels/norm/rmsnorm.py`: the Triton RMSNorm against its reference, plus the reference against
float64 maths.

Exactness (a tolerance, see the module docstring): the kernel's mean square is summed in another order
and its rsqrt may be lowered differently, so rstd can differ from torch's in its last fp32 bits.
Everything after rstd is reproduced (same rounding points, RNE on the bits for bf16), so:
  * fp32 outputs agree to rtol 1e-6 (a few fp32 ulps of rstd);
  * bf16/fp16 outputs agree to two units in the last place (2 * eps of the dtype: one for the
    output rounding, one for the weightless variant's rstd rounded to x's dtype), AND at least
    99% of the elements are bit-identical, which a kernel with a wrong rounding point (e.g.
    rstd not cast to x's dtype first) fails by a wide margin.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.norm.reference import rms_norm_ref
from sgl_dspark.kernels.norm.rmsnorm import MAX_N, _norm_meta, rms_norm, rms_norm_pair

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROWS = (0, 1, 7, 300)
WIDTHS = (16, 64, 100, 512, 1024, 4096)


def _inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    weighted: bool,
    seed: int,
    weight_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows with mixed magnitudes (mean square from ~1e-8, where eps matters, to ~1e4)."""
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=gen)
    if x.numel():
        rows = x.view(-1, n)
        rows *= 10.0 ** torch.randint(-4, 3, (rows.shape[0], 1), generator=gen).float()
    weight = (1 + 0.5 * torch.randn(n, generator=gen)).to(weight_dtype) if weighted else None
    return x.to(dtype).to(DEVICE), None if weight is None else weight.to(DEVICE)


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def _assert_x2_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got).any()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
        return
    rtol = 2 * torch.finfo(want.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-30)
    if want.numel():
        assert (got == want).float().mean().item() >= 0.99


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "weightless"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_matches_reference_over_rows_and_widths(dtype: torch.dtype, weighted: bool) -> None:
    for i, (rows, n) in enumerate((r, n) for r in ROWS for n in WIDTHS):
        x, weight = _inputs((rows, n), dtype, weighted, seed=100 * i + rows)
        out = _poisoned(x)
        got = rms_norm(x, weight, 1e-6, out=out)
        assert got is out
        _assert_x2_close(got, rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "weightless"])
@pytest.mark.parametrize("shape", [(5, 16, 64), (3, 4, 512), (2, 3, 1, 100)])
def test_leading_dims_are_rows(shape: tuple[int, ...], weighted: bool) -> None:
    """Per-head norms: [T, heads, head_dim] (and deeper) normalise each head separately."""
    x, weight = _inputs(shape, torch.bfloat16, weighted, seed=sum(shape))
    got = rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape
    _assert_x2_close(got, rms_norm_ref(x, weight, 1e-5))
    flat = rms_norm(x.reshape(-1, shape[-1]), weight, 1e-5)
    assert torch.equal(got.reshape(-1, shape[-1]), flat)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weight_with_fp32_activations(weight_dtype: torch.dtype) -> None:
    x, weight = _inputs((9, 100), torch.float32, True, seed=3, weight_dtype=weight_dtype)
    _assert_x2_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("n", [64, 100, 4096])
def test_row_result_does_not_depend_on_batch(n: int) -> None:
    """The block shape depends on N only, so a row gives the same bits alone or in a batch
    (what lets a CUDA-graph bucket with padding rows match an eager step)."""
    x, weight = _inputs((37, n), torch.float32, True, seed=n)
    batch = rms_norm(x, weight, 1e-6)
    for r in (0, 18, 36):
        assert torch.equal(rms_norm(x[r : r + 1], weight, 1e-6), batch[r : r + 1])
    assert torch.equal(rms_norm(x[5:21], weight, 1e-6), batch[5:21])


def test_reference_matches_float64_maths() -> None:
    """The reference itself: RMSNorm computed independently in float64."""
    x, weight = _inputs((50, 100), torch.float32, True, seed=8)
    x64, w64 = x.double(), weight.double()
    want = w64 * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-6).double(), want, rtol=1e-6, atol=1e-30)
    unweighted = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(
        rms_norm_ref(x, None, 1e-6).double(), unweighted, rtol=1e-6, atol=1e-30
    )


def test_weightless_rounds_rstd_to_input_dtype() -> None:
    """Hand-derived: row [3, 4] in bf16 has mean square 12.5, rstd = 1/sqrt(12.5) = 0.28284...,
    which bf16 rounds to 0.283203125; outputs are bf16(3 * that) and bf16(4 * that). A kernel
    that multiplied by the fp32 rstd would give bf16(0.848528) = 0.84765625, not 0.8515625."""
    x = torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16, device=DEVICE)
    rstd_bf16 = 0.283203125
    want = torch.tensor([[3 * rstd_bf16, 4 * rstd_bf16]]).to(torch.bfloat16).to(DEVICE)
    assert want[0, 0].item() == 0.8515625
    # eps = 1e-6 moves rstd by ~4e-8 relative: far from a bf16 rounding boundary of rstd.
    got = rms_norm(x, None, 1e-6, out=_poisoned(x))
    assert torch.equal(got, want)
    assert torch.equal(rms_norm_ref(x, None, 1e-6), want)


def test_in_place_output() -> None:
    x, weight = _inputs((33, 512), torch.bfloat16, True, seed=4)
    want = rms_norm(x, weight, 1e-6)
    got = rms_norm(x, weight, 1e-6, out=x)
    assert got is x and torch.equal(x, want)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_column_block_of_wider_rows_is_read_in_place(rows: int) -> None:
    """A column block of a fused projection output (row stride > N) gives the bits of the
    same rows copied to a contiguous buffer, into a fresh contiguous output."""
    wide, _ = _inputs((rows, 64 + 100 + 8), torch.bfloat16, False, seed=rows)
    _, weight = _inputs((1, 100), torch.bfloat16, True, seed=rows + 1)
    block = wide[:, 64:164]
    assert not block.is_contiguous() or rows == 1
    got = rms_norm(block, weight, 1e-6)
    assert got.is_contiguous() and got.shape == block.shape
    assert torch.equal(got, rms_norm(block.contiguous(), weight, 1e-6))
    _assert_x2_close(got, rms_norm_ref(block.contiguous(), weight, 1e-6))


def test_empty_inputs_return_without_launch() -> None:
    for shape in [(0, 64), (0, 4, 512), (3, 0)]:
        x = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
        assert rms_norm(x, None, 1e-6).shape == shape


def test_rejects_bad_layouts() -> None:
    x, weight = _inputs((8, 64), torch.float32, True, seed=5)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x.t(), None, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:32], 1e-6)
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, weight, 1e-6, out=torch.empty_like(x, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must be"):
        rms_norm(x.to(torch.int32), None, 1e-6)
    with pytest.raises(ValueError, match="at most"):
        rms_norm(torch.ones(1, MAX_N + 1, device=DEVICE), None, 1e-6)


@pytest.mark.parametrize("n", [64, 100, 1024])
def test_zero_rows_in_a_partial_row_block(n: int) -> None:
    """All-zero rows (mean square 0, rstd = 1/sqrt(eps)) beside normal ones, with a row count
    that leaves the last row block partly masked; power-of-two N takes the multiply-by-1/N
    path, N = 100 the division."""
    x, weight = _inputs((7, n), torch.float32, True, seed=n + 1)
    x[1] = 0.0
    x[6] = 0.0
    got = rms_norm(x, weight, 1e-6, out=_poisoned(x))
    _assert_x2_close(got, rms_norm_ref(x, weight, 1e-6))
    assert torch.equal(got[[1, 6]], torch.zeros(2, n, device=DEVICE))


def test_launch_meta_depends_on_the_width_only() -> None:
    """Batch invariance: the meta takes the width alone (no row count), covers the row in one
    power-of-two tile and keeps warps within what one program can use."""
    import inspect

    assert list(inspect.signature(_norm_meta).parameters) == ["n"]
    for n in (1, 100, 128, 512, 1000, 1024, 4096, 16384, MAX_N):
        meta = _norm_meta(n)
        assert meta["BLOCK_N"] >= n > meta["BLOCK_N"] // 2
        assert meta["BLOCK_M"] >= 1 and meta["num_warps"] in (1, 2, 4, 8, 16)
        assert meta["num_warps"] * 32 <= max(128, meta["BLOCK_M"] * meta["BLOCK_N"])


# (N of norm a, N of norm b, rows): DeepSeek-V4.1's q_a and kv norms (one launch: 4 warps each),
# a packed pair, and a pair whose tiles run on different warps (two launches).
PAIR_CASES = [(1024, 512, 1), (1280, 512, 3), (48, 100, 37), (4096, 512, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PAIR_CASES, ids=str)
def test_norm_pair_gives_each_norm_its_own_bits(case: tuple, dtype: torch.dtype) -> None:
    """`rms_norm_pair` on two column blocks of one projection output (read in place) equals two
    `rms_norm` calls bit for bit, weighted and weightless, with its own eps each."""
    na, nb, rows = case
    joint, _ = _inputs((rows, na + nb + 24), dtype, False, seed=na + nb + rows)
    xa, xb = joint[:, :na], joint[:, na : na + nb]
    _, wa = _inputs((1, na), dtype, True, seed=1)
    for wb in (_inputs((1, nb), dtype, True, seed=2)[1], None):
        args_a, args_b = (xa, wa, 1e-6), (xb, wb, 1e-3)
        got_a, got_b = rms_norm_pair(args_a, args_b)
        assert torch.equal(got_a, rms_norm(*args_a))
        assert torch.equal(got_b, rms_norm(*args_b))
        assert got_a.shape == (rows, na) and got_b.shape == (rows, nb)


def test_norm_pair_arguments_are_checked() -> None:
    x, w = _inputs((2, 64), torch.float32, True, seed=3)
    with pytest.raises(ValueError, match="one dtype"):
        rms_norm_pair((x, w, 1e-6), (x.to(torch.bfloat16), w, 1e-6))
    with pytest.raises(ValueError, match="weight"):
        rms_norm_pair((x, w, 1e-6), (x, w[:32], 1e-6))
