"""Phase A of the mHC boundary kernel (`post_combine.py`): the stream update on one D slice and the
slice's partial sums of the next coefficients' projection."""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import round_to_bf16, wait_for_producers


@triton.jit
def pick(t, offs_j, j: tl.constexpr):
    """Row j of fp32 t [NP, B], bit for bit (signed zeros, NaN payloads): an integer sum of the
    bit patterns with zeros elsewhere is exact on every backend and interpreter, whatever the
    tree (a float sum with a -0.0 fill is not: numpy's sum starts from +0.0)."""
    bits = tl.where(offs_j[:, None] == j, t.to(tl.int32, bitcast=True), 0)
    return tl.sum(bits, axis=0).to(tl.float32, bitcast=True)


@triton.jit
def _load_row(
    streams_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    row,
    M,
    offs_j,
    mask_j,
    offs_d,
    mask_d,
    D: tl.constexpr,
    N: tl.constexpr,
    HAS_UPDATE: tl.constexpr,
):
    """Phase A inputs of one row on one slice: y [B], post [NP], comb [NP, NP], Rs [NP, B]."""
    ok = row < M
    mask_jd = mask_j[:, None] & mask_d[None, :] & ok
    if HAS_UPDATE:
        y = tl.load(y_ptr + row * D + offs_d, mask=mask_d & ok, other=0.0).to(tl.float32)
        post = tl.load(post_ptr + row * N + offs_j, mask=mask_j & ok, other=0.0)
        comb = tl.load(
            comb_ptr + row * N * N + offs_j[:, None] * N + offs_j[None, :],
            mask=mask_j[:, None] & mask_j[None, :] & ok,
            other=0.0,
        )
    else:
        y, post = offs_d.to(tl.float32), offs_j.to(tl.float32)  # unused placeholders
        comb = post[:, None] + post[None, :]
    src = tl.load(
        streams_ptr + (row * N + offs_j[:, None]) * D + offs_d[None, :], mask=mask_jd, other=0.0
    ).to(tl.float32)
    return y, post, comb, src


@triton.jit
def stream_update_and_partials(
    streams_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    fn_ptr,
    streams_out_ptr,
    partials_ptr,
    M,
    D: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    RP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HAS_UPDATE: tl.constexpr,
    HAS_COEFFS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Phase A, program (row tile, D slice): Rs' of BLOCK_M rows on the slice; per row, the
    slice's partial fn projection (partials columns < R) and sum of squares (column R).
    Without HAS_UPDATE (opening only) Rs' is Rs itself and nothing is stored but partials;
    without HAS_COEFFS (a close that computes no coefficients) only Rs' is stored."""
    R: tl.constexpr = (2 + N) * N
    wait_for_producers(PDL)  # streams, y, post and comb come from earlier kernels
    slice_id = tl.program_id(1)
    act_ty = streams_out_ptr.dtype.element_ty
    offs_j = tl.arange(0, NP)
    mask_j = offs_j < N
    offs_d = slice_id * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_r = tl.arange(0, RP)
    mask_r = offs_r < R
    mask_jd = mask_j[:, None] & mask_d[None, :]
    # fn[r, j·D + d]: the streams flattened stream-major. Loaded once, reused by every row.
    if HAS_COEFFS:
        fn_offs = (
            offs_r[:, None, None] * (N * D) + offs_j[None, :, None] * D + offs_d[None, None, :]
        )
        fn_mask = mask_r[:, None, None] & mask_jd[None, :, :]
        fn_tile = tl.load(fn_ptr + fn_offs, mask=fn_mask, other=0.0)

    # Unrolled, each row running the same code on the same shapes (so its bits depend neither
    # on BLOCK_M nor on its place in the tile); the next row's loads are issued before this
    # row's arithmetic so that their latency overlaps it.
    first_row = tl.program_id(0).to(tl.int64) * BLOCK_M
    y, post, comb, src = _load_row(
        streams_ptr,
        y_ptr,
        post_ptr,
        comb_ptr,
        first_row,
        M,
        offs_j,
        mask_j,
        offs_d,
        mask_d,
        D,
        N,
        HAS_UPDATE,
    )
    for i in tl.static_range(BLOCK_M):
        row = first_row + i
        if i + 1 < BLOCK_M:
            y_next, post_next, comb_next, src_next = _load_row(
                streams_ptr,
                y_ptr,
                post_ptr,
                comb_ptr,
                row + 1,
                M,
                offs_j,
                mask_j,
                offs_d,
                mask_d,
                D,
                N,
                HAS_UPDATE,
            )
        if HAS_UPDATE:
            # The reference's operand order: post term first, then j increasing.
            acc = post[:, None] * y[None, :]
            for j in tl.static_range(N):
                acc = acc + pick(comb, offs_j, j)[:, None] * pick(src, offs_j, j)[None, :]
            if ROUND_BF16:
                acc = round_to_bf16(acc)
            out_offs = (row * N + offs_j[:, None]) * D + offs_d[None, :]
            tl.store(streams_out_ptr + out_offs, acc.to(act_ty), mask=mask_jd & (row < M))
        else:
            acc = src  # opening only: the streams are read as they are (no store)
        if HAS_COEFFS:
            sumsq = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
            mix = tl.sum(tl.sum(fn_tile * acc[None, :, :], axis=2), axis=1)
            part = tl.where(offs_r == R, sumsq, mix)
            part_ptr = partials_ptr + (row * NUM_SLICES + slice_id) * RP + offs_r
            tl.store(part_ptr, part, mask=row < M)
        if i + 1 < BLOCK_M:
            y, post, comb, src = y_next, post_next, comb_next, src_next
