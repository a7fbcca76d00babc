"""Engram's gated add (`engram_gate`) against its reference, and a row's bits against its batch.

Exactness (a tolerance, see the module docstring): the kernel sums the two mean squares and the
dot product over D in its own tree, where torch uses another order, and its rsqrt / exp are the
backend's, so the gate can differ from torch's in its last fp32 bits. The dot's relative error
from reordering is of order sqrt(D) * 2^-24 (at most D * 2^-24), and the gate, a sigmoid of the
dot's signed square root, moves by at most sqrt|dot| / 8 times that (the sigmoid's slope is at
most 1/4, the square root halves a relative error); here |dot| is of order 1. Every later step
rounds as torch does. So:
  * fp32 outputs agree within `1e-5 * |value| + 1e-6 * |want|`: a gate error of 1e-5, over ten
    times the largest seen (7e-7 at D = 4096), plus a few ulps of the output;
  * bf16 / fp16 outputs within one unit in the last place plus that gate error times |value|
    (it shows only where the add cancels), and at least 99% of the elements bit for bit (a
    kernel with another rounding point, e.g. the output rounded before the add, fails that by a
    wide margin).
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.engram.gate import MAX_D, engram_gate
from sgl_dspark.kernels.engram.reference import engram_gate_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

EPS = 1e-6


def _inputs(
    t: int,
    n: int,
    d: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    seed: int,
    strided: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Streams with mixed row magnitudes (mean squares from ~1e-6 to ~1e4); keys and the value
    of unit scale, weights around 1 with both signs. `strided`: the streams a stream-major view
    (token stride not n * D) and kv a column block of a wider projection output."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, t, d, generator=g) * 10.0 ** torch.randint(-3, 3, (n, t, 1), generator=g)
    s = s.to(dtype).to(DEVICE)
    streams = s.transpose(0, 1) if strided else s.transpose(0, 1).contiguous()
    width = (n + 1) * d
    kv = torch.randn(t, width + (7 if strided else 0), generator=g).to(kv_dtype).to(DEVICE)
    # The views are taken on the device: a copy to it would make a column block contiguous.
    kv = kv[:, 3 : 3 + width] if strided else kv
    q = 1 + 0.5 * torch.randn(n, d, generator=g)
    k = 1 + 0.5 * torch.randn(n, d, generator=g)
    return streams, kv, q.to(DEVICE), k.to(DEVICE)


def _value(kv: torch.Tensor, n: int, d: int) -> torch.Tensor:
    return kv[:, n * d :].float()[:, None, :].cpu()


def _assert_close(got: torch.Tensor, want: torch.Tensor, value: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.cpu(), want.cpu()
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs()
    if want.dtype == torch.float32:
        bound = 1e-5 * value.abs() + 1e-6 * want.abs()
    else:
        # One unit in the last place (the subnormals' spacing near zero), plus the gate's error
        # times the value where the add cancels and leaves that error above half an ulp.
        fi = torch.finfo(want.dtype)
        larger = torch.maximum(got.float().abs(), want.float().abs())
        bound = fi.eps * larger + fi.eps * fi.smallest_normal + 1e-5 * value.abs()
        assert (got == want).float().mean().item() >= 0.99
    worst = (err - bound).max().item()
    assert worst <= 0, f"exceeds the tolerance by {worst}"


@pytest.mark.parametrize(
    ("t", "n", "d"),
    [(1, 1, 100), (3, 2, 257), (40, 4, 64), (7, 3, 1000), (5, 4, 1024), (2, 4, 5120)],
)
@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("strided", [False, True])
def test_gate_matches_reference(t, n, d, dtype, kv_dtype, strided):
    streams, kv, q, k = _inputs(
        t, n, d, dtype, kv_dtype, seed=t * 1009 + n * 31 + d, strided=strided
    )
    if strided and t > 1:
        assert not kv.is_contiguous() and (n == 1 or not streams.is_contiguous())
    want = engram_gate_ref(streams.cpu(), kv.cpu(), q.cpu(), k.cpu(), EPS)
    out = torch.full((t, n, d), float("nan"), dtype=dtype, device=DEVICE)  # every element written
    got = engram_gate(streams, kv, q, k, EPS, out=out)
    assert got is out
    _assert_close(got, want, _value(kv, n, d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [1000, 5120])
def test_row_bits_do_not_depend_on_the_batch(dtype, d):
    """Each row of a 37-token call equals, bit for bit, the same row computed alone and inside a
    batch of 5 where it sits at another index."""
    n = 4
    streams, kv, q, k = _inputs(37, n, d, dtype, torch.bfloat16, seed=d)
    full = engram_gate(streams, kv, q, k, EPS)
    for r in (0, 1, 17, 36):
        alone = engram_gate(streams[r : r + 1], kv[r : r + 1], q, k, EPS)
        assert torch.equal(alone[0], full[r])
        lo = max(0, r - 2)
        five = engram_gate(streams[lo : lo + 5], kv[lo : lo + 5], q, k, EPS)
        assert torch.equal(five[r - lo], full[r])


def test_zero_dot_gates_at_the_positive_floor():
    """q_weight 0, positive streams and weights k, negative keys: every product is -0.0. Torch's
    sum of them is +0, so the gate is sigmoid(+sqrt(floor)), not sigmoid(-sqrt(floor)); the
    kernel's too, whatever sign its tree leaves on the zero (the interpreter's numpy sum gives
    +0, a compiled tree of -0.0 gives -0.0)."""
    t, n, d = 3, 2, 64  # a power of two: no masked lane adds a +0
    streams, kv, _, k = _inputs(t, n, d, torch.float32, torch.float32, seed=5)
    streams = streams.abs() + 0.5
    kv[:, : n * d] = -(kv[:, : n * d].abs() + 0.5)
    q = torch.zeros(n, d, device=DEVICE)
    k = k.abs() + 0.5
    got = engram_gate(streams, kv, q, k, EPS).cpu()
    gate = torch.sigmoid(torch.tensor(1e-3))
    value = _value(kv, n, d)
    torch.testing.assert_close(got, streams.cpu() + gate * value, rtol=1e-6, atol=1e-6)
    _assert_close(got, engram_gate_ref(streams.cpu(), kv.cpu(), q.cpu(), k.cpu(), EPS), value)


def test_nan_key_propagates_to_its_stream():
    t, n, d = 2, 3, 100
    streams, kv, q, k = _inputs(t, n, d, torch.float32, torch.float32, seed=11)
    kv[1, d + 7] = float("nan")  # token 1, stream 1's key
    got = engram_gate(streams, kv, q, k, EPS).cpu()
    want = engram_gate_ref(streams.cpu(), kv.cpu(), q.cpu(), k.cpu(), EPS)
    assert torch.isnan(got[1, 1]).all() and torch.isnan(want[1, 1]).all()
    nan = torch.zeros(t, n, dtype=torch.bool)
    nan[1, 1] = True
    _assert_close(got[~nan], want[~nan], _value(kv, n, d).expand(t, n, d)[~nan])


def test_empty_batch():
    streams, kv, q, k = _inputs(1, 2, 16, torch.bfloat16, torch.bfloat16, seed=1)
    got = engram_gate(streams[:0], kv[:0], q, k, EPS)
    assert got.shape == (0, 2, 16) and got.dtype == torch.bfloat16


def test_bad_arguments_name_the_field():
    streams, kv, q, k = _inputs(3, 2, 16, torch.bfloat16, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="streams"):
        engram_gate(streams[0], kv, q, k, EPS)
    with pytest.raises(ValueError, match="streams"):
        engram_gate(streams.int(), kv, q, k, EPS)
    with pytest.raises(ValueError, match="streams"):
        engram_gate(torch.ones(1, 1, MAX_D + 1), torch.ones(1, 2 * (MAX_D + 1)), q, k, EPS)
    with pytest.raises(ValueError, match="kv"):
        engram_gate(streams, kv[:, :-1], q, k, EPS)
    with pytest.raises(ValueError, match="q_weight"):
        engram_gate(streams, kv, q[:1], k, EPS)
    with pytest.raises(ValueError, match="k_weight"):
        engram_gate(streams, kv, q, k[:, :15], EPS)
    with pytest.raises(ValueError, match="out"):
        engram_gate(streams, kv, q, k, EPS, out=torch.empty(3, 2, 16, device=DEVICE))
