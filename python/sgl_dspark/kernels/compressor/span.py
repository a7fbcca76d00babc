"""Span reads of the compressor kernel (`pool.py`): a block's span rows from this forward or the
state ring, its gate logits, and the entry's rotation at its block start."""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import round_to_storage


@triton.jit
def span_tile(
    j0,
    row,
    pos,
    prefix,
    req,
    ratio,
    ring,
    cols,
    in_col,
    head_dim,
    new_ptr,
    new_stride,
    state_ptr,
    state_stride_r,
    state_stride_q,
    SPAN: tl.constexpr,
    OVERLAP: tl.constexpr,
    SPAN_BLOCK: tl.constexpr,
):
    """Span slots j0 .. j0 + SPAN_BLOCK - 1 as an fp32 tile [SPAN_BLOCK, BLOCK_D] (this forward's
    rows or ring rows; 0 where a slot is absent) plus the per-slot positions and presence."""
    j = j0 + tl.arange(0, SPAN_BLOCK)
    q = pos - (SPAN - 1) + j
    present = j < SPAN
    if OVERLAP:
        offset = (j >= ratio).to(tl.int64) * head_dim  # Ca for slots < m, Cb after
        present = present & (q >= 0)  # block 0 has no previous block
    else:
        offset = j.to(tl.int64) * 0
    fresh = q >= prefix
    ring_row = q % ring
    ring_row = tl.where(ring_row < 0, ring_row + ring, ring_row)  # floor mod on any backend
    chan = offset[:, None] + cols[None, :]
    keep = present[:, None] & in_col[None, :]
    new_vals = tl.load(
        new_ptr + (row - (pos - q))[:, None] * new_stride + chan,
        mask=keep & fresh[:, None],
        other=0.0,
    )
    old_vals = tl.load(
        state_ptr + req * state_stride_r + ring_row[:, None] * state_stride_q + chan,
        mask=keep & (q < prefix)[:, None],
        other=0.0,
    )
    vals = tl.where(fresh[:, None], new_vals, old_vals).to(tl.float32)
    return vals, q, offset, keep


@triton.jit
def span_logits(
    j0,
    row,
    pos,
    prefix,
    req,
    ratio,
    ring,
    cols,
    in_col,
    head_dim,
    score_ptr,
    score_stride,
    state_score_ptr,
    ss_stride_r,
    ss_stride_q,
    bias_ptr,
    bias_stride,
    SPAN: tl.constexpr,
    OVERLAP: tl.constexpr,
    SPAN_BLOCK: tl.constexpr,
    STORAGE: tl.constexpr,
):
    """kv_dtype(score + kv_dtype(position_bias)) of span slots j0.., -inf where absent."""
    sc, q, offset, keep = span_tile(
        j0,
        row,
        pos,
        prefix,
        req,
        ratio,
        ring,
        cols,
        in_col,
        head_dim,
        score_ptr,
        score_stride,
        state_score_ptr,
        ss_stride_r,
        ss_stride_q,
        SPAN,
        OVERLAP,
        SPAN_BLOCK,
    )
    bias_row = q % ratio
    bias_row = tl.where(bias_row < 0, bias_row + ratio, bias_row)
    bias = tl.load(
        bias_ptr + bias_row[:, None] * bias_stride + offset[:, None] + cols[None, :],
        mask=keep,
        other=0.0,
    )
    sc = round_to_storage(sc + round_to_storage(bias.to(tl.float32), STORAGE), STORAGE)
    return tl.where(keep, sc, float("-inf"))


@triton.jit
def rope_pairs(entry, c, s, is_rope, BLOCK_D: tl.constexpr, STORAGE: tl.constexpr):
    """Rotate the trailing rope channels of entry [BLOCK_D] (fp32, interleaved pairs; `c`, `s`
    and `is_rope` per pair, from `rope_table_rows`) as `rope_tail_ref`: separately rounded fp32
    products (no FMA: launched with fp fusion off), one round to the kv dtype."""
    a, b = tl.split(tl.reshape(entry, (BLOCK_D // 2, 2)))
    rot_a = tl.where(is_rope, round_to_storage(a * c - b * s, STORAGE), a)
    rot_b = tl.where(is_rope, round_to_storage(a * s + b * c, STORAGE), b)
    return tl.reshape(tl.join(rot_a, rot_b), (BLOCK_D,))


@triton.jit
def rope_table_rows(
    row, cos_ptr, sin_ptr, cs_stride, head_dim, NOPE_HALF: tl.constexpr, BLOCK_D: tl.constexpr
):
    """The row's cos/sin per channel pair (1 / 0 on the NOPE_HALF pass-through pairs)."""
    pair = tl.arange(0, BLOCK_D // 2)
    k = pair - NOPE_HALF
    is_rope = (k >= 0) & (2 * pair < head_dim)
    c = tl.load(cos_ptr + row * cs_stride + k, mask=is_rope, other=1.0)
    s = tl.load(sin_ptr + row * cs_stride + k, mask=is_rope, other=0.0)
    return c, s, is_rope
