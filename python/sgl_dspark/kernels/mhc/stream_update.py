# Triton unrolls the static loops that grow this file's tuples one stream at a time; mypy types
# each tuple by its first (empty) value and its indexing as out of range.
# mypy: disable-error-code="assignment,misc"
"""Phase A of the mHC boundary kernel (`post_combine.py`): the stream update on one D slice, the
slice's partial sums of the next coefficients' projection and, with a given collapse pre
(single pass), the slice's collapse and its partial sum of squares."""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import round_to_bf16, wait_for_producers


@triton.jit
def _load_row(
    streams_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    collapse_pre_ptr,
    row,
    M,
    offs_d,
    mask_d,
    D: tl.constexpr,
    N: tl.constexpr,
    HAS_UPDATE: tl.constexpr,
    COLLAPSE_IN_A: tl.constexpr,
):
    """Phase A inputs of one row on one slice, stream by stream: the n streams' slices Rs[j]
    [B] and y [B], and as scalars post[k], comb[j, k] (at j·n + k) and the collapse pre[j]."""
    ok = row < M
    mask = mask_d & ok
    src = ()
    for j in tl.static_range(N):
        src = src + (
            tl.load(streams_ptr + (row * N + j) * D + offs_d, mask=mask, other=0.0).to(tl.float32),
        )
    y = offs_d.to(tl.float32)  # placeholder without HAS_UPDATE
    post = ()
    comb = ()
    if HAS_UPDATE:
        y = tl.load(y_ptr + row * D + offs_d, mask=mask, other=0.0).to(tl.float32)
        for k in tl.static_range(N):
            post = post + (tl.load(post_ptr + row * N + k, mask=ok, other=0.0),)
        for i in tl.static_range(N * N):
            comb = comb + (tl.load(comb_ptr + row * N * N + i, mask=ok, other=0.0),)
    pre = ()
    if COLLAPSE_IN_A:
        for j in tl.static_range(N):
            pre = pre + (tl.load(collapse_pre_ptr + row * N + j, mask=ok, other=0.0),)
    return y, post, comb, src, pre


@triton.jit
def stream_update_and_partials(
    streams_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    fn_ptr,
    collapse_pre_ptr,
    streams_out_ptr,
    x_in_ptr,
    partials_ptr,
    M,
    D: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    N: tl.constexpr,
    RP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HAS_UPDATE: tl.constexpr,
    HAS_COEFFS: tl.constexpr,
    COLLAPSE_IN_A: tl.constexpr,
    PDL: tl.constexpr,
):
    """Phase A, program (row tile, D slice): Rs' of BLOCK_M rows on the slice; per row, the
    slice's partial fn projection (partials columns < R) and sum of squares (column R).
    Without HAS_UPDATE (opening only) Rs' is Rs itself and nothing is stored but partials;
    without HAS_COEFFS (a close that computes no coefficients) no fn partials. COLLAPSE_IN_A:
    also the slice of x_in collapsed with the given collapse pre (stored) and its sum of
    squares (column R + 1), so that phase B's norm reads x_in instead of the n streams.

    Each stream is a vector of the slice and every per-stream coefficient a scalar, so the
    update and the collapse are elementwise in each thread: no reduction across the streams,
    whose cross-warp rounds (a shared-memory barrier each) dominated the row's time."""
    R: tl.constexpr = (2 + N) * N
    wait_for_producers(PDL)  # streams, y, post and comb come from earlier kernels
    slice_id = tl.program_id(1)
    act_ty = streams_out_ptr.dtype.element_ty
    offs_d = slice_id * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_r = tl.arange(0, RP)
    mask_r = offs_r < R
    # fn[r, j·D + d]: the streams flattened stream-major, a [RP, B] tile per stream. Loaded
    # once, reused by every row.
    fn = ()
    if HAS_COEFFS:
        for j in tl.static_range(N):
            fn = fn + (
                tl.load(
                    fn_ptr + offs_r[:, None] * (N * D) + j * D + offs_d[None, :],
                    mask=mask_r[:, None] & mask_d[None, :],
                    other=0.0,
                ),
            )

    # Unrolled, each row running the same code on the same shapes (so its bits depend neither
    # on BLOCK_M nor on its place in the tile); the next row's loads are issued before this
    # row's arithmetic so that their latency overlaps it.
    first_row = tl.program_id(0).to(tl.int64) * BLOCK_M
    y, post, comb, src, pre = _load_row(
        streams_ptr,
        y_ptr,
        post_ptr,
        comb_ptr,
        collapse_pre_ptr,
        first_row,
        M,
        offs_d,
        mask_d,
        D,
        N,
        HAS_UPDATE,
        COLLAPSE_IN_A,
    )
    for i in tl.static_range(BLOCK_M):
        row = first_row + i
        row_mask = mask_d & (row < M)
        if i + 1 < BLOCK_M:
            y_next, post_next, comb_next, src_next, pre_next = _load_row(
                streams_ptr,
                y_ptr,
                post_ptr,
                comb_ptr,
                collapse_pre_ptr,
                row + 1,
                M,
                offs_d,
                mask_d,
                D,
                N,
                HAS_UPDATE,
                COLLAPSE_IN_A,
            )
        # Rs'[k] = post[k]·y + Σ_j comb[j, k]·Rs[j]: the reference's operand order (post term
        # first, then j increasing); without HAS_UPDATE Rs' is Rs (no store).
        acc = ()
        for k in tl.static_range(N):
            if HAS_UPDATE:
                a = post[k] * y
                for j in tl.static_range(N):
                    a = a + comb[j * N + k] * src[j]
                if ROUND_BF16:
                    a = round_to_bf16(a)
                tl.store(streams_out_ptr + (row * N + k) * D + offs_d, a.to(act_ty), mask=row_mask)
            else:
                a = src[k]
            acc = acc + (a,)
        part = tl.zeros([RP], tl.float32)
        if HAS_COEFFS:
            # Summed over the streams in each thread first: one reduction across threads each.
            squares = acc[0] * acc[0]
            products = fn[0] * acc[0][None, :]
            for k in tl.static_range(1, N):
                squares = squares + acc[k] * acc[k]
                products = products + fn[k] * acc[k][None, :]
            part = tl.where(offs_r == R, tl.sum(squares, axis=0), tl.sum(products, axis=1))
        if COLLAPSE_IN_A:
            # x_in = Σ_j pre[j]·Rs'[j] over Rs' as stored (acc holds the rounded values), j
            # increasing: the bits of the phase-B collapse (`collapse_store`).
            x = pre[0] * acc[0]
            for j in tl.static_range(1, N):
                x = x + pre[j] * acc[j]
            if ROUND_BF16:
                x = round_to_bf16(x)
            tl.store(x_in_ptr + row * D + offs_d, x.to(x_in_ptr.dtype.element_ty), mask=row_mask)
            part = tl.where(offs_r == R + 1, tl.sum(x * x, axis=0), part)
        if HAS_COEFFS or COLLAPSE_IN_A:
            part_ptr = partials_ptr + (row * NUM_SLICES + slice_id) * RP + offs_r
            tl.store(part_ptr, part, mask=row < M)
        if i + 1 < BLOCK_M:
            y, post, comb, src, pre = y_next, post_next, comb_next, src_next, pre_next
