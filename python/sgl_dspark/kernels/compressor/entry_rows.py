"""The KV pool's compressed-entry addressing in Triton (`entry_pool_rows_ref` is the spec), one
definition for the kernels that read entries through the request table: indexer scoring, the
index top-k and the attention's dense entries; and (`picked_entry_rows`) a top-k selection's
pool rows and validity in one launch (`picked_entry_rows_ref`), an exact integer gather."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import INDEX_DTYPES, check_index_vector, require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers


@triton.jit
def load_entry_rows(table_row, entry, ratio, table_width, mask):
    """Pool rows (int64) of entries ``entry`` of the request whose table row starts at
    ``table_row``; 0 where ``mask`` is false (nothing is loaded there)."""
    col = tl.minimum(entry.to(tl.int64) * ratio, table_width - 1)
    return tl.load(table_row + col, mask=mask, other=0).to(tl.int64) // ratio


@triton.jit
def _picked_entry_rows_kernel(
    values_ptr,
    values_row_stride,
    indices_ptr,
    indices_row_stride,
    table_ptr,
    table_row_stride,
    table_width,
    slots_ptr,
    rows_ptr,
    valid_ptr,
    k,
    ratio,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the selection comes from the sort before this launch
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    in_k = offs < k
    value = tl.load(values_ptr + t * values_row_stride + offs, mask=in_k, other=float("-inf"))
    entry = tl.load(indices_ptr + t * indices_row_stride + offs, mask=in_k, other=0)
    valid = value > float("-inf")
    slot = tl.load(slots_ptr + t).to(tl.int64)
    rows = load_entry_rows(table_ptr + slot * table_row_stride, entry, ratio, table_width, valid)
    tl.store(rows_ptr + t * k + offs, rows, mask=in_k)
    tl.store(valid_ptr + t * k + offs, valid.to(tl.uint8), mask=in_k)


def picked_entry_rows(
    values: torch.Tensor,
    indices: torch.Tensor,
    req_to_token: torch.Tensor,
    token_slot: torch.Tensor,
    ratio: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`picked_entry_rows_ref` in one launch: a top-k selection's pool rows and validity.

    Args:
        values, indices: [T, k] the selection (scores, entry ids), unit stride along k (the
            leading columns of a sorted row, read in place).
        req_to_token: [R, C] int32/int64 request table, unit stride along C.
        token_slot: [T] int: each row's request (its row of `req_to_token`).
        ratio: the compress ratio.
    Returns:
        (rows int64 [T, k], 0 where not valid; valid bool [T, k]: the value is not -inf).
    """
    require(
        values.dim() == 2 and values.shape == indices.shape,
        f"values / indices: expected one [T, k] shape, got {tuple(values.shape)} and "
        f"{tuple(indices.shape)}",
    )
    require(
        values.dtype == torch.float32 and indices.dtype in INDEX_DTYPES,
        f"values / indices: expected fp32 / int, got {values.dtype} / {indices.dtype}",
    )
    require(
        values.stride(1) == 1 and indices.stride(1) == 1,
        "values / indices: need unit stride along k",
    )
    require(
        req_to_token.dim() == 2 and req_to_token.stride(1) == 1,
        f"req_to_token: expected [R, C] with unit stride, got {tuple(req_to_token.shape)}",
    )
    check_index_vector("token_slot", token_slot, values.shape[0])
    tokens, k = values.shape
    rows = torch.empty(tokens, k, dtype=torch.int64, device=values.device)
    valid = torch.empty(tokens, k, dtype=torch.uint8, device=values.device)
    if tokens and k:
        _picked_entry_rows_kernel[(tokens,)](
            values,
            values.stride(0),
            indices,
            indices.stride(0),
            req_to_token,
            req_to_token.stride(0),
            req_to_token.shape[1],
            token_slot,
            rows,
            valid,
            k,
            ratio,
            BLOCK_K=triton.next_power_of_2(k),
            num_warps=4,
            **programmatic_launch(_picked_entry_rows_kernel, values.device),
        )
    return rows, valid.view(torch.bool)
