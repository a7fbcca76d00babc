"""Phase B of the mHC boundary kernel (`post_combine.py`): per row, the next hyper-connection's
coefficients from the phase-A partials, the collapse of the updated streams and its RMSNorm
(optionally also in the FP8 form the next sublayer's W8A8 GEMMs read); or, when phase A has
collapsed already, the norm in column chunks over several programs."""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import round_to_bf16
from sgl_dspark.kernels.fp8.act_quant import store_quantized_groups


@triton.jit
def _pick(t, offs_j, j: tl.constexpr):
    """Row j of fp32 t [NP, B], bit for bit (signed zeros, NaN payloads): an integer sum of the
    bit patterns with zeros elsewhere is exact on every backend and interpreter, whatever the
    tree (a float sum with a -0.0 fill is not: numpy's sum starts from +0.0)."""
    bits = tl.where(offs_j[:, None] == j, t.to(tl.int32, bitcast=True), 0)
    return tl.sum(bits, axis=0).to(tl.float32, bitcast=True)


@triton.jit
def _collapse_store(
    rs, pre, offs_j, x_in_row_ptr, offs_d, mask_d, N: tl.constexpr, ROUND_BF16: tl.constexpr
):
    """x_in = Σ_j pre[j]·rs[j, :] (rs [NP, B] fp32) with j increasing, the reference's order;
    stores it and returns the stored value in fp32."""
    x = _pick(pre[:, None], offs_j, 0) * _pick(rs, offs_j, 0)
    for j in tl.static_range(1, N):
        x = x + _pick(pre[:, None], offs_j, j) * _pick(rs, offs_j, j)
    if ROUND_BF16:
        x = round_to_bf16(x)
    tl.store(x_in_row_ptr + offs_d, x.to(x_in_row_ptr.dtype.element_ty), mask=mask_d)
    return x


@triton.jit
def _slice_sum(
    ws_ptr, cols, col_mask, NUM_SLICES: tl.constexpr, SP: tl.constexpr, RP: tl.constexpr
):
    """Σ over the D slices of one row's partial columns ``cols``: one load, one reduction whose
    tree is fixed by the shape, i.e. by (n, D)."""
    offs_s = tl.arange(0, SP)
    vals = tl.load(
        ws_ptr + offs_s[:, None] * RP + cols[None, :],
        mask=(offs_s < NUM_SLICES)[:, None] & col_mask[None, :],
        other=0.0,
    )
    return tl.sum(vals, axis=0)


@triton.jit
def _inv_rms(sumsq, count: tl.constexpr, eps):  # 1 / sqrt(sumsq / count + eps), rounded steps
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sumsq, count * 1.0) + eps))


@triton.jit
def _row_inv_rms(
    ws_ptr,
    rms_eps,
    D: tl.constexpr,
    N: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    SP: tl.constexpr,
    RP: tl.constexpr,
):
    """1 / sqrt(mean(Rs'²) + eps) over the row's n·D values, from the slices' sums of squares."""
    offs_s = tl.arange(0, SP)
    part = tl.load(ws_ptr + offs_s * RP + (2 + N) * N, mask=offs_s < NUM_SLICES, other=0.0)
    return _inv_rms(tl.sum(part, axis=0), N * D, rms_eps)


@triton.jit
def _pre_coeffs(
    ws_ptr,
    base_ptr,
    scale_ptr,
    offs_j,
    mask_j,
    hc_eps,
    rms_eps,
    D: tl.constexpr,
    N: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    SP: tl.constexpr,
    RP: tl.constexpr,
):
    """pre' [NP] of one row (sigmoid + eps) from its partials."""
    mix_pre = _slice_sum(ws_ptr, offs_j, mask_j, NUM_SLICES, SP, RP)
    inv_rms = _row_inv_rms(ws_ptr, rms_eps, D, N, NUM_SLICES, SP, RP)
    base_pre = tl.load(base_ptr + offs_j, mask=mask_j, other=0.0)
    return tl.sigmoid(mix_pre * inv_rms * tl.load(scale_ptr) + base_pre) + hc_eps


@triton.jit
def _norm_store(x, w, inv_rms_x, x_normed_row_ptr, offs_d, mask_d, ROUND_BF16: tl.constexpr):
    """Stores the normed row and returns the stored values in fp32 (zero in masked lanes)."""
    out = w * (x * inv_rms_x)
    if ROUND_BF16:
        out = round_to_bf16(out)
    tl.store(x_normed_row_ptr + offs_d, out.to(x_normed_row_ptr.dtype.element_ty), mask=mask_d)
    return out


