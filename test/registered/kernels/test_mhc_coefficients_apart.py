"""A single-pass mHC boundary's coefficients launched apart (`coeffs_scope`; the model
boundaries' side stream that runs them while a CUDA graph is captured is tested with the other
boundary dispatch, in unit/test_kernel_dispatch.py).

The programs are the ones of the usual phase-B launch, only split over two launches, so every
output must keep its bits: compared bit for bit against the usual launch (itself checked against
the reference in test_mhc.py), in the Triton interpreter and, on a GPU, on a real side stream.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from sgl_dspark.kernels.fp8.reference import Fp8ActFormat
from sgl_dspark.kernels.mhc import post_combine as mhc_module
from sgl_dspark.kernels.mhc.post_combine import mhc_post_combine, mhc_pre
from test_mhc import _KW, DEVICE, _make_inputs, _poisoned_out, _prev_pre

_OUTPUTS = ("streams", "pre", "post", "comb", "x_in", "x_normed")


def _same_bits(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def _side_stream_scope(_partials: torch.Tensor) -> contextlib.AbstractContextManager:
    """A scope on a side stream forked from the current one (the test synchronises before it
    reads anything, or lets the partials go)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(side)


@pytest.mark.parametrize(
    "m,n,d,opening,fp8,norm_block",
    [
        (1, 4, 96, False, False, None),
        (3, 4, 100, False, True, 32),  # four norm chunks, the last one partial
        (2, 3, 160, True, False, 64),
        (5, 4, 256, True, True, None),
    ],
)
def test_coefficients_apart_keep_every_bit(
    m: int,
    n: int,
    d: int,
    opening: bool,
    fp8: bool,
    norm_block: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Closing (`mhc_post_combine`) and opening (`mhc_pre`) boundaries, with and without the
    FP8 form of the normed input: the coefficients in a launch of their own give the outputs of
    the usual launch bit for bit (poisoned outputs: every value is written)."""
    if norm_block is not None:
        monkeypatch.setattr(mhc_module, "_NORM_BLOCK", norm_block)
    inp = _make_inputs(m, n, d, torch.bfloat16, seed=11 * m + d)
    inp["collapse_pre"] = _prev_pre(m, n, seed=d + n)
    fmt = Fp8ActFormat(32, True) if fp8 else None

    def run(scope) -> mhc_module.MhcPostCombineOutput:
        kwargs = dict(sinkhorn_iters=7, **_KW, fp8_out=fmt, coeffs_scope=scope)
        if opening:
            heads = ("fn", "base", "scale", "norm_weight", "collapse_pre")
            return mhc_pre(inp["streams"], **{k: inp[k] for k in heads}, **kwargs)
        return mhc_post_combine(**inp, out=_poisoned_out(m, n, d, torch.bfloat16), **kwargs)

    usual = run(None)
    scopes = [contextlib.nullcontext]
    if DEVICE == "cuda":
        scopes.append(_side_stream_scope)
    for scope in scopes:
        apart = run(scope)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        for name in _OUTPUTS:
            _same_bits(getattr(apart, name), getattr(usual, name), name)
        assert not torch.isnan(apart.comb).any() and not torch.isnan(apart.x_normed).any()
        if fp8:
            assert apart.x_fp8 is not None and usual.x_fp8 is not None
            _same_bits(apart.x_fp8.q, usual.x_fp8.q, "x_fp8.q")
            _same_bits(apart.x_fp8.scale, usual.x_fp8.scale, "x_fp8.scale")


def test_coefficients_apart_need_a_single_pass_boundary() -> None:
    """A two-pass boundary collapses with its own pre', which the norm needs: no scope."""
    inp = _make_inputs(2, 4, 64, torch.float32, seed=3)
    with pytest.raises(ValueError, match="coeffs_scope"):
        mhc_post_combine(**inp, sinkhorn_iters=3, **_KW, coeffs_scope=contextlib.nullcontext)
