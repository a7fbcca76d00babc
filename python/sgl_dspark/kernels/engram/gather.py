"""Engram's embedding gather in one launch (`engram_gather_ref` is the spec): the K hashed
n-gram ids of every token, read in place from a 2-D tensor of any strides (a column slice, a
transposed view: no reshape copy), each selecting one table row, written side by side into the
`[T, K * E]` input of the Engram's projection. A copy: bit-exact on every backend."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import INDEX_DTYPES, require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers


@triton.jit
def _engram_gather_kernel(
    table_ptr,
    table_row_stride,
    ids_ptr,
    ids_stride_t,
    ids_stride_k,
    out_ptr,
    K,
    E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the ids come from the hashing kernels before this one
    t = tl.program_id(0).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    ids = tl.load(ids_ptr + t * ids_stride_t + offs_k * ids_stride_k, mask=mask_k, other=0)
    offs_e = tl.arange(0, BLOCK_E)
    mask = mask_k[:, None] & (offs_e < E)[None, :]
    rows = tl.load(
        table_ptr + ids.to(tl.int64)[:, None] * table_row_stride + offs_e[None, :], mask=mask
    )
    tl.store(out_ptr + t * K * E + offs_k[:, None] * E + offs_e[None, :], rows, mask=mask)


def engram_gather(
    table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`engram_gather_ref` in one launch, no host sync.

    Args:
        table: [V, E], unit stride in E.
        ids: [T, K] int32/int64, any strides, values in [0, V) (not checked on the device).
        out: optional [T, K * E] contiguous output in the table's dtype.
    """
    require(table.dim() == 2, f"table: expected [V, E], got shape {tuple(table.shape)}")
    require(table.stride(1) == 1 or table.shape[1] == 1, "table: needs unit stride in E")
    require(
        ids.dim() == 2 and ids.dtype in INDEX_DTYPES,
        f"ids: expected int32/int64 [T, K], got {ids.dtype} {tuple(ids.shape)}",
    )
    require(ids.device == table.device, f"ids: expected device {table.device}, got {ids.device}")
    t, k = ids.shape
    e = table.shape[1]
    if out is None:
        out = torch.empty(t, k * e, dtype=table.dtype, device=table.device)
    require(
        tuple(out.shape) == (t, k * e) and out.dtype == table.dtype and out.is_contiguous(),
        f"out: expected contiguous {table.dtype} [{t}, {k * e}], got {out.dtype} "
        f"{tuple(out.shape)}",
    )
    if t == 0 or k == 0:
        return out
    block_e = triton.next_power_of_2(e)
    block_k = max(1, min(triton.next_power_of_2(k), 4096 // block_e))
    _engram_gather_kernel[(t, triton.cdiv(k, block_k))](
        table,
        table.stride(0),
        ids,
        ids.stride(0),
        ids.stride(1),
        out,
        k,
        E=e,
        BLOCK_K=block_k,
        BLOCK_E=block_e,
        num_warps=4,
        **programmatic_launch(_engram_gather_kernel, table.device),
    )
    return out


__all__ = ["engram_gather"]
