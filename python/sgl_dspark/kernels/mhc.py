"""mHC (manifold-constrained hyper-connection) post-combine, K7 of kernels.md.

One call closes a sublayer and opens the next one: it applies this sublayer's stream update
``Rs'[k] = post[k]·y + Σ_j C[j,k]·Rs[j]``, computes the next hyper-connection's coefficients
from ``Rs'`` (weightless RMSNorm over n·D, ``fn`` projection, sigmoid pre/post, softmax +
Sinkhorn comb), collapses ``x_in = Σ_j pre'[j]·Rs'[j]`` and applies the next weighted RMSNorm
(deepseek_v4_model.md §4.2–§4.4). Two launches of one kernel, no atomics, no host reads:
  A. grid (row tiles, D slices): Rs' on the slice, and per row the slice's partial fn projection
     and sum of squares, into an fp32 scratch [M, slices, RP].
  B. grid (M, 2): (row, 0) sums the row's partials into pre', then collapses and norms the whole
     row; (row, 1) forms post' and comb', keeping Sinkhorn off the collapse's critical path.

Exactness: ``Rs'`` is bit-exact against the reference on any backend (elementwise, fixed operand
order, FMA contraction off, bf16 rounding on the bits). The coefficients, ``x_in`` and the normed
input go through split reductions and ``exp``/``sigmoid`` whose order and lowering differ from
torch: a tolerance (X2). Every tree is fixed by (n, D) (slice width, partial layout and warp
counts depend on n and D only; phase A runs the same unrolled code for each row of a tile), so
a row's result never depends on M, on its position in the batch or on the grid.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import check_tensor, require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers
from sgl_dspark.kernels._triton_utils import round_to_bf16 as _round_to_bf16

# Phase A D-slice width: aims at 64 slices (programs at M = 1), within these bounds.
_MIN_BLOCK_D, _MAX_BLOCK_D = 16, 64
# Phase A rows per program: grows with M so that fn (r·n·D fp32, 1.5 MB at D = 4096) is read by
# about _TARGET_ROW_TILES row tiles, capped so a program's unrolled row loop stays short.
_TARGET_ROW_TILES, _MAX_BLOCK_M = 4, 16
# Phase B: rows up to this width stay in registers; wider ones are chunked (norm re-reads x_in).
_MAX_FINISH_BLOCK = 8192


class MhcPostCombineOutput(NamedTuple):
    """Outputs of :func:`mhc_post_combine` (``M`` rows, ``n`` streams, width ``D``)."""

    streams: torch.Tensor  # [M, n, D] activation dtype: updated streams Rs'
    pre: torch.Tensor  # [M, n] fp32: next sublayer's collapse weights
    post: torch.Tensor  # [M, n] fp32: next sublayer's expand weights
    comb: torch.Tensor  # [M, n, n] fp32: next sublayer's Sinkhorn-normalised mixing matrix
    x_in: torch.Tensor  # [M, D] activation dtype: Σ_j pre[j]·Rs'[j]
    x_normed: torch.Tensor  # [M, D] activation dtype: RMSNorm_w(x_in)


# ---- References (the spec): fp32, activations cast where the unfused chain stores them ----


def mhc_coeffs_ref(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_coeffs of deepseek_v4_model.md §4.2.

    Args: streams [M, n, D]; fn [(2+n)·n, n·D]; base [(2+n)·n]; scale [3] (pre, post, comb).
    Returns fp32 (pre [M, n], post [M, n], comb [M, n, n]) with comb[j, k] weighting source
    stream j into destination stream k.
    """
    m, n, d = streams.shape
    u = streams.reshape(m, n * d).float()
    u = u * torch.rsqrt(u.square().mean(-1, keepdim=True) + rms_eps)
    mix = torch.nn.functional.linear(u, fn.float())
    pre_logit, post_logit, comb_logit = mix.split([n, n, n * n], dim=-1)
    pre_base, post_base, comb_base = base.float().split([n, n, n * n])
    pre_scale, post_scale, comb_scale = scale.float().unbind(0)
    pre = torch.sigmoid(pre_logit * pre_scale + pre_base) + hc_eps
    post = 2 * torch.sigmoid(post_logit * post_scale + post_base)
    comb_logit = comb_logit.view(m, n, n) * comb_scale + comb_base.view(n, n)
    comb = torch.softmax(comb_logit, dim=-1) + hc_eps
    # Sinkhorn: the softmax was the first row step; columns are normalised last.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def mhc_post_ref(
    streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Stream update Rs'[k] = post[k]·y + Σ_j comb[j,k]·Rs[j] (§4.3) in fp32, cast to Rs.dtype.

    Args: streams [M, n, D]; y [M, D]; post [M, n]; comb [M, n, n]. Returns [M, n, D].
    The sum runs over j in increasing order after the post term (the kernel's operand order).
    """
    acc = post.float().unsqueeze(-1) * y.float().unsqueeze(1)
    for j in range(streams.shape[1]):
        acc = acc + comb[:, j, :].float().unsqueeze(-1) * streams[:, j].float().unsqueeze(1)
    return acc.to(streams.dtype)


def mhc_collapse_ref(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x_in = Σ_j pre[j]·Rs[j] in fp32 (j increasing), cast to Rs's dtype. [M, n, D] -> [M, D]."""
    acc = pre[:, 0].float().unsqueeze(-1) * streams[:, 0].float()
    for j in range(1, streams.shape[1]):
        acc = acc + pre[:, j].float().unsqueeze(-1) * streams[:, j].float()
    return acc.to(streams.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm_w(x) = w ⊙ (x_f32 · rsqrt(mean(x_f32²) + eps)), multiplied in fp32, cast once."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def mhc_post_combine_ref(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
) -> MhcPostCombineOutput:
    """Unfused chain: mhc_post_ref, then mhc_coeffs_ref of the next sublayer on the updated
    (stored, i.e. dtype-rounded) streams, its collapse, and its RMSNorm."""
    new_streams = mhc_post_ref(streams, y, post, comb)
    pre2, post2, comb2 = mhc_coeffs_ref(
        new_streams, fn, base, scale, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, rms_eps=rms_eps
    )
    x_in = mhc_collapse_ref(new_streams, pre2)
    x_normed = rms_norm_ref(x_in, norm_weight, rms_eps)
    return MhcPostCombineOutput(new_streams, pre2, post2, comb2, x_in, x_normed)


def mhc_pre_ref(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
) -> MhcPostCombineOutput:
    """Open the first sublayer: coeffs, collapse and RMSNorm of the (unchanged) streams."""
    pre, post, comb = mhc_coeffs_ref(
        streams, fn, base, scale, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, rms_eps=rms_eps
    )
    x_in = mhc_collapse_ref(streams, pre)
    return MhcPostCombineOutput(
        streams, pre, post, comb, x_in, rms_norm_ref(x_in, norm_weight, rms_eps)
    )


# ---- Triton kernel ------------------------------------------------------------------------------


@triton.jit
def _pick(t, offs_j, j: tl.constexpr):
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
def _stream_update_and_partials(
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
    PDL: tl.constexpr,
):
    """Phase A, program (row tile, D slice): Rs' of BLOCK_M rows on the slice; per row, the
    slice's partial fn projection (partials columns < R) and sum of squares (column R).
    Without HAS_UPDATE (opening only) Rs' is Rs itself and nothing is stored but partials."""
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
    # fn[r, j·D + d]: the stream-major flatten of §4.2. Loaded once, reused by every row.
    fn_offs = offs_r[:, None, None] * (N * D) + offs_j[None, :, None] * D + offs_d[None, None, :]
    fn_tile = tl.load(fn_ptr + fn_offs, mask=mask_r[:, None, None] & mask_jd[None, :, :], other=0.0)

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
                acc = acc + _pick(comb, offs_j, j)[:, None] * _pick(src, offs_j, j)[None, :]
            if ROUND_BF16:
                acc = _round_to_bf16(acc)
            out_offs = (row * N + offs_j[:, None]) * D + offs_d[None, :]
            tl.store(streams_out_ptr + out_offs, acc.to(act_ty), mask=mask_jd & (row < M))
        else:
            acc = src  # opening only: the streams are read as they are (no store)
        sumsq = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
        mix = tl.sum(tl.sum(fn_tile * acc[None, :, :], axis=2), axis=1)
        part = tl.where(offs_r == R, sumsq, mix)
        tl.store(partials_ptr + (row * NUM_SLICES + slice_id) * RP + offs_r, part, mask=row < M)
        if i + 1 < BLOCK_M:
            y, post, comb, src = y_next, post_next, comb_next, src_next


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
def _collapse_store(
    rs, pre, offs_j, x_in_row_ptr, offs_d, mask_d, N: tl.constexpr, ROUND_BF16: tl.constexpr
):
    """x_in = Σ_j pre[j]·rs[j, :] (rs [NP, B] fp32) with j increasing, the reference's order;
    stores it and returns the stored value in fp32."""
    x = _pick(pre[:, None], offs_j, 0) * _pick(rs, offs_j, 0)
    for j in tl.static_range(1, N):
        x = x + _pick(pre[:, None], offs_j, j) * _pick(rs, offs_j, j)
    if ROUND_BF16:
        x = _round_to_bf16(x)
    tl.store(x_in_row_ptr + offs_d, x.to(x_in_row_ptr.dtype.element_ty), mask=mask_d)
    return x


@triton.jit
def _norm_store(x, w, inv_rms_x, x_normed_row_ptr, offs_d, mask_d, ROUND_BF16: tl.constexpr):
    out = w * (x * inv_rms_x)
    if ROUND_BF16:
        out = _round_to_bf16(out)
    tl.store(x_normed_row_ptr + offs_d, out.to(x_normed_row_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _finish_collapse_norm(
    row,
    streams_out_ptr,
    pre_out_ptr,
    x_in_ptr,
    x_normed_ptr,
    partials_ptr,
    base_ptr,
    scale_ptr,
    norm_w_ptr,
    hc_eps,
    rms_eps,
    D: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    RP: tl.constexpr,
    SP: tl.constexpr,
    FINISH_BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Phase B, program (row, 0): pre', x_in = Σ_j pre'[j]·Rs'[j] and RMSNorm_w(x_in)."""
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

    ws = partials_ptr + row * NUM_SLICES * RP
    mix_pre = _slice_sum(ws, offs_j, mask_j, NUM_SLICES, SP, RP)
    inv_rms = _row_inv_rms(ws, rms_eps, D, N, NUM_SLICES, SP, RP)
    base_pre = tl.load(base_ptr + offs_j, mask=mask_j, other=0.0)
    pre = tl.sigmoid(mix_pre * inv_rms * tl.load(scale_ptr) + base_pre) + hc_eps
    tl.store(pre_out_ptr + row * N + offs_j, pre, mask=mask_j)

    if FINISH_BLOCK >= D:
        # The whole row stays in registers: the stored (rounded) x_in feeds the norm directly.
        x = _collapse_store(rs, pre, offs_j, x_in_row_ptr, offs_f, mask_f, N, ROUND_BF16)
        inv_rms_x = _inv_rms(tl.sum(x * x, axis=0), D, rms_eps)
        _norm_store(x, w, inv_rms_x, x_normed_row_ptr, offs_f, mask_f, ROUND_BF16)
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
            _norm_store(x, w, inv_rms_x, x_normed_row_ptr, d0 + offs_f, mask_d, ROUND_BF16)


@triton.jit
def _finish_coeffs(
    row,
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
):
    """Phase B, program (row, 1): post' (sigmoid) and comb' (softmax + Sinkhorn)."""
    offs_j = tl.arange(0, NP)
    mask_j = offs_j < N
    mask_jk = mask_j[:, None] & mask_j[None, :]
    comb_idx = offs_j[:, None] * N + offs_j[None, :]
    ws = partials_ptr + row * NUM_SLICES * RP
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


@triton.jit
def _mhc_post_combine_kernel(
    streams_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    fn_ptr,
    base_ptr,
    scale_ptr,
    norm_w_ptr,
    streams_out_ptr,
    pre_out_ptr,
    post_out_ptr,
    comb_out_ptr,
    x_in_ptr,
    x_normed_ptr,
    partials_ptr,
    M,
    hc_eps,
    rms_eps,
    PHASE: tl.constexpr,
    D: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    SINKHORN_ITERS: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    RP: tl.constexpr,
    SP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FINISH_BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HAS_UPDATE: tl.constexpr,
    PDL: tl.constexpr,
):
    """PHASE 0: grid (row tiles, D slices), see _stream_update_and_partials. PHASE 1: grid
    (M, 2), program (row, 0) collapses and norms, program (row, 1) forms post' and comb'."""
    if PHASE == 0:
        _stream_update_and_partials(
            streams_ptr,
            y_ptr,
            post_ptr,
            comb_ptr,
            fn_ptr,
            streams_out_ptr,
            partials_ptr,
            M,
            D,
            NUM_SLICES,
            N,
            NP,
            RP,
            BLOCK_M,
            BLOCK_D,
            ROUND_BF16,
            HAS_UPDATE,
            PDL,
        )
    else:
        wait_for_producers(PDL)  # phase A's partials and Rs' are read first
        row = tl.program_id(0).to(tl.int64)
        if tl.program_id(1) == 0:
            _finish_collapse_norm(
                row,
                streams_out_ptr,
                pre_out_ptr,
                x_in_ptr,
                x_normed_ptr,
                partials_ptr,
                base_ptr,
                scale_ptr,
                norm_w_ptr,
                hc_eps,
                rms_eps,
                D,
                NUM_SLICES,
                N,
                NP,
                RP,
                SP,
                FINISH_BLOCK,
                ROUND_BF16,
            )
        else:
            _finish_coeffs(
                row,
                post_out_ptr,
                comb_out_ptr,
                partials_ptr,
                base_ptr,
                scale_ptr,
                hc_eps,
                rms_eps,
                D,
                NUM_SLICES,
                SINKHORN_ITERS,
                N,
                NP,
                RP,
                SP,
            )


# ---- Launcher -----------------------------------------------------------------------------------


def _slice_width(d: int) -> int:
    """Phase-A D-slice width: a function of D only (it fixes the split reductions' trees)."""
    return min(_MAX_BLOCK_D, max(_MIN_BLOCK_D, triton.next_power_of_2(triton.cdiv(d, 64))))


def _rows_per_program(m: int) -> int:
    """Phase-A rows per program: 1 at small M (most programs), more at large M (fewer fn reads).
    Free to depend on M: a row's arithmetic is the same whatever the tile size."""
    return min(_MAX_BLOCK_M, triton.next_power_of_2(triton.cdiv(m, _TARGET_ROW_TILES)))


def mhc_post_combine(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
    out: MhcPostCombineOutput | None = None,
) -> MhcPostCombineOutput:
    """Fused mhc_post_combine_ref (two launches of one Triton kernel, no host sync).

    Args:
        streams: [M, n, D] fp32 or bf16, contiguous: this sublayer's input streams Rs.
        y: [M, D], streams' dtype: this sublayer's output.
        post, comb: [M, n] / [M, n, n] fp32: this sublayer's expand weights and mixing matrix.
        fn, base, scale: fp32 [(2+n)·n, n·D] / [(2+n)·n] / [3]: the NEXT hyper-connection.
        norm_weight: [D] fp32 or bf16: the NEXT sublayer's RMSNorm weight.
        hc_eps, sinkhorn_iters (>= 1), rms_eps: §4.2 constants.
        out: optional preallocated outputs (shapes/dtypes as returned).
    Returns:
        MhcPostCombineOutput(streams', pre', post', comb', x_in, x_normed).
    """
    return _launch(
        streams,
        (y, post, comb),
        fn,
        base,
        scale,
        norm_weight,
        hc_eps=hc_eps,
        sinkhorn_iters=sinkhorn_iters,
        rms_eps=rms_eps,
        out=out,
    )


def mhc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
    out: MhcPostCombineOutput | None = None,
) -> MhcPostCombineOutput:
    """Fused mhc_pre_ref (open the first sublayer): mhc_post_combine's launches without the
    stream update, so bit-identical to it with post = 0 and comb = I. The result's ``streams``
    is the input itself (``out.streams`` is not written). Arguments as mhc_post_combine."""
    return _launch(
        streams,
        None,
        fn,
        base,
        scale,
        norm_weight,
        hc_eps=hc_eps,
        sinkhorn_iters=sinkhorn_iters,
        rms_eps=rms_eps,
        out=out,
    )


def _launch(
    streams: torch.Tensor,
    update: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
    out: MhcPostCombineOutput | None,
) -> MhcPostCombineOutput:
    require(streams.dim() == 3, f"streams: expected [M, n, D], got shape {tuple(streams.shape)}")
    m, n, d = streams.shape
    dev, act = streams.device, streams.dtype
    require(act in (torch.float32, torch.bfloat16), f"streams: dtype must be fp32/bf16, got {act}")
    require(n >= 1 and d >= 1, f"streams: n and D must be positive, got n={n}, D={d}")
    require(sinkhorn_iters >= 1, f"sinkhorn_iters: must be >= 1, got {sinkhorn_iters}")
    r = (2 + n) * n
    f32 = (torch.float32,)
    check_tensor("streams", streams, (m, n, d), (act,), dev)
    if update is not None:
        y, post, comb = update
        check_tensor("y", y, (m, d), (act,), dev)
        check_tensor("post", post, (m, n), f32, dev)
        check_tensor("comb", comb, (m, n, n), f32, dev)
    else:  # never read by the kernel (HAS_UPDATE false)
        y = post = comb = streams
    check_tensor("fn", fn, (r, n * d), f32, dev)
    check_tensor("base", base, (r,), f32, dev)
    check_tensor("scale", scale, (3,), f32, dev)
    check_tensor("norm_weight", norm_weight, (d,), (torch.float32, torch.bfloat16), dev)

    out_shapes = [(m, n, d), (m, n), (m, n), (m, n, n), (m, d), (m, d)]
    out_dtypes = [act, torch.float32, torch.float32, torch.float32, act, act]
    if out is None:
        out = MhcPostCombineOutput(
            *(torch.empty(shape, dtype=dt, device=dev) for shape, dt in zip(out_shapes, out_dtypes))
        )
    for name, t, shape, dt in zip(out._fields, out, out_shapes, out_dtypes):
        check_tensor(f"out.{name}", t, shape, (dt,), dev)
    if update is None:
        out = out._replace(streams=streams)
    if m == 0:
        return out

    block_d, block_m = _slice_width(d), _rows_per_program(m)
    num_slices = triton.cdiv(d, block_d)
    rp = triton.next_power_of_2(r + 1)  # fn projection columns, then the sum of squares
    finish_block = min(_MAX_FINISH_BLOCK, triton.next_power_of_2(d))
    partials = torch.empty(m, num_slices, rp, dtype=torch.float32, device=dev)
    args = (
        streams,
        y,
        post,
        comb,
        fn,
        base,
        scale,
        norm_weight,
        *out,
        partials,
        m,
        float(hc_eps),
        float(rms_eps),
    )
    meta = dict(
        D=d,
        NUM_SLICES=num_slices,
        SINKHORN_ITERS=int(sinkhorn_iters),
        N=n,
        NP=triton.next_power_of_2(n),
        RP=rp,
        SP=triton.next_power_of_2(num_slices),
        BLOCK_D=block_d,
        FINISH_BLOCK=finish_block,
        ROUND_BF16=act == torch.bfloat16,
        HAS_UPDATE=update is not None,
        enable_fp_fusion=False,
        **programmatic_launch(_mhc_post_combine_kernel, dev),
    )
    _mhc_post_combine_kernel[(triton.cdiv(m, block_m), num_slices)](
        *args, PHASE=0, BLOCK_M=block_m, num_warps=4, **meta
    )
    # BLOCK_M is unused by phase B: a fixed value keeps one compiled variant for every M.
    # About 512 row elements per warp, i.e. n fp32 stream values of 16 columns per thread.
    _mhc_post_combine_kernel[(m, 2)](
        *args, PHASE=1, BLOCK_M=1, num_warps=min(16, max(4, finish_block // 512)), **meta
    )
    return out
