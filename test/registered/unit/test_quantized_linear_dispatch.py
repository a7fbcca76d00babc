"""Where the "linear" family sends a weight kept as stored (`layers/fused_linear.py`), by rows:
decode sizes and up to `_QUANTIZED_KERNEL_MAX_M` rows (a DSpark verify, decode at 32 in flight)
through the dequantising kernel, each row with the bits of a call of its own; more rows through
the weight dequantised once per call and the BLAS, bit for bit `F.linear` on the reference's
dequantised weight; the grouped projection alike; `--enable-deterministic-inference` through the
kernel at every size. Random inputs; each side's output computed independently."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.linear.quantized import quantized_grouped_linear, quantized_linear
from sgl_dspark.kernels.linear.reference import QuantizedWeight, dequantize_weight_ref
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.fused_linear import (
    _QUANTIZED_KERNEL_MAX_M,
    grouped_linear_impl,
    linear_impl,
)
from sgl_dspark.srt.model_loader.quantization import (
    fp8_block_to_runtime,
    mxfp4_to_runtime,
    quantize_fp8_block,
    quantize_mxfp4,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = KernelChoice("triton")


def _quantized(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    if fmt == "fp8":
        qw = fp8_block_to_runtime(*quantize_fp8_block(w, (32, 32)), (32, 32))
    else:
        qw = mxfp4_to_runtime(*quantize_mxfp4(w, 32), 32)
    return qw._replace(data=qw.data.to(DEVICE), scale=qw.scale.to(DEVICE))


@pytest.mark.parametrize("fmt", ("fp8", "mxfp4"))
def test_linear_rows_choose_kernel_or_one_dequantisation(fmt: str) -> None:
    gen = torch.Generator().manual_seed(3 if fmt == "fp8" else 4)
    w = _quantized(torch.randn(48, 96, generator=gen) * 0.1, fmt)
    lin = linear_impl(TRITON)
    one_row = torch.randn(1, 96, generator=gen).to(DEVICE)
    for rows in (17, 40, _QUANTIZED_KERNEL_MAX_M):
        x = torch.randn(rows, 96, generator=gen).to(DEVICE)
        x[5] = one_row[0]
        got = lin(x, w)
        assert torch.equal(got, quantized_linear(x, w))
        # A row's bits are those of a call of its own, at any of these sizes.
        assert torch.equal(got[5], lin(one_row, w)[0])
    x3 = torch.randn(3, 11, 96, generator=gen).to(DEVICE)  # 33 rows in a 3-D input
    assert torch.equal(lin(x3, w), quantized_linear(x3.reshape(33, 96), w).view(3, 11, 48))
    dense = dequantize_weight_ref(w, torch.float32)
    for shape in ((_QUANTIZED_KERNEL_MAX_M + 1, 96), (5, 20, 96)):
        x = torch.randn(*shape, generator=gen).to(DEVICE)
        assert torch.equal(lin(x, w), torch.nn.functional.linear(x, dense))


def test_grouped_linear_rows_choose_kernel_or_one_dequantisation() -> None:
    gen = torch.Generator().manual_seed(6)
    groups, n, k = 4, 32, 64
    w = _quantized(torch.randn(groups * n, k, generator=gen) * 0.1, "fp8")
    grouped = grouped_linear_impl(TRITON)
    x = torch.randn(_QUANTIZED_KERNEL_MAX_M, groups, k, generator=gen).to(DEVICE)
    assert torch.equal(grouped(x, w), quantized_grouped_linear(x, w))
    x = torch.randn(_QUANTIZED_KERNEL_MAX_M + 7, groups, k, generator=gen).to(DEVICE)
    dense = dequantize_weight_ref(w, torch.float32).view(groups, n, k)
    assert torch.equal(grouped(x, w), torch.einsum("mgk,gnk->mgn", x, dense))


def test_deterministic_mode_keeps_every_size_in_the_kernel() -> None:
    gen = torch.Generator().manual_seed(7)
    w = _quantized(torch.randn(40, 64, generator=gen) * 0.1, "fp8")
    lin = linear_impl(KernelChoice("triton", batch_invariant=True))
    x = torch.randn(2 * _QUANTIZED_KERNEL_MAX_M, 64, generator=gen).to(DEVICE)
    got = lin(x, w)
    assert torch.equal(got, quantized_linear(x, w))
    assert torch.equal(got[100], lin(x[100:101], w)[0])
