"""A single-pass mHC boundary's coefficients launched apart (`coeffs_scope`), and the model
boundaries' side stream that runs them beside the next sublayer while a CUDA graph is captured
(`srt/layers/mhc.py::CoefficientStream`).

The programs are the ones of the usual phase-B launch, only split over two launches, so every
output must keep its bits: compared bit for bit against the usual launch (itself checked against
the reference in test_mhc.py), in the Triton interpreter and, on a GPU, on a real side stream and
inside a captured graph replayed on fresh inputs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from sgl_dspark.kernels.fp8.reference import Fp8ActFormat
from sgl_dspark.kernels.mhc import post_combine as mhc_module
from sgl_dspark.kernels.mhc.post_combine import mhc_post_combine, mhc_pre
from sgl_dspark.kernels.norm.reference import rms_norm_ref
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.mhc import (
    CoefficientStream,
    HyperConnection,
    hc_boundary_impl,
    run_single_pass_layers,
)
from sgl_dspark.srt.layers.norm import RMSNorm
from test_mhc import _KW, DEVICE, _make_inputs, _poisoned_out, _prev_pre

_OUTPUTS = ("streams", "pre", "post", "comb", "x_in", "x_normed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _same_bits(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def _side_stream_scope() -> tuple[contextlib.AbstractContextManager, torch.cuda.Stream]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(side), side


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
        scopes.append(lambda: _side_stream_scope()[0])
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


def test_coefficient_stream_stays_on_the_current_stream_off_capture() -> None:
    """Off CUDA, and eagerly on CUDA, no scope: the boundary launches as usual; joining with
    nothing forked is a no-op."""
    side = CoefficientStream()
    assert side.scope(torch.device("cpu")) is None
    side.join()
    if DEVICE == "cuda":
        assert side.scope(torch.device(DEVICE, torch.cuda.current_device())) is None
        side.join()


class _Layer(torch.nn.Module):
    """Both mixers and norms of a layer, random; its sublayers are x -> tanh(x @ w)."""

    def __init__(self, n: int, d: int, gen: torch.Generator) -> None:
        super().__init__()
        args = (n, d, 20, 1e-6, 1e-6)
        self.attn_hc, self.ffn_hc = HyperConnection(*args), HyperConnection(*args)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
        for p in self.parameters():
            p.data = (
                1 + 0.2 * torch.randn(p.shape, generator=gen)
                if p.dim() < 2
                else 0.05 * torch.randn(p.shape, generator=gen)
            )
        self.w = torch.nn.Parameter(0.3 * torch.randn(d, d, generator=gen))


@needs_cuda
def test_single_pass_layers_in_a_captured_graph_fork_and_join_the_coefficients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three single-pass layers captured in a CUDA graph (every single-pass boundary's
    coefficients forked to the side stream, joined by the next boundary) replay the eager run's
    bits, on the captured inputs and on new ones copied in."""
    forks: list[bool] = []
    fork = CoefficientStream._fork

    def counted(self: CoefficientStream):
        forks.append(torch.cuda.is_current_stream_capturing())
        return fork(self)

    monkeypatch.setattr(CoefficientStream, "_fork", counted)
    gen = torch.Generator().manual_seed(9)
    n, d, rows = 4, 256, 3
    layers = [_Layer(n, d, gen).to(DEVICE) for _ in range(3)]
    norm = RMSNorm(d, 1e-6).to(DEVICE)
    boundary = hc_boundary_impl(KernelChoice(backend="triton"))
    assert boundary is not None

    def forward(streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return run_single_pass_layers(
            streams,
            layers,
            lambda i, x: torch.tanh(x @ layers[i].w),
            lambda i, x: torch.tanh(x @ layers[i].w.t()),
            boundary,
            (norm, rms_norm_ref),
        )

    static_in = torch.randn(rows, n, d, generator=gen).to(DEVICE)
    inputs = [static_in.clone(), torch.randn(rows, n, d, generator=gen).to(DEVICE)]
    with torch.no_grad():
        eager = [forward(x) for x in inputs]  # also warms up (the side stream is made here)
        assert forks == []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = forward(static_in)
        # The opening site and the five boundaries after it (the last one computes none).
        assert forks == [True] * 6
        for x, want in zip(inputs, eager):
            static_in.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            for got, ref, name in zip(static_out, want, ("y", "y_normed")):
                _same_bits(got, ref, name)
    assert not torch.equal(eager[0][0], eager[1][0])
