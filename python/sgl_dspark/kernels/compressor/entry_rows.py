"""The KV pool's compressed-entry addressing in Triton (`entry_pool_rows_ref` is the spec), one
definition for the kernels that read entries through the request table: indexer scoring, the
index top-k and the attention's dense entries; (`picked_entry_rows`) a top-k selection's pool
rows and validity in one launch (`picked_entry_rows_ref`), an exact integer gather; and
(`topk_entry_rows`) DeepSeek-V4.1's whole top-k selection, the sort included, in one launch
(`topk_entry_rows_ref`).

The sort: each score and its entry id packed into one int64 key whose order is the selection's
(the score's fp32 bits mapped to an order-preserving int32 in the high word, -0.0 counted as
+0.0 as torch's comparisons do; the complemented entry id in the low word, so equal scores put
the lower entry first), sorted descending in registers (`tl.sort`, a bitonic network); the
first k keys give the entries in torch's stable-sort order. Exact: the same integers as the
reference. Scores must not be NaN (the indexer's are finite or -inf)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import INDEX_DTYPES, check_index_vector, require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers
from sgl_dspark.kernels.compressor.reference import topk_lower_index_first

# The longest row `topk_entry_rows` sorts in registers (one program a row: 4096 int64 keys over
# 8 warps is 16 a thread); longer rows are sorted by torch, then addressed in one launch.
TOPK_SORT_MAX = 4096
# High word of the key of -inf (0xFF800000 with its magnitude bits flipped, as int32).
_NEG_INF_KEY = tl.constexpr(-2139095041)


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


@triton.jit
def _topk_entry_rows_kernel(
    scores_ptr,
    scores_row_stride,
    n,
    table_ptr,
    table_row_stride,
    table_width,
    slots_ptr,
    rows_ptr,
    valid_ptr,
    k,
    ratio,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the scores come from the indexer before this launch
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    in_row = offs < n
    score = tl.load(scores_ptr + t * scores_row_stride + offs, mask=in_row, other=0.0)
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 ties with +0.0
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = (ordered << 32) | (0x7FFFFFFF - offs).to(tl.int64)
    key = tl.where(in_row, key, -9223372036854775807 - 1)  # padding sorts last
    key = tl.sort(key, descending=True)
    entry = 0x7FFFFFFF - (key & 0xFFFFFFFF)
    valid = (key >> 32) > _NEG_INF_KEY  # not -inf, not padding
    slot = tl.load(slots_ptr + t).to(tl.int64)
    rows = load_entry_rows(table_ptr + slot * table_row_stride, entry, ratio, table_width, valid)
    first = offs < k
    tl.store(rows_ptr + t * k + offs, rows, mask=first)
    tl.store(valid_ptr + t * k + offs, valid.to(tl.uint8), mask=first)


def topk_entry_rows(
    scores: torch.Tensor,
    k: int,
    req_to_token: torch.Tensor,
    token_slot: torch.Tensor,
    ratio: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_entry_rows_ref` in one launch for rows of up to TOPK_SORT_MAX entries (longer rows:
    torch's stable sort, then `picked_entry_rows`; the same integers either way).

    Args:
        scores: [T, N] fp32, unit stride along N, no NaN.
        k: entries kept a row, 0 <= k <= N.
        req_to_token, token_slot, ratio: as `picked_entry_rows`.
    Returns:
        (rows int64 [T, k], 0 where dropped; valid bool [T, k]: the score is not -inf).
    """
    require(
        scores.dim() == 2 and scores.dtype == torch.float32 and scores.stride(1) == 1,
        f"scores: expected fp32 [T, N] with unit stride along N, got {scores.dtype} "
        f"{tuple(scores.shape)}",
    )
    tokens, n = scores.shape
    require(0 <= k <= n, f"k: expected 0 <= k <= {n}, got {k}")
    if n > TOPK_SORT_MAX:
        values, indices = topk_lower_index_first(scores, k)
        return picked_entry_rows(values, indices, req_to_token, token_slot, ratio)
    require(
        req_to_token.dim() == 2 and req_to_token.stride(1) == 1,
        f"req_to_token: expected [R, C] with unit stride, got {tuple(req_to_token.shape)}",
    )
    check_index_vector("token_slot", token_slot, tokens)
    rows = torch.empty(tokens, k, dtype=torch.int64, device=scores.device)
    valid = torch.empty(tokens, k, dtype=torch.uint8, device=scores.device)
    if tokens and k:
        block = triton.next_power_of_2(n)
        _topk_entry_rows_kernel[(tokens,)](
            scores,
            scores.stride(0),
            n,
            req_to_token,
            req_to_token.stride(0),
            req_to_token.shape[1],
            token_slot,
            rows,
            valid,
            k,
            ratio,
            BLOCK_N=block,
            num_warps=max(4, min(8, block // 512)),
            **programmatic_launch(_topk_entry_rows_kernel, scores.device),
        )
    return rows, valid.view(torch.bool)


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
