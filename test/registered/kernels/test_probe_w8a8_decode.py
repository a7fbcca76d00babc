"""`benchmark/kernels/probe_w8a8_decode.py`: the W8A8 decode linear with the weight's rows on the
warpgroup MMA's 64-row side, on the CPU interpreter (which widens the E4M3 codes to fp32, exactly,
for its dot), against `w8a8_linear_ref` on the same activation codes, on fresh random weights
(FP8 32 x 32) and activations: one and several tokens (up to the kernel's 16), columns past a
tile, K split over programs (a split count that does not divide the steps, so the last split is
short and fewer splits run than asked) with the library's ordered reduce, outputs poisoned with
NaN first. The GPU runs the probe itself, which checks every variant the same way before timing
it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from sgl_dspark.kernels.fp8.reference import quantize_act_fp8_ref, w8a8_linear_ref  # noqa: E402

from benchmark.kernels import bench_quant_gemm as bq  # noqa: E402
from benchmark.kernels import probe_w8a8_decode  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0"),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="the interpreter form; GPUs run the probe"
    ),
]


@pytest.mark.parametrize(
    "m, n, k, bn, chunks, splits",
    [
        (1, 72, 512, 64, 4, 1),
        (3, 100, 768, 64, 2, 4),
        (16, 64, 384, 64, 4, 2),
        (5, 136, 256, 128, 1, 3),
    ],
)
def test_w8a8_wgmma_linear_matches_the_w8a8_reference(
    monkeypatch, m: int, n: int, k: int, bn: int, chunks: int, splits: int
) -> None:
    monkeypatch.setattr(bq.SETUP, "device", "cpu")
    gen = torch.Generator().manual_seed(n * k + m)
    weight = bq.quantize_random((n, k), "fp8", 32, gen)
    act = quantize_act_fp8_ref(torch.randn(m, k, generator=gen).to(torch.bfloat16), 32, True)
    want = w8a8_linear_ref(act, weight, 32, torch.float32)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    got = probe_w8a8_decode.w8a8_wgmma_linear(act, weight, bn, chunks, splits, 2, out=out)
    assert got.data_ptr() == out.data_ptr() and got.isfinite().all()
    # The reference's fp32 sums in another order (per split, then the splits in order), then
    # one bf16 rounding: within 2^-7 of the largest.
    rel = (got.float() - want).abs().max() / want.abs().max()
    assert rel < 2**-7, rel


def test_w8a8_wgmma_linear_refuses_what_it_cannot_run(monkeypatch) -> None:
    monkeypatch.setattr(bq.SETUP, "device", "cpu")
    gen = torch.Generator().manual_seed(3)
    weight = bq.quantize_random((64, 200), "fp8", 32, gen)
    act = quantize_act_fp8_ref(torch.randn(1, 200, generator=gen).to(torch.bfloat16), 32, True)
    with pytest.raises(ValueError, match="multiple of the step"):
        probe_w8a8_decode.w8a8_wgmma_linear(act, weight, 64, 4)