@triton.jit
def _fp8_store(
    y,
    offs_d,
    mask_d,
    first_col,
    x_q_row_ptr,
    x_s_row_ptr,
    D: tl.constexpr,
    WIDTH: tl.constexpr,
    GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
):
    """The per-token-group FP8 form of the normed values y [WIDTH] (columns first_col + lanes;
    masked lanes are zero): the quantiser of the FP8 GEMMs on what was stored. A row narrower
    than a group is one partial group."""
    G: tl.constexpr = GROUP if GROUP <= WIDTH else WIDTH
    store_quantized_groups(
        y,
        offs_d,
        mask_d,
        first_col // GROUP,
        (D + GROUP - 1) // GROUP,
        x_q_row_ptr,
        x_s_row_ptr,
        WIDTH,
        G,
        UE8M0,
        False,
    )


@triton.jit
def finish_collapse_norm(
    row,
    streams_out_ptr,
    pre_out_ptr,
    collapse_pre_ptr,
    x_in_ptr,
    x_normed_ptr,
    partials_ptr,
    base_ptr,
    scale_ptr,
    norm_w_ptr,
    hc_eps,
    rms_eps,
    x_q_ptr,
    x_s_ptr,
    D: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    RP: tl.constexpr,
    SP: tl.constexpr,
    FINISH_BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HAS_COEFFS: tl.constexpr,
    PREV_PRE: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FP8_GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
):
    """Phase B, program (row, 0): pre' (HAS_COEFFS), x_in = Σ_j c[j]·Rs'[j] and RMSNorm_w(x_in),
    where c is pre' or, single-pass (PREV_PRE), the given previous site's pre. FP8_OUT: also
    the normed row's FP8 codes (x_q_ptr, E4M3 bit patterns) and group scales (x_s_ptr)."""
    offs_j = tl.arange(0, NP)
    mask_j = offs_j < N
    offs_f = tl.arange(0, FINISH_BLOCK)
    rows_ptr = streams_out_ptr + (row * N + offs_j[:, None]) * D
    x_in_row_ptr = x_in_ptr + row * D
    x_normed_row_ptr = x_normed_ptr + row * D
    if FINISH_BLOCK >= D:
        # Issued before the coefficient chain so that these loads overlap it.
        mask_f = offs_f < D
        rs = tl.load(
            rows_ptr + offs_f[None, :], mask=mask_j[:, None] & mask_f[None, :], other=0.0
        ).to(tl.float32)
        w = tl.load(norm_w_ptr + offs_f, mask=mask_f, other=0.0).to(tl.float32)

    if HAS_COEFFS:
        ws = partials_ptr + row * NUM_SLICES * RP
        pre = _pre_coeffs(
            ws, base_ptr, scale_ptr, offs_j, mask_j, hc_eps, rms_eps, D, N, NUM_SLICES, SP, RP
        )
        tl.store(pre_out_ptr + row * N + offs_j, pre, mask=mask_j)
    if PREV_PRE:  # single-pass mHC: the collapse uses the previous site's pre
        pre = tl.load(collapse_pre_ptr + row * N + offs_j, mask=mask_j, other=0.0)

    if FINISH_BLOCK >= D:
        # The whole row stays in registers: the stored (rounded) x_in feeds the norm directly.
        x = _collapse_store(rs, pre, offs_j, x_in_row_ptr, offs_f, mask_f, N, ROUND_BF16)
        inv_rms_x = _inv_rms(tl.sum(x * x, axis=0), D, rms_eps)
        y = _norm_store(x, w, inv_rms_x, x_normed_row_ptr, offs_f, mask_f, ROUND_BF16)
        if FP8_OUT:
            _fp8_store(
                y,
                offs_f,
                mask_f,
                0,
                x_q_ptr + row * D,
                x_s_ptr + row * ((D + FP8_GROUP - 1) // FP8_GROUP),
                D,
                FINISH_BLOCK,
                FP8_GROUP,
                UE8M0,
            )
    else:
        sumsq_x = tl.zeros([FINISH_BLOCK], tl.float32)
        for d0 in range(0, D, FINISH_BLOCK):
            mask_d = d0 + offs_f < D
            rs = tl.load(
                rows_ptr + d0 + offs_f[None, :], mask=mask_j[:, None] & mask_d[None, :], other=0.0
            ).to(tl.float32)
            x = _collapse_store(rs, pre, offs_j, x_in_row_ptr, d0 + offs_f, mask_d, N, ROUND_BF16)
            sumsq_x += x * x
        # NOTE: the norm pass re-reads x_in written above by other threads of this program.
        tl.debug_barrier()
        inv_rms_x = _inv_rms(tl.sum(sumsq_x, axis=0), D, rms_eps)
        for d0 in range(0, D, FINISH_BLOCK):
            mask_d = d0 + offs_f < D
            x = tl.load(x_in_row_ptr + d0 + offs_f, mask=mask_d, other=0.0).to(tl.float32)
            w = tl.load(norm_w_ptr + d0 + offs_f, mask=mask_d, other=0.0).to(tl.float32)
            y = _norm_store(x, w, inv_rms_x, x_normed_row_ptr, d0 + offs_f, mask_d, ROUND_BF16)
            if FP8_OUT:  # FINISH_BLOCK < D here: the chunk holds whole groups
                _fp8_store(
                    y,
                    d0 + offs_f,
                    mask_d,
                    d0,
                    x_q_ptr + row * D,
                    x_s_ptr + row * ((D + FP8_GROUP - 1) // FP8_GROUP),
                    D,
                    FINISH_BLOCK,
                    FP8_GROUP,
                    UE8M0,
                )


@triton.jit
def finish_norm_chunk(
    row,
    chunk,
    x_in_ptr,
    x_normed_ptr,
    partials_ptr,
    norm_w_ptr,
    rms_eps,
    x_q_ptr,
    x_s_ptr,
    D: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    N: tl.constexpr,
    RP: tl.constexpr,
    SP: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FP8_GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
):
    """Phase B after phase A collapsed (COLLAPSE_IN_A), program (row, chunk): RMSNorm_w of
    x_in's columns [chunk·NORM_BLOCK, +NORM_BLOCK) with the row's sum of squares from the
    slices' partials (column R + 1), and their FP8 form (FP8_OUT; a chunk holds whole groups,
    or the row is one chunk)."""
    offs_s = tl.arange(0, SP)
    part = tl.load(
        partials_ptr + (row * NUM_SLICES + offs_s) * RP + (2 + N) * N + 1,
        mask=offs_s < NUM_SLICES,
        other=0.0,
    )
    inv_rms_x = _inv_rms(tl.sum(part, axis=0), D, rms_eps)
    first_col = chunk * NORM_BLOCK
    offs_d = first_col + tl.arange(0, NORM_BLOCK)
    mask_d = offs_d < D
    x = tl.load(x_in_ptr + row * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    w = tl.load(norm_w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    y = _norm_store(x, w, inv_rms_x, x_normed_ptr + row * D, offs_d, mask_d, ROUND_BF16)
    if FP8_OUT:
        _fp8_store(
            y,
            offs_d,
            mask_d,
            first_col,
            x_q_ptr + row * D,
            x_s_ptr + row * ((D + FP8_GROUP - 1) // FP8_GROUP),
            D,
            NORM_BLOCK,
            FP8_GROUP,
            UE8M0,
        )


@triton.jit
def finish_coeffs(
    row,
    pre_out_ptr,
    post_out_ptr,
    comb_out_ptr,
    partials_ptr,
    base_ptr,
    scale_ptr,
    hc_eps,
    rms_eps,
    D: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    SINKHORN_ITERS: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    RP: tl.constexpr,
    SP: tl.constexpr,
    WITH_PRE: tl.constexpr,
):
    """Phase B, the coefficients' program: post' (sigmoid) and comb' (softmax + Sinkhorn);
    WITH_PRE also pre' (when no collapse program computes it)."""
    offs_j = tl.arange(0, NP)
    mask_j = offs_j < N
    mask_jk = mask_j[:, None] & mask_j[None, :]
    comb_idx = offs_j[:, None] * N + offs_j[None, :]
    ws = partials_ptr + row * NUM_SLICES * RP
    if WITH_PRE:
        pre = _pre_coeffs(
            ws, base_ptr, scale_ptr, offs_j, mask_j, hc_eps, rms_eps, D, N, NUM_SLICES, SP, RP
        )
        tl.store(pre_out_ptr + row * N + offs_j, pre, mask=mask_j)
    inv_rms = _row_inv_rms(ws, rms_eps, D, N, NUM_SLICES, SP, RP)
    mix_post = _slice_sum(ws, N + offs_j, mask_j, NUM_SLICES, SP, RP) * inv_rms
    offs_s = tl.arange(0, SP)
    comb_part = tl.load(
        ws + offs_s[:, None, None] * RP + 2 * N + comb_idx[None, :, :],
        mask=(offs_s < NUM_SLICES)[:, None, None] & mask_jk[None, :, :],
        other=0.0,
    )
    mix_comb = tl.sum(comb_part, axis=0) * inv_rms

    base_post = tl.load(base_ptr + N + offs_j, mask=mask_j, other=0.0)
    base_comb = tl.load(base_ptr + 2 * N + comb_idx, mask=mask_jk, other=0.0)
    post = 2.0 * tl.sigmoid(mix_post * tl.load(scale_ptr + 1) + base_post)
    logits = mix_comb * tl.load(scale_ptr + 2) + base_comb
    logits = tl.where(mask_jk, logits, -1.0e30)
    expo = tl.where(mask_jk, tl.exp(logits - tl.max(logits, axis=1)[:, None]), 0.0)
    row_sum = tl.where(mask_j, tl.sum(expo, axis=1), 1.0)
    comb = tl.where(mask_jk, expo / row_sum[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(1, SINKHORN_ITERS):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_out_ptr + row * N + offs_j, post, mask=mask_j)
    tl.store(comb_out_ptr + row * N * N + comb_idx, comb, mask=mask_jk)
