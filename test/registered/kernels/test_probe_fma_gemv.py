"""`benchmark/kernels/probe_fma_gemv.py`: the arithmetic its Gluon FMA kernels share (each
16-byte weight piece multiplied on the FMA units and summed in the thread, the sum scaled by its
block's power of two), in its plain-Triton form on the CPU interpreter, against
dequantise-then-reference on fresh random weights: ragged K (a partial step and a partial scale
group), columns past a block, several rows. The Gluon kernels themselves do not run in the
interpreter; the probe checks each of them against the same reference on the GPU before timing
it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from sgl_dspark.kernels.linear.reference import dequantize_weight_ref  # noqa: E402

from benchmark.kernels import bench_quant_gemm as bq  # noqa: E402
from benchmark.kernels import probe_fma_gemv  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0"),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="the interpreter form; GPUs run the probe"
    ),
]


@pytest.mark.parametrize("m, n, k, prefetch", [(1, 37, 200, False), (3, 40, 136, True)])
def test_fma_kernel_matches_dequantised_reference(
    monkeypatch, m: int, n: int, k: int, prefetch: bool
) -> None:
    monkeypatch.setattr(bq.SETUP, "device", "cpu")
    gen = torch.Generator().manual_seed(n * k + m)
    weight = bq.quantize_random((n, k), "fp8", 32, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    want = x.float() @ dequantize_weight_ref(weight, torch.float32).T
    got = probe_fma_gemv.fma_linear(x, weight, 8, 4, 2, prefetch).float()
    assert got.shape == (m, n) and got.isfinite().all()
    # Every cell against the reference (a cell left unwritten would hold whatever the
    # allocation held): one bf16 rounding of the output (the interpreter truncates), within
    # 2^-7 of the largest.
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 2**-7, rel
