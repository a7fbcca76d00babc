"""Engram's embedding gather in one launch (`engram_gather_ref` is the spec): the K hashed
n-gram ids of every token, read in place from a 2-D tensor of any strides (a column slice, a
transposed view: no reshape copy), each selecting one table row, written side by side into the
`[T, K * E]` input of the Engram's projection.

The table is either plain (the rows are copied) or kept as released (FP8 E4M3 rows with one
E8M0 exponent byte per `group` channels, `QuantizedWeight`), in which case only the gathered
rows are decoded: the table never exists dequantised, on the device or anywhere else. Either
table may live in the device's memory or in page-locked host memory, which the kernel reads
over the bus through unified addressing (a decode step reads a few KB of it per token).

Exactness: bit-exact against the reference on every backend. A plain gather is a copy; a
decoded row is exact (E4M3 through fp16's bits, the exponent byte straight into fp32's
exponent field) and then rounded once to the output dtype, as `dequantize_weight_ref` rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import INDEX_DTYPES, require
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    programmatic_launch,
    round_to_dtype,
    wait_for_producers,
)
from sgl_dspark.kernels.linear.dequant import e8m0_to_fp32
from sgl_dspark.kernels.linear.reference import QuantizedWeight, check_quantized_weight
from sgl_dspark.kernels.quant.load import e4m3_to_fp32


@triton.jit
def _engram_gather_kernel(
    table_ptr,
    table_row_stride,
    scale_ptr,
    scale_row_stride,
    ids_ptr,
    ids_stride_t,
    ids_stride_k,
    out_ptr,
    K,
    E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    OUT_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the ids come from the hashing kernels before this one
    t = tl.program_id(0).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    ids = tl.load(ids_ptr + t * ids_stride_t + offs_k * ids_stride_k, mask=mask_k, other=0)
    row = ids.to(tl.int64)[:, None]
    offs_e = tl.arange(0, BLOCK_E)
    mask = mask_k[:, None] & (offs_e < E)[None, :]
    values = tl.load(table_ptr + row * table_row_stride + offs_e[None, :], mask=mask, other=0)
    if FP8:  # E4M3 codes (read as bytes) times their group's power of two, rounded once
        e = tl.load(
            scale_ptr + row * scale_row_stride + (offs_e // GROUP)[None, :], mask=mask, other=127
        )
        values = round_to_dtype(e4m3_to_fp32(values) * e8m0_to_fp32(e), OUT_KIND, ON_BITS)
    tl.store(out_ptr + t * K * E + offs_k[:, None] * E + offs_e[None, :], values, mask=mask)


def engram_gather(
    table: torch.Tensor | QuantizedWeight,
    ids: torch.Tensor,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`engram_gather_ref` in one launch, no host sync.

    Args:
        table: [V, E] with unit stride in E, or an FP8 `QuantizedWeight` [V, E] with one scale
            row per row (`block_rows` 1); on the device or in page-locked host memory.
        ids: [T, K] int32/int64 on the device, any strides, values in [0, V) (not checked on
            the device).
        dtype: the output dtype: for a plain table its own (the default; another is refused,
            never converted), for a quantised table fp32/bf16/fp16 (default bf16).
        out: optional [T, K * E] contiguous output on the ids' device.
    """
    quantized = isinstance(table, QuantizedWeight)
    data = table.data if isinstance(table, QuantizedWeight) else table
    require(data.dim() == 2, f"table: expected [V, E], got shape {tuple(data.shape)}")
    require(data.stride(1) == 1 or data.shape[1] == 1, "table: needs unit stride in E")
    require(
        ids.dim() == 2 and ids.dtype in INDEX_DTYPES,
        f"ids: expected int32/int64 [T, K], got {ids.dtype} {tuple(ids.shape)}",
    )
    _check_table_device(data, ids)
    if isinstance(table, QuantizedWeight):
        check_quantized_weight(table, "table")
        require(
            table.fmt == "fp8" and table.block_rows == 1,
            f"table: a quantised table must be FP8 with one scale row per row, got "
            f"{table.fmt} with {table.block_rows} rows per scale",
        )
        require(table.scale.stride(1) == 1, "table: its scales need unit stride")
        out_dtype = dtype or torch.bfloat16
        require(out_dtype in DTYPE_KIND, f"dtype: expected fp32/bf16/fp16, got {out_dtype}")
        scale, group, stored = table.scale, table.group, data.view(torch.uint8)
    else:
        out_dtype = dtype or data.dtype
        require(
            out_dtype == data.dtype,
            f"dtype: a plain table is copied in its own dtype {data.dtype}, got {out_dtype}",
        )
        scale, group, stored = data, 1, data
    t, k = ids.shape
    e = data.shape[1]
    if out is None:
        out = torch.empty(t, k * e, dtype=out_dtype, device=ids.device)
    require(
        tuple(out.shape) == (t, k * e) and out.dtype == out_dtype and out.is_contiguous(),
        f"out: expected contiguous {out_dtype} [{t}, {k * e}], got {out.dtype} {tuple(out.shape)}",
    )
    require(out.device == ids.device, f"out: expected device {ids.device}, got {out.device}")
    if t == 0 or k == 0:
        return out
    block_e = triton.next_power_of_2(e)
    block_k = max(1, min(triton.next_power_of_2(k), 4096 // block_e))
    _engram_gather_kernel[(t, triton.cdiv(k, block_k))](
        stored,
        stored.stride(0),
        scale,
        scale.stride(0),
        ids,
        ids.stride(0),
        ids.stride(1),
        out,
        k,
        E=e,
        BLOCK_K=block_k,
        BLOCK_E=block_e,
        FP8=quantized,
        GROUP=group,
        OUT_KIND=DTYPE_KIND[out_dtype],
        ON_BITS=interpreted(_engram_gather_kernel),
        num_warps=4,
        enable_fp_fusion=False,
        **programmatic_launch(_engram_gather_kernel, ids.device),
    )
    return out


def _check_table_device(data: torch.Tensor, ids: torch.Tensor) -> None:
    """The table is on the ids' device, or (for a GPU launch) in page-locked host memory that
    the device reads through unified addressing."""
    if data.device == ids.device:
        return
    require(
        data.device.type == "cpu" and ids.device.type != "cpu" and data.is_pinned(),
        f"table: expected device {ids.device} or page-locked host memory, got {data.device}"
        + (" (not page-locked)" if data.device.type == "cpu" else ""),
    )


__all__ = ["engram_gather"]
