"""Draft input staging and the verify-window plan of one decode step in one launch
(`prepare_draft_inputs_ref` is the spec; `reference.py` gives the layout). Bit-exact (integer
copies and table reads)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import INDEX_DTYPES, require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers
from sgl_dspark.kernels.spec.reference import DraftInputs


@triton.jit
def _prepare_draft_inputs_kernel(
    anchors_ptr,
    seq_lens_ptr,
    req_pool_ptr,
    req_to_token_ptr,
    n_valid_ptr,
    ids_ptr,
    draft_pos_ptr,
    draft_slot_ptr,
    verify_pos_ptr,
    verify_slot_ptr,
    num_rows,
    pool_rows,
    table_width,
    table_stride,
    mask_token_id,
    pad_position,
    pad_slot,
    Q: tl.constexpr,
    W: tl.constexpr,
    COLS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the anchors and lengths come from the last step's acceptance
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, COLS)
    in_batch = rows < num_rows
    # The row loads do not wait for n_valid (padding rows are in bounds too): one round trip
    # for all four before the table lookup, which needs seq and pool.
    n_valid = tl.load(n_valid_ptr)
    seq = tl.load(seq_lens_ptr + rows, mask=in_batch, other=0).to(tl.int64)
    pool = tl.load(req_pool_ptr + rows, mask=in_batch, other=0).to(tl.int64)
    anchor = tl.load(anchors_ptr + rows, mask=in_batch, other=0).to(tl.int64)
    valid = in_batch & (rows < n_valid)
    positions = seq[:, None] + cols[None, :]
    readable = valid[:, None] & (positions >= 0) & (positions < table_width)
    readable = readable & ((pool >= 0) & (pool < pool_rows))[:, None]
    # Read only the columns some output needs; masked lanes never touch memory.
    needed = (cols[None, :] < Q) | (cols[None, :] < W)
    slots = tl.load(
        req_to_token_ptr + pool[:, None] * table_stride + positions,
        mask=readable & needed,
        other=0,
    ).to(tl.int64)
    slots = tl.where(readable, slots, pad_slot)
    positions = tl.where(valid[:, None], positions, pad_position)
    ids = tl.where(valid[:, None] & (cols[None, :] == 0), anchor[:, None], mask_token_id)
    row_off = rows.to(tl.int64)[:, None]
    in_q = in_batch[:, None] & (cols[None, :] < Q)
    in_w = in_batch[:, None] & (cols[None, :] < W)
    tl.store(ids_ptr + row_off * Q + cols[None, :], ids.to(tl.int64), mask=in_q)
    tl.store(draft_pos_ptr + row_off * Q + cols[None, :], positions, mask=in_q)
    tl.store(draft_slot_ptr + row_off * Q + cols[None, :], slots, mask=in_q)
    tl.store(verify_pos_ptr + row_off * W + cols[None, :], positions, mask=in_w)
    tl.store(verify_slot_ptr + row_off * W + cols[None, :], slots, mask=in_w)


def prepare_draft_inputs(
    anchors: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    draft_len: int,
    verify_width: int,
    mask_token_id: int,
    pad_position: int = 0,
    pad_slot: int = 0,
    out: DraftInputs | None = None,
) -> DraftInputs:
    """`prepare_draft_inputs_ref` for B (padded) rows in one launch.

    Args:
        anchors: int32/int64 [B] last sampled token per row.
        seq_lens: int32/int64 [B] committed length s_r.
        req_pool_indices: int32/int64 [B] row of ``req_to_token`` per request.
        req_to_token: int32/int64 [R, S_max], unit stride along S_max (the req -> KV slot table).
        n_valid: int32/int64 device scalar (0-d or [1]); rows >= n_valid are padding.
        draft_len: Q, draft query rows per request (>= 1).
        verify_width: W_full, verify-window columns planned (>= 1).
        mask_token_id: id written to input_ids columns 1..Q-1 and to padding rows.
        pad_position, pad_slot: values written for padding rows.
        out: optional ``DraftInputs`` of contiguous int64 buffers; pass the persistent draft-input
            buffer as ``out.input_ids``. Every element of every buffer is rewritten.
    Returns:
        ``DraftInputs`` (see the module docstring).
    """
    num_rows = anchors.shape[0]
    int_types = INDEX_DTYPES
    for name, t in (
        ("anchors", anchors),
        ("seq_lens", seq_lens),
        ("req_pool_indices", req_pool_indices),
    ):
        require(
            t.shape == (num_rows,) and t.dtype in int_types and t.is_contiguous(),
            f"{name} must be a contiguous int32/int64 [{num_rows}] tensor, got "
            f"{t.dtype} {tuple(t.shape)}",
        )
    require(
        req_to_token.dim() == 2
        and req_to_token.dtype in int_types
        and (req_to_token.numel() <= 0 or req_to_token.stride(1) == 1),
        f"req_to_token must be int32/int64 [R, S_max] with unit column stride, "
        f"got {req_to_token.dtype} {tuple(req_to_token.shape)}",
    )
    require(
        n_valid.numel() == 1 and n_valid.dtype in int_types,
        f"n_valid must be a one-element int32/int64 tensor, got {n_valid.dtype} "
        f"{tuple(n_valid.shape)}",
    )
    require(
        draft_len >= 1 and verify_width >= 1,
        f"draft_len ({draft_len}) and verify_width ({verify_width}) must be >= 1",
    )
    device = anchors.device
    if out is None:
        out = DraftInputs(
            *(
                torch.empty((num_rows, width), dtype=torch.int64, device=device)
                for width in (draft_len, draft_len, draft_len, verify_width, verify_width)
            )
        )
    for name, buf, width in zip(
        DraftInputs._fields, out, (draft_len, draft_len, draft_len, verify_width, verify_width)
    ):
        require(
            buf.shape == (num_rows, width) and buf.dtype == torch.int64 and buf.is_contiguous(),
            f"out.{name} must be contiguous int64 [{num_rows}, {width}], got {buf.dtype} "
            f"{tuple(buf.shape)}",
        )
    if num_rows == 0:
        return out
    block_rows = 16
    _prepare_draft_inputs_kernel[(triton.cdiv(num_rows, block_rows),)](
        anchors,
        seq_lens,
        req_pool_indices,
        req_to_token,
        n_valid,
        *out,
        num_rows,
        req_to_token.shape[0],
        req_to_token.shape[1],
        req_to_token.stride(0) if req_to_token.numel() > 0 else 0,
        mask_token_id,
        pad_position,
        pad_slot,
        Q=draft_len,
        W=verify_width,
        COLS=triton.next_power_of_2(max(draft_len, verify_width)),
        BLOCK_ROWS=block_rows,
        **programmatic_launch(_prepare_draft_inputs_kernel, device),
    )
    return out
