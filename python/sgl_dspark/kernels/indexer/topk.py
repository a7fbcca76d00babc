"""Lightning-indexer top-k selection in one launch: per query row, the k best visible entries
(`index_topk_ref` is the spec; the selection rule is in `reference.py`).

In a CSA layer each query token t has fp32 indexer scores ``scores[t, n]`` over the compressed
entries n of its request (``[T, N]``, N = the widest row of the batch). Only entries
``n < visible[t]`` are real; the rest hold -inf or garbage and are never read. One launch (one
program per row, no host sync, static output shapes: CUDA-graph safe) replaces
``topk`` + compare + ``where``; with ``entry_rows`` it also looks up the selected entries' pool
rows, so the attention reads them without a gather launch between.

Exactness: bit-exact on every backend (integer keys, no float arithmetic). NaN scores are not
supported by the contract: the kernel orders a NaN by its bit pattern (a positive-sign NaN above
+inf, a negative-sign NaN below -inf); the reference differs.

Algorithm (per program): each score maps to an int32 key whose signed order is the float order
(positive floats keep their bits, negative floats flip the 31 low bits). A 4-pass radix select
(8 bits per pass, top byte signed) finds the k-th largest key T* with histograms over the row's
candidates, read in chunks of BLOCK_N; a last pass writes, in index order, every candidate with
key > T* plus the first ``k - #(key > T*)`` candidates with key == T*, the output slot coming
from a running count plus an in-chunk cumsum. A pass whose chosen bucket is taken whole ends
the search early (its lower bound is then T*, and the same rule selects the bucket). Rows with
<= k candidates skip the search. Every pass reads only the row's candidates, so short rows cost
little.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers
from sgl_dspark.kernels.compressor.entry_rows import load_entry_rows

_RADIX_BINS = 256
# Largest chunk: with T <= 128 rows there is about one program per SM, so a row's passes are a
# serial chain of chunk loads; big chunks keep the chain short (N = 16384 -> 4 chunks per pass).
_MAX_BLOCK_N = 4096
_MAX_BLOCK_K = 1024


@triton.jit
def _order_keys(row_ptr, idx, mask):
    """int32 keys whose signed order is the fp32 order, with -0.0 mapped to +0.0's key."""
    bits = tl.load(row_ptr + idx, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _index_topk_kernel(
    scores_ptr,
    visible_ptr,
    ids_ptr,
    valid_ptr,
    width,
    k,
    stride_row,
    table_ptr,
    token_slot_ptr,
    table_width,
    table_stride,
    ratio,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BINS: tl.constexpr,
    ENTRY_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the scores and visible counts come from earlier kernels
    row = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + row * stride_row
    out_ids = ids_ptr + row * k
    out_valid = valid_ptr + row * k
    num_cand = tl.minimum(tl.maximum(tl.load(visible_ptr + row), 0), width).to(tl.int32)
    if ENTRY_ROWS:  # this row's request: its row of the request-to-token table
        table_row = table_ptr + tl.load(token_slot_ptr + row).to(tl.int64) * table_stride
    take_all = num_cand <= k
    offs = tl.arange(0, BLOCK_N)
    bins = tl.arange(0, BINS)

    # Radix select of the k-th largest key. Invariant while searching: `remaining` of the keys
    # that share `thr`'s decided high bits still have to be taken (the rest of k lies above).
    thr = tl.full((), 0, tl.int32)
    remaining = tl.full((), 0, tl.int32) + k
    searching = num_cand > k
    for p in tl.static_range(4):
        hist = tl.zeros([BINS], tl.int32)
        for start in range(0, tl.where(searching, num_cand, 0), BLOCK_N):
            idx = start + offs
            in_cand = idx < num_cand
            key = _order_keys(row_ptr, idx, in_cand)
            if p == 0:
                digit = (key >> 24) + 128
                match = in_cand
            else:
                digit = (key >> (24 - 8 * p)) & 0xFF
                match = in_cand & ((key >> (32 - 8 * p)) == (thr >> (32 - 8 * p)))
            hist += tl.histogram(digit, BINS, mask=match)
        # Largest digit d with #(matching keys with digit >= d) >= remaining.
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        d = tl.max(tl.where(at_least >= remaining, bins, 0), axis=0)
        in_bucket = tl.sum(tl.where(bins == d, hist, 0), axis=0)
        above = tl.sum(tl.where(bins == d, at_least, 0), axis=0) - in_bucket
        if p == 0:
            new_thr = (d - 128) << 24
        else:
            new_thr = thr | (d << (24 - 8 * p))
        thr = tl.where(searching, new_thr, thr)
        remaining = tl.where(searching, remaining - above, remaining)
        # The whole bucket is taken: stop. `thr` (the bucket's lower bound, low bits 0) then
        # selects exactly it below: keys > thr, plus keys == thr (at most `remaining` of them).
        searching = searching & (in_bucket != remaining)

    # Compaction in index order.
    num_out = tl.full((), 0, tl.int32)
    num_eq = tl.full((), 0, tl.int32)
    for start in range(0, num_cand, BLOCK_N):
        idx = start + offs
        in_cand = idx < num_cand
        key = _order_keys(row_ptr, idx, in_cand)
        is_eq = (in_cand & (key == thr)).to(tl.int32)
        eq_rank = num_eq + tl.cumsum(is_eq, axis=0) - is_eq
        by_threshold = (key > thr) | ((is_eq != 0) & (eq_rank < remaining))
        sel = in_cand & (take_all | by_threshold)
        sel_i = sel.to(tl.int32)
        pos = num_out + tl.cumsum(sel_i, axis=0) - sel_i
        if ENTRY_ROWS:
            value = load_entry_rows(table_row, idx, ratio, table_width, sel)
        else:
            value = idx.to(tl.int64)
        tl.store(out_ids + pos, value, mask=sel)
        num_out += tl.sum(sel_i, axis=0)
        num_eq += tl.sum(is_eq, axis=0)

    num_sel = tl.minimum(num_cand, k)
    for start in range(0, k, BLOCK_K):
        slot = start + tl.arange(0, BLOCK_K)
        in_k = slot < k
        is_valid = slot < num_sel
        tl.store(out_valid + slot, is_valid.to(tl.uint8), mask=in_k)
        tl.store(out_ids + slot, tl.zeros([BLOCK_K], tl.int64), mask=in_k & ~is_valid)


def _block_sizes(width: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) from the shapes only: a row of N <= BLOCK_N is one chunk."""
    block_n = min(max(triton.next_power_of_2(max(width, 1)), 16), _MAX_BLOCK_N)
    block_k = min(max(triton.next_power_of_2(k), 16), _MAX_BLOCK_K)
    num_warps = 4 if block_n <= 1024 else 8
    return block_n, block_k, num_warps


def _check_out(
    buf: torch.Tensor | None,
    name: str,
    shape: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    require(
        buf.dtype == dtype and tuple(buf.shape) == shape and (buf.device == device),
        f"{name} must be {dtype} {list(shape)} on {device}, got {buf.dtype} "
        f"{list(buf.shape)} on {buf.device}",
    )
    require(buf.is_contiguous(), f"{name} must be contiguous")
    return buf


def index_topk(
    scores: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    *,
    out_ids: torch.Tensor | None = None,
    out_valid: torch.Tensor | None = None,
    entry_rows: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`index_topk_ref` in one launch, bit for bit.

    Args:
        scores: fp32 ``[T, N]`` with unit column stride (any row stride); entries
            ``n >= visible[t]`` are never read. No NaN among candidates (see module doc).
        visible: int64 or int32 ``[T]``, contiguous, same device; clamped to ``[0, N]``.
        k: slots per row, ``k >= 1``; slots past the number of candidates are invalid.
        out_ids: optional int64 ``[T, k]`` contiguous buffer for the ids.
        out_valid: optional bool ``[T, k]`` contiguous buffer for the validity mask.
        entry_rows: optional ``(req_to_token, token_slot, ratio)``: int64/int32 ``[R, W]`` with
            unit column stride, int64 ``[T]`` contiguous, int >= 1. The selected slots then
            hold the entries' pool rows (module doc) instead of their ids.
    Returns:
        ``(ids, valid)``: int64 ``[T, k]`` (selected ids ascending, or their pool rows, then 0)
        and bool ``[T, k]`` (True exactly in slots ``0..min(k, candidates)-1``); the ``out_*``
        buffers when given.
    Raises:
        ValueError: wrong dtype, rank, shape, device or layout, or ``k < 1``.
    """
    require(
        not isinstance(k, bool) and isinstance(k, int) and (k >= 1),
        f"k must be an int >= 1, got {k!r}",
    )
    require(
        scores.dtype == torch.float32 and scores.dim() == 2,
        f"scores must be fp32 [T, N], got {scores.dtype} {list(scores.shape)}",
    )
    num_rows, width = scores.shape
    require(
        visible.dtype in (torch.int64, torch.int32) and tuple(visible.shape) == (num_rows,),
        f"visible must be int64/int32 [{num_rows}], got {visible.dtype} {list(visible.shape)}",
    )
    require(
        visible.device == scores.device,
        f"visible is on {visible.device}, scores on {scores.device}",
    )
    require(visible.is_contiguous(), "visible must be contiguous")
    require(
        width <= 1 or scores.stride(1) == 1,
        f"scores must have unit column stride, got strides {scores.stride()}",
    )
    device = scores.device
    ids = _check_out(out_ids, "out_ids", (num_rows, k), torch.int64, device)
    valid = _check_out(out_valid, "out_valid", (num_rows, k), torch.bool, device)
    if num_rows == 0:
        return ids, valid
    if entry_rows is None:
        table, token_slot, ratio = visible, visible, 1  # never read (ENTRY_ROWS false)
        table_width = table_stride = 1
    else:
        table, token_slot, ratio = entry_rows
        _check_entry_rows(table, token_slot, ratio, num_rows, device)
        table_width, table_stride = table.shape[1], table.stride(0)
    block_n, block_k, num_warps = _block_sizes(width, k)
    _index_topk_kernel[(num_rows,)](
        scores,
        visible,
        ids,
        valid.view(torch.uint8),
        width,
        k,
        scores.stride(0),
        table,
        token_slot,
        table_width,
        table_stride,
        ratio,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BINS=_RADIX_BINS,
        ENTRY_ROWS=entry_rows is not None,
        num_warps=num_warps,
        **programmatic_launch(_index_topk_kernel, device),
    )
    return ids, valid


def _check_entry_rows(
    table: torch.Tensor, token_slot: torch.Tensor, ratio: int, num_rows: int, device: torch.device
) -> None:
    require(
        table.dtype in (torch.int64, torch.int32)
        and table.dim() == 2
        and (table.shape[1] >= 1)
        and (table.stride(1) == 1)
        and (table.device == device),
        f"entry_rows: req_to_token must be int64/int32 [R, W >= 1] with unit "
        f"column stride on {device}, got {table.dtype} {list(table.shape)} "
        f"strides {table.stride()} on {table.device}",
    )
    require(
        token_slot.dtype == torch.int64
        and tuple(token_slot.shape) == (num_rows,)
        and token_slot.is_contiguous()
        and (token_slot.device == device),
        f"entry_rows: token_slot must be contiguous int64 [{num_rows}] on "
        f"{device}, got {token_slot.dtype} {list(token_slot.shape)} on "
        f"{token_slot.device}",
    )
    require(
        not isinstance(ratio, bool) and isinstance(ratio, int) and (ratio >= 1),
        f"entry_rows: ratio must be an int >= 1, got {ratio!r}",
    )
