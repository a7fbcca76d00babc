"""Engram's embedding gather in one launch (`engram_gather_ref` is the spec): the K hashed
n-gram ids of every token, read in place from a 2-D tensor of any strides (a column slice, a
transposed view: no reshape copy), each selecting one table row, written side by side into the
`[T, K * E]` input of the Engram's projection. `engram_gather_hashed` hashes the ids itself
from the compressed n-gram history (`EngramHash`'s integer arithmetic: one launch instead of the
hashing's chain of torch kernels and the rows tensor between).

The table is either plain (the rows are copied) or kept as released (FP8 E4M3 rows with one
E8M0 exponent byte per `group` channels, `QuantizedWeight`), in which case only the gathered
rows are decoded: the table never exists dequantised, on the device or anywhere else. Either
table may live in the device's memory or in page-locked host memory, which the kernel reads
over the bus through unified addressing (a decode step reads a few KB of it per token).

Exactness: bit-exact against the reference on every backend (the hashed rows are the same
integers: int64 products wrap as torch's, XOR in any order, a non-negative remainder as
torch.remainder's). A plain gather is a copy; a decoded row is exact (E4M3 through fp16's bits,
the exponent byte straight into fp32's exponent field) and then rounded once to the output
dtype, as `dequantize_weight_ref` rounds.
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
def _xor(a, b):
    return a ^ b


@triton.jit
def hashed_ngram_rows(
    compressed_ptr,
    multipliers_ptr,
    primes_ptr,
    offsets_ptr,
    t,
    offs_k,
    mask_k,
    N: tl.constexpr,
    HEADS: tl.constexpr,
    NP: tl.constexpr,
):
    """Table rows of ids k of token t (`EngramHash`'s hashing, exact): id k = (i - 1) * HEADS
    + h hashes the n-gram of order i + 1, the XOR of its compressed ids times their multipliers
    (int64, wrapping as torch's), modulo head h's prime (non-negative, as torch.remainder),
    plus the id's offset."""
    j = tl.arange(0, NP)
    compressed = tl.load(compressed_ptr + t * N + j, mask=j < N, other=0).to(tl.int64)
    products = compressed * tl.load(multipliers_ptr + j, mask=j < N, other=0)
    order = offs_k // HEADS + 1  # the last compressed id the n-gram mixes in
    mixed = tl.reduce(tl.where(j[None, :] <= order[:, None], products[None, :], 0), 1, _xor)
    prime = tl.load(primes_ptr + offs_k, mask=mask_k, other=1)
    rest = mixed % prime
    rest = tl.where(rest < 0, rest + prime, rest)
    return rest + tl.load(offsets_ptr + offs_k, mask=mask_k, other=0)


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
    multipliers_ptr,
    primes_ptr,
    offsets_ptr,
    E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    HASHED: tl.constexpr,
    NGRAM: tl.constexpr,
    NGRAM_P2: tl.constexpr,
    HEADS: tl.constexpr,
    OUT_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the ids (or the n-gram history) come from earlier kernels
    t = tl.program_id(0).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    if HASHED:  # ids_ptr: the compressed n-gram history [T, NGRAM], contiguous
        ids = hashed_ngram_rows(
            ids_ptr,
            multipliers_ptr,
            primes_ptr,
            offsets_ptr,
            t,
            offs_k,
            mask_k,
            NGRAM,
            HEADS,
            NGRAM_P2,
        )
    else:
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
    require(
        ids.dim() == 2 and ids.dtype in INDEX_DTYPES,
        f"ids: expected int32/int64 [T, K], got {ids.dtype} {tuple(ids.shape)}",
    )
    t, k = ids.shape
    return _launch(table, ids, (ids.stride(0), ids.stride(1)), t, k, dtype, out, None)


def engram_gather_hashed(
    table: torch.Tensor | QuantizedWeight,
    compressed: torch.Tensor,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`engram_gather_ref(table, EngramHash(compressed), dtype)` in one launch: the table rows
    are hashed from the compressed n-gram history in the kernel (exact integer arithmetic, the
    same rows), no rows tensor.

    Args:
        table, dtype, out: as `engram_gather`.
        compressed: int64 [T, N] contiguous, each row's compressed ids at positions p, p - 1,
            ..., p - (N - 1).
        multipliers: int64 [N]; primes: int64 [N - 1, heads]; offsets: int64 [(N - 1) * heads]
            (`EngramHash`'s buffers), contiguous, on the history's device.
    """
    require(
        compressed.dim() == 2 and compressed.dtype == torch.int64 and compressed.is_contiguous(),
        f"compressed: expected contiguous int64 [T, N], got {compressed.dtype} "
        f"{tuple(compressed.shape)}",
    )
    t, n = compressed.shape
    require(n >= 2, f"compressed: an n-gram history of at least 2 ids, got {n}")
    heads = primes.shape[-1] if primes.dim() == 2 else 0
    for name, tensor, shape in (
        ("multipliers", multipliers, (n,)),
        ("primes", primes, (n - 1, heads)),
        ("offsets", offsets, ((n - 1) * heads,)),
    ):
        require(
            tuple(tensor.shape) == shape
            and tensor.dtype == torch.int64
            and tensor.is_contiguous()
            and tensor.device == compressed.device,
            f"{name}: expected contiguous int64 {shape} on {compressed.device}, got "
            f"{tensor.dtype} {tuple(tensor.shape)}",
        )
    hashing = (multipliers, primes, offsets, n, heads)
    return _launch(table, compressed, (n, 1), t, (n - 1) * heads, dtype, out, hashing)


def _launch(
    table: torch.Tensor | QuantizedWeight,
    ids: torch.Tensor,
    ids_strides: tuple[int, int],
    t: int,
    k: int,
    dtype: torch.dtype | None,
    out: torch.Tensor | None,
    hashing: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None,
) -> torch.Tensor:
    """The table's checks and the launch over t tokens x k ids (read from `ids`, or hashed
    from it with `hashing`: multipliers, primes, offsets, N, heads)."""
    quantized = isinstance(table, QuantizedWeight)
    data = table.data if isinstance(table, QuantizedWeight) else table
    require(data.dim() == 2, f"table: expected [V, E], got shape {tuple(data.shape)}")
    require(data.stride(1) == 1 or data.shape[1] == 1, "table: needs unit stride in E")
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
    multipliers, primes, offsets, ngram, heads = hashing or (ids, ids, ids, 2, 1)
    _engram_gather_kernel[(t, triton.cdiv(k, block_k))](
        stored,
        stored.stride(0),
        scale,
        scale.stride(0),
        ids,
        *ids_strides,
        out,
        k,
        multipliers,
        primes,
        offsets,
        E=e,
        BLOCK_K=block_k,
        BLOCK_E=block_e,
        FP8=quantized,
        GROUP=group,
        HASHED=hashing is not None,
        NGRAM=ngram,
        NGRAM_P2=triton.next_power_of_2(ngram),
        HEADS=heads,
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


__all__ = ["engram_gather", "engram_gather_hashed", "hashed_ngram_rows"]
