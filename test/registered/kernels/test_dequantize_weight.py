"""The one-pass dequantisation of a weight kept as stored (`kernels/linear/dequantize.py`): bit
for bit `dequantize_weight_ref`, on random stored codes (every code, scales over a wide range)
and on weights quantised from random floats by the checkpoint quantisers, in every output dtype;
shapes with partial column blocks, partial K steps and scale blocks, K not a multiple of 32
(MXFP4 rows read byte by byte), and views of a fused weight's rows. Outputs are compared whole,
so a cell the kernel failed to write (torch.empty's contents) fails the test."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.linear.dequantize import dequantize_weight
from sgl_dspark.kernels.linear.reference import QuantizedWeight, dequantize_weight_ref
from sgl_dspark.srt.layers.quantized import row_slice
from test_moe_grouped_gemm import pytestmark  # noqa: F401
from test_quantized_gemm import DEVICE, quantized, random_stored

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (format, scale block, N, K): FP8 with V4's 128 x 128 and V4.1's 32 x 32 blocks, MXFP4 groups
# of 32; N and K around the kernel's 32-row blocks and 256-channel steps.
CASES = [
    ("fp8", 128, 256, 512),
    ("fp8", 128, 200, 300),
    ("fp8", 32, 96, 1000),
    ("fp8", 32, 33, 70),
    ("fp8", 128, 1, 7),
    ("mxfp4", 32, 64, 512),
    ("mxfp4", 32, 70, 320),
    ("mxfp4", 32, 17, 96),
    ("mxfp4", 32, 40, 50),  # K not a multiple of 32: rows read byte by byte
    ("mxfp4", 32, 3, 2),
]


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.is_contiguous()
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} values differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_random_codes_dequantise_to_the_reference(case: tuple, dtype: torch.dtype) -> None:
    fmt, block, n, k = case
    g = torch.Generator().manual_seed(CASES.index(case) * 7 + DTYPES.index(dtype))
    # MXFP4 scale bytes up to the loader's limit; FP8 over a wide range (products stay normal
    # in fp32, and fp16 outputs overflow or go subnormal as the reference's rounding does).
    lo, hi = (100, 128) if fmt == "mxfp4" else (90, 150)
    w = random_stored(fmt, block, n, k, g, lo, hi)
    _bits_equal(dequantize_weight(w, dtype), dequantize_weight_ref(w, dtype))


@pytest.mark.parametrize("case", CASES[:3] + CASES[5:8], ids=lambda c: "-".join(map(str, c)))
def test_checkpoint_quantised_weights_dequantise_to_the_reference(case: tuple) -> None:
    fmt, block, n, k = case
    g = torch.Generator().manual_seed(100 + CASES.index(case))
    w = quantized(torch.randn(n, k, generator=g) * 0.05, fmt, block)
    _bits_equal(dequantize_weight(w, torch.bfloat16), dequantize_weight_ref(w, torch.bfloat16))


@pytest.mark.parametrize("fmt", ("fp8", "mxfp4"))
def test_rows_of_a_fused_weight(fmt: str) -> None:
    """A member's rows of a fused weight (a view starting mid-tensor, with its scale rows) read
    as the member's own weight."""
    g = torch.Generator().manual_seed(5)
    block = 32
    w = quantized(torch.randn(192, 256, generator=g), fmt, block)
    part = row_slice(w, 64, 160)
    assert part.data.storage_offset() > 0
    _bits_equal(dequantize_weight(part, torch.float32), dequantize_weight_ref(part, torch.float32))


def test_bad_inputs_are_refused_by_name() -> None:
    g = torch.Generator().manual_seed(9)
    w = random_stored("fp8", 128, 4, 8, g, 120, 130)
    with pytest.raises(ValueError, match="dtype"):
        dequantize_weight(w, torch.int32)
    stacked = QuantizedWeight(w.data[None], w.scale[None], w.fmt, w.group, w.block_rows)
    with pytest.raises(ValueError, match="2-D"):
        dequantize_weight(stacked, torch.bfloat16)


def test_runs_on_the_device_of_the_weight() -> None:
    g = torch.Generator().manual_seed(11)
    w = random_stored("mxfp4", 32, 8, 64, g, 110, 128)
    assert dequantize_weight(w, torch.bfloat16).device.type == DEVICE.split(":")[0]
