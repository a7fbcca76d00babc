"""A single-pass mHC boundary of few rows normed in phase A (`arrivals` of the launchers: the
last of a row's slice programs to arrive norms the row, `boundary_kernel._last_to_arrive`)
instead of by phase B's norm chunks.

The arithmetic is phase B's (the same sum of the slices' squares in slice order, the same
elementwise norm and FP8 groups), only run by another program, so every output must keep its
bits: compared bit for bit against the two-launch boundary (itself checked against the reference
in test_mhc.py), on poisoned outputs, for closing, opening and coefficient-free boundaries, with
and without the FP8 form; one launch fewer; the counters left zero for the next call; above
`NORM_IN_A_MAX_ROWS` rows the norm chunks run as before."""

from __future__ import annotations

import contextlib

import pytest
import torch
from sgl_dspark.kernels.fp8.reference import Fp8ActFormat
from sgl_dspark.kernels.mhc import post_combine as mhc_module
from sgl_dspark.kernels.mhc.post_combine import (
    mhc_post_collapse,
    mhc_post_combine,
    mhc_pre,
    norm_arrival_count,
)
from test_mhc import _KW, DEVICE, _make_inputs, _poisoned_out, _prev_pre

_OUTPUTS = ("streams", "pre", "post", "comb", "x_in", "x_normed")


def _same_bits(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


class _CountedKernel:
    """The boundary kernel with its launches counted (the launch itself unchanged)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _arrivals() -> torch.Tensor:
    return torch.zeros(8, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    "m,n,d,dtype,kind,fp8",
    [
        (1, 4, 96, torch.bfloat16, "close", False),
        (2, 4, 100, torch.bfloat16, "close", True),  # 2 slices, the last partial
        (3, 3, 160, torch.float32, "open", False),
        (4, 4, 256, torch.bfloat16, "open", True),
        (1, 4, 1100, torch.bfloat16, "close", False),  # 18 slices, two norm chunks of 1024
        (4, 2, 96, torch.float32, "collapse", False),  # no coefficients: phase A alone
        (6, 4, 96, torch.bfloat16, "close", True),  # above the row limit: the norm chunks
    ],
)
def test_norm_in_phase_a_keeps_every_bit(
    m: int,
    n: int,
    d: int,
    dtype: torch.dtype,
    kind: str,
    fp8: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inp = _make_inputs(m, n, d, dtype, seed=7 * m + d + n)
    inp["collapse_pre"] = _prev_pre(m, n, seed=d + 2 * n)
    fmt = Fp8ActFormat(32, True) if fp8 else None
    counted = _CountedKernel(mhc_module._mhc_post_combine_kernel)
    monkeypatch.setattr(mhc_module, "_mhc_post_combine_kernel", counted)

    def run(arrivals: torch.Tensor | None):
        counted.launches = 0
        if kind == "collapse":
            update = {k: inp[k] for k in ("streams", "y", "post", "comb", "collapse_pre")}
            return mhc_post_collapse(
                **update, norm_weight=inp["norm_weight"], rms_eps=1e-6, arrivals=arrivals
            )
        kwargs = dict(sinkhorn_iters=5, **_KW, fp8_out=fmt, arrivals=arrivals)
        if kind == "open":
            heads = ("fn", "base", "scale", "norm_weight", "collapse_pre")
            return mhc_pre(inp["streams"], **{k: inp[k] for k in heads}, **kwargs)
        return mhc_post_combine(**inp, out=_poisoned_out(m, n, d, dtype), **kwargs)

    usual = run(None)
    usual_launches = counted.launches
    arrivals = _arrivals()
    for _ in range(2):  # the counters left zero serve the next call
        fused = run(arrivals)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        # phase A, then the coefficients' program alone (none without coefficients)
        normed_in_a = 1 + int(kind != "collapse")
        fused_rows = m <= mhc_module.NORM_IN_A_MAX_ROWS
        assert counted.launches == (normed_in_a if fused_rows else usual_launches)
        assert torch.equal(arrivals, torch.zeros_like(arrivals))
        names = ("streams", "x_in", "x_normed") if kind == "collapse" else _OUTPUTS
        for name in names:
            _same_bits(getattr(fused, name), getattr(usual, name), name)
        assert not torch.isnan(fused.x_normed).any()
        if fp8:
            assert fused.x_fp8 is not None and usual.x_fp8 is not None
            _same_bits(fused.x_fp8.q, usual.x_fp8.q, "x_fp8.q")
            _same_bits(fused.x_fp8.scale, usual.x_fp8.scale, "x_fp8.scale")


def test_norm_in_phase_a_with_the_coefficients_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's boundaries in a graph capture: counters and the coefficients' launch in a
    scope together: phase A and the coefficients' launch, without the norm chunks' launch the
    scope would otherwise leave on the current stream; the scope still gets the partials the
    coefficients read, and the bits are the usual launch's."""
    m, n, d = 2, 4, 160
    inp = _make_inputs(m, n, d, torch.bfloat16, seed=5)
    inp["collapse_pre"] = _prev_pre(m, n, seed=6)
    scoped: list[torch.Tensor] = []
    counted = _CountedKernel(mhc_module._mhc_post_combine_kernel)
    monkeypatch.setattr(mhc_module, "_mhc_post_combine_kernel", counted)

    def scope(partials: torch.Tensor) -> contextlib.AbstractContextManager:
        scoped.append(partials)
        return contextlib.nullcontext()

    kwargs = dict(sinkhorn_iters=4, **_KW)
    usual = mhc_post_combine(**inp, **kwargs, coeffs_scope=scope)
    assert counted.launches == 3
    counted.launches = 0
    fused = mhc_post_combine(**inp, **kwargs, coeffs_scope=scope, arrivals=_arrivals())
    assert counted.launches == 2
    assert len(scoped) == 2 and scoped[1].shape[0] == m
    for name in _OUTPUTS:
        _same_bits(getattr(fused, name), getattr(usual, name), name)


def test_arrival_counters_are_checked() -> None:
    assert [norm_arrival_count(m) for m in (1, 4, 5, 64)] == [1, 4, 0, 0]
    inp = _make_inputs(3, 4, 96, torch.float32, seed=2)
    inp["collapse_pre"] = _prev_pre(3, 4, seed=3)
    too_few = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"arrivals must be contiguous int32 \[>= 3\]"):
        mhc_post_combine(**inp, sinkhorn_iters=2, **_KW, arrivals=too_few)
    with pytest.raises(ValueError, match="arrivals must be contiguous int32"):
        mhc_post_combine(**inp, sinkhorn_iters=2, **_KW, arrivals=_arrivals().float())
