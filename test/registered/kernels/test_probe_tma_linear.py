"""`benchmark/kernels/probe_tma_linear.py`: the quantised linear with its tiles loaded through
tensor descriptors, on the CPU interpreter (which runs descriptor loads), against
dequantise-then-reference and against the library's `quantized_linear` bit for bit at the
library's launch shape, on fresh random weights: FP8 32 x 32 and MXFP4, K not a multiple of the
K step (the descriptor zero-fills the channels past K, the scale loads are bounded), columns
past a block, rows past M, outputs poisoned with NaN first. The GPU runs the probe itself, which
checks every variant the same way before timing it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from sgl_dspark.kernels.linear.quantized import quantized_linear  # noqa: E402
from sgl_dspark.kernels.linear.reference import dequantize_weight_ref  # noqa: E402

from benchmark.kernels import bench_quant_gemm as bq  # noqa: E402
from benchmark.kernels import probe_tma_linear  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0"),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="the interpreter form; GPUs run the probe"
    ),
]


@pytest.mark.parametrize(
    "fmt, m, n, k, overrides",
    [
        ("fp8", 1, 40, 1024, {}),
        ("fp8", 3, 24, 1184, {}),
        ("fp8", 2, 48, 1056, {"block_n": 32}),
        ("mxfp4", 1, 72, 1088, {}),
        ("mxfp4", 5, 40, 1024, {"stages": 2}),
    ],
)
def test_tma_linear_matches_reference_and_library_bits(
    monkeypatch, fmt: str, m: int, n: int, k: int, overrides: dict
) -> None:
    monkeypatch.setattr(bq.SETUP, "device", "cpu")
    gen = torch.Generator().manual_seed(n * k + m)
    weight = bq.quantize_random((n, k), fmt, 32, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    want = x.float() @ dequantize_weight_ref(weight, torch.float32).T
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    got = probe_tma_linear.tma_linear(x, weight, out=out, **overrides)
    assert got.data_ptr() == out.data_ptr() and got.isfinite().all()
    # One bf16 rounding of the output (the interpreter truncates), within 2^-7 of the largest.
    rel = (got.float() - want).abs().max() / want.abs().max()
    assert rel < 2**-7, rel
    # The library's K step and slices: the library's sums in the library's order.
    assert torch.equal(got, quantized_linear(x, weight))
