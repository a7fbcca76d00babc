"""A weight kept as stored (`QuantizedWeight`), dequantised in one pass: for the GEMMs too
large for the in-kernel dequantisation (prefill-sized inputs), which then multiply in the BLAS.

`dequantize_weight_ref` is the spec; it builds fp32 values and fp32 multipliers of the whole
weight before the product, so its memory traffic is some 30 times the stored FP8 bytes. This
kernel reads each stored byte and scale once and writes the dequantised weight once, through
the tile decoder the FP8 GEMMs use (`dequant.py::quantized_tile`, fp32; for MXFP4 it puts the
channels in order, which the GEMMs' two-dot decode does not need).

Exactness: bit for bit `dequantize_weight_ref`: both form the exact fp32 product of a stored
value and its power-of-two scale and round it once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import FLOAT_DTYPES, require
from sgl_dspark.kernels.linear.dequant import (
    quantized_scales,
    quantized_tile,
)
from sgl_dspark.kernels.linear.reference import QuantizedWeight, check_quantized_weight
from sgl_dspark.kernels.linear.weight_loads import (
    quantized_block_k,
    stored_rows,
)

_BLOCK_N = 32


@triton.jit
def _dequantize_kernel(
    w_ptr,
    s_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_yn,
    FP4: tl.constexpr,
    WORDS: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (column block, K step): BLOCK_N rows x BLOCK_K channels of the weight.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    e = quantized_scales(s_ptr + (rows // SCALE_ROWS) * stride_sn, n_ok, k0, K, GROUP, BLOCK_K)
    v = quantized_tile(
        w_ptr + rows * stride_wn, n_ok, e, k0, K, FP4, WORDS, GROUP, BLOCK_N, BLOCK_K, True
    )
    ks = k0 + tl.arange(0, BLOCK_K)
    tl.store(
        y_ptr + rows[:, None] * stride_yn + ks[None, :],
        v.to(y_ptr.dtype.element_ty),
        mask=n_ok[:, None] & (ks < K)[None, :],
    )


def dequantize_weight(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_weight_ref(weight, dtype)` in one launch (graph-safe).

    Args:
        weight: `QuantizedWeight` [N, K] ("fp8" or "mxfp4").
        dtype: bf16 / fp16 / fp32.
    Returns:
        [N, K] contiguous in `dtype`.
    """
    check_quantized_weight(weight)
    require(weight.data.dim() == 2, f"weight must be 2-D, got {tuple(weight.data.shape)}")
    require(dtype in FLOAT_DTYPES, f"dtype must be bf16/fp16/fp32, got {dtype}")
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.data.device)
    if n == 0 or k == 0:
        return out
    data, words = stored_rows(weight)
    block_k = quantized_block_k(weight.fmt, k)
    grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](
        data,
        weight.scale,
        out,
        n,
        k,
        data.stride(0),
        weight.scale.stride(0),
        out.stride(0),
        FP4=weight.fmt == "mxfp4",
        WORDS=words,
        GROUP=weight.group,
        SCALE_ROWS=weight.block_rows,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


__all__ = ["dequantize_weight"]
