"""mHC (manifold-constrained hyper-connection) post-combine, K7 of kernels.md.

One launch closes a sublayer and opens the next one: it applies this sublayer's stream update
``Rs'[k] = post[k]·y + Σ_j C[j,k]·Rs[j]``, computes the next hyper-connection's coefficients
from ``Rs'`` (weightless RMSNorm over n·D, ``fn`` projection, sigmoid pre/post, softmax +
Sinkhorn comb), collapses ``x_in = Σ_j pre'[j]·Rs'[j]`` and applies the next weighted RMSNorm
(deepseek_v4_model.md §4.2–§4.4).

Exactness: ``Rs'`` is bit-exact against the reference on any backend (elementwise, fixed operand
order, FMA contraction off, bf16 rounding on the bits). The coefficients, ``x_in`` and the normed
input go through a split reduction and ``exp``/``sigmoid`` whose order and lowering differ from
torch, so they match the reference to a tolerance (X2); every tree is fixed by D, so a row's
result never depends on M or the grid.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Rows per program in the stream-update phase: the fn tile loaded by a program is reused for
# this many rows. D-slice width: fixes the split of every full-row reduction by D alone.
_BLOCK_M = 4
_BLOCK_D = 64
# Chunk width of the finishing program's collapse and norm passes over a full row.
_MAX_FINISH_BLOCK = 1024


class MhcPostCombineOutput(NamedTuple):
    """Outputs of :func:`mhc_post_combine` (``M`` rows, ``n`` streams, width ``D``)."""

    streams: torch.Tensor  # [M, n, D] activation dtype: updated streams Rs'
    pre: torch.Tensor  # [M, n] fp32: next sublayer's collapse weights
    post: torch.Tensor  # [M, n] fp32: next sublayer's expand weights
    comb: torch.Tensor  # [M, n, n] fp32: next sublayer's Sinkhorn-normalised mixing matrix
    x_in: torch.Tensor  # [M, D] activation dtype: Σ_j pre[j]·Rs'[j]
    x_normed: torch.Tensor  # [M, D] activation dtype: RMSNorm_w(x_in)


# ------------------------------------------------------------------------------------------------
# References (the spec). fp32 throughout; activations are cast where the unfused chain stores.
# ------------------------------------------------------------------------------------------------


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
        new_streams, fn, base, scale,
        hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, rms_eps=rms_eps,
    )
    x_in = mhc_collapse_ref(new_streams, pre2)
    x_normed = rms_norm_ref(x_in, norm_weight, rms_eps)
    return MhcPostCombineOutput(new_streams, pre2, post2, comb2, x_in, x_normed)


# ------------------------------------------------------------------------------------------------
# Triton kernel
# ------------------------------------------------------------------------------------------------


@triton.jit
def _round_to_bf16(x):
    """fp32 -> nearest-even bf16 value, kept in fp32. Portable: the interpreter's own fp32->bf16
    cast truncates (kernels.md §0.4), and the later store of an exact bf16 value is lossless."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _mhc_finish_row(
    row, streams_out_ptr, pre_out_ptr, post_out_ptr, comb_out_ptr, x_in_ptr, x_normed_ptr,
    partials_ptr, base_ptr, scale_ptr, norm_w_ptr,
    hc_eps, rms_eps,
    D: tl.constexpr, NUM_SLICES: tl.constexpr, SINKHORN_ITERS: tl.constexpr,
    N: tl.constexpr, NP: tl.constexpr, FINISH_BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """Coefficients, collapse and norm of one row, after every D-slice published its partials."""
    R: tl.constexpr = (2 + N) * N
    offs_j = tl.arange(0, NP)
    mask_j = offs_j < N
    mask_jk = mask_j[:, None] & mask_j[None, :]
    comb_idx = offs_j[:, None] * N + offs_j[None, :]

    # Partials are summed in slice order, so the tree depends on D only (never on M or grid).
    mix_pre = tl.zeros([NP], tl.float32)
    mix_post = tl.zeros([NP], tl.float32)
    mix_comb = tl.zeros([NP, NP], tl.float32)
    sumsq = 0.0
    for s in range(NUM_SLICES):
        ws = partials_ptr + (row * NUM_SLICES + s) * (R + 1)
        # NOTE: other programs wrote these; ".cg" skips L1 (the acquiring atomic orders them).
        mix_pre += tl.load(ws + offs_j, mask=mask_j, other=0.0, cache_modifier=".cg")
        mix_post += tl.load(ws + N + offs_j, mask=mask_j, other=0.0, cache_modifier=".cg")
        mix_comb += tl.load(ws + 2 * N + comb_idx, mask=mask_jk, other=0.0, cache_modifier=".cg")
        sumsq += tl.load(ws + R, cache_modifier=".cg")
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sumsq, (N * D) * 1.0) + rms_eps))
    mix_pre = mix_pre * inv_rms
    mix_post = mix_post * inv_rms
    mix_comb = mix_comb * inv_rms

    base_pre = tl.load(base_ptr + offs_j, mask=mask_j, other=0.0)
    base_post = tl.load(base_ptr + N + offs_j, mask=mask_j, other=0.0)
    base_comb = tl.load(base_ptr + 2 * N + comb_idx, mask=mask_jk, other=0.0)
    pre = tl.sigmoid(mix_pre * tl.load(scale_ptr) + base_pre) + hc_eps
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
    tl.store(pre_out_ptr + row * N + offs_j, pre, mask=mask_j)
    tl.store(post_out_ptr + row * N + offs_j, post, mask=mask_j)
    tl.store(comb_out_ptr + row * N * N + comb_idx, comb, mask=mask_jk)

    # Collapse over the full row, reading Rs' back as stored (rounded), like the unfused chain.
    act_ty = x_in_ptr.dtype.element_ty
    sumsq_x = tl.zeros([FINISH_BLOCK], tl.float32)
    for d0 in range(0, D, FINISH_BLOCK):
        offs_d = d0 + tl.arange(0, FINISH_BLOCK)
        mask_d = offs_d < D
        x = tl.zeros([FINISH_BLOCK], tl.float32)
        for j in tl.static_range(N):
            pre_j = tl.sum(tl.where(offs_j == j, pre, 0.0), axis=0)
            src = tl.load(streams_out_ptr + (row * N + j) * D + offs_d, mask=mask_d, other=0.0,
                          cache_modifier=".cg")
            x = x + pre_j * src.to(tl.float32)
        if ROUND_BF16:
            x = _round_to_bf16(x)
        tl.store(x_in_ptr + row * D + offs_d, x.to(act_ty), mask=mask_d)
        sumsq_x += x * x
    # NOTE: the norm pass re-reads x_in written above by other threads of this program.
    tl.debug_barrier()
    inv_rms_x = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(sumsq_x, axis=0), D * 1.0) + rms_eps))
    for d0 in range(0, D, FINISH_BLOCK):
        offs_d = d0 + tl.arange(0, FINISH_BLOCK)
        mask_d = offs_d < D
        x = tl.load(x_in_ptr + row * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        w = tl.load(norm_w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        out = w * (x * inv_rms_x)
        if ROUND_BF16:
            out = _round_to_bf16(out)
        tl.store(x_normed_ptr + row * D + offs_d, out.to(act_ty), mask=mask_d)


@triton.jit
def _mhc_post_combine_kernel(
    streams_ptr, y_ptr, post_ptr, comb_ptr, fn_ptr, base_ptr, scale_ptr, norm_w_ptr,
    streams_out_ptr, pre_out_ptr, post_out_ptr, comb_out_ptr, x_in_ptr, x_normed_ptr,
    partials_ptr, counters_ptr,
    M, hc_eps, rms_eps,
    D: tl.constexpr, NUM_SLICES: tl.constexpr, SINKHORN_ITERS: tl.constexpr,
    N: tl.constexpr, NP: tl.constexpr, RP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, FINISH_BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Grid (row tiles, D slices). Phase A: each program updates its D-slice of BLOCK_M rows and
    publishes partial fn-projections and sums of squares. The last slice to arrive for a row tile
    (atomic counter) runs phase B for those rows and resets the counter to zero."""
    R: tl.constexpr = (2 + N) * N
    tile = tl.program_id(0)
    slice_id = tl.program_id(1)
    act_ty = streams_out_ptr.dtype.element_ty

    offs_j = tl.arange(0, NP)
    mask_j = offs_j < N
    offs_d = slice_id * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_r = tl.arange(0, RP)
    mask_r = offs_r < R
    mask_jd = mask_j[:, None] & mask_d[None, :]
    # fn[r, j·D + d]: the stream-major flatten of §4.2.
    fn_offs = offs_r[:, None, None] * (N * D) + offs_j[None, :, None] * D + offs_d[None, None, :]
    fn_tile = tl.load(fn_ptr + fn_offs, mask=mask_r[:, None, None] & mask_jd[None, :, :], other=0.0)

    for i in range(BLOCK_M):
        row = (tile * BLOCK_M + i).to(tl.int64)
        row_ok = row < M
        y = tl.load(y_ptr + row * D + offs_d, mask=mask_d & row_ok, other=0.0).to(tl.float32)
        post = tl.load(post_ptr + row * N + offs_j, mask=mask_j & row_ok, other=0.0)
        acc = post[:, None] * y[None, :]
        for j in tl.static_range(N):
            c = tl.load(comb_ptr + row * N * N + j * N + offs_j, mask=mask_j & row_ok, other=0.0)
            src = tl.load(streams_ptr + (row * N + j) * D + offs_d, mask=mask_d & row_ok, other=0.0)
            acc = acc + c[:, None] * src.to(tl.float32)[None, :]
        if ROUND_BF16:
            acc = _round_to_bf16(acc)
        out_offs = (row * N + offs_j[:, None]) * D + offs_d[None, :]
        tl.store(streams_out_ptr + out_offs, acc.to(act_ty), mask=mask_jd & row_ok)
        sumsq = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
        mix = tl.sum(tl.sum(fn_tile * acc[None, :, :], axis=2), axis=1)
        ws = partials_ptr + (row * NUM_SLICES + slice_id) * (R + 1)
        tl.store(ws + offs_r, mix, mask=mask_r & row_ok)
        tl.store(ws + R, sumsq, mask=row_ok)

    # NOTE: every thread's stores must precede the releasing atomic of this program.
    tl.debug_barrier()
    arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
    if arrived == NUM_SLICES - 1:
        for i in range(BLOCK_M):
            row = (tile * BLOCK_M + i).to(tl.int64)
            if row < M:
                _mhc_finish_row(
                    row, streams_out_ptr, pre_out_ptr, post_out_ptr, comb_out_ptr, x_in_ptr,
                    x_normed_ptr, partials_ptr, base_ptr, scale_ptr, norm_w_ptr,
                    hc_eps, rms_eps, D, NUM_SLICES, SINKHORN_ITERS,
                    N, NP, FINISH_BLOCK, ROUND_BF16,
                )
        tl.atomic_xchg(counters_ptr + tile, 0)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_tensor(
    name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
    device: torch.device,
) -> None:
    _require(tuple(t.shape) == shape, f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    _require(t.dtype in dtypes, f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    _require(t.is_contiguous(), f"{name}: must be contiguous")
    _require(t.device == device, f"{name}: expected device {device}, got {t.device}")


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
    counters: torch.Tensor | None = None,
    out: MhcPostCombineOutput | None = None,
) -> MhcPostCombineOutput:
    """Fused mhc_post_combine_ref (one Triton launch).

    Args:
        streams: [M, n, D] fp32 or bf16, contiguous: this sublayer's input streams Rs.
        y: [M, D], streams' dtype: this sublayer's output.
        post, comb: [M, n] / [M, n, n] fp32: this sublayer's expand weights and mixing matrix.
        fn, base, scale: fp32 [(2+n)·n, n·D] / [(2+n)·n] / [3]: the NEXT hyper-connection.
        norm_weight: [D] fp32 or bf16: the NEXT sublayer's RMSNorm weight.
        hc_eps, sinkhorn_iters (>= 1), rms_eps: §4.2 constants.
        counters: optional int32 [>= ceil(M/4)] scratch that is zero on entry and is left zero
            on exit (lets a CUDA graph hold it instead of zero-filling a new one per call).
        out: optional preallocated outputs (shapes/dtypes as returned).
    Returns:
        MhcPostCombineOutput(streams', pre', post', comb', x_in, x_normed).
    """
    _require(streams.dim() == 3, f"streams: expected [M, n, D], got shape {tuple(streams.shape)}")
    m, n, d = streams.shape
    dev, act = streams.device, streams.dtype
    _require(act in (torch.float32, torch.bfloat16), f"streams: dtype must be fp32/bf16, got {act}")
    _require(n >= 1 and d >= 1, f"streams: n and D must be positive, got n={n}, D={d}")
    _require(sinkhorn_iters >= 1, f"sinkhorn_iters: must be >= 1, got {sinkhorn_iters}")
    r = (2 + n) * n
    f32 = (torch.float32,)
    _check_tensor("streams", streams, (m, n, d), (act,), dev)
    _check_tensor("y", y, (m, d), (act,), dev)
    _check_tensor("post", post, (m, n), f32, dev)
    _check_tensor("comb", comb, (m, n, n), f32, dev)
    _check_tensor("fn", fn, (r, n * d), f32, dev)
    _check_tensor("base", base, (r,), f32, dev)
    _check_tensor("scale", scale, (3,), f32, dev)
    _check_tensor("norm_weight", norm_weight, (d,), (torch.float32, torch.bfloat16), dev)

    if out is None:
        out = MhcPostCombineOutput(
            torch.empty_like(streams),
            torch.empty(m, n, dtype=torch.float32, device=dev),
            torch.empty(m, n, dtype=torch.float32, device=dev),
            torch.empty(m, n, n, dtype=torch.float32, device=dev),
            torch.empty(m, d, dtype=act, device=dev),
            torch.empty(m, d, dtype=act, device=dev),
        )
    else:
        for name, t, shape, dt in zip(
            out._fields, out,
            [(m, n, d), (m, n), (m, n), (m, n, n), (m, d), (m, d)],
            [act, torch.float32, torch.float32, torch.float32, act, act],
        ):
            _check_tensor(f"out.{name}", t, shape, (dt,), dev)
    if m == 0:
        return out

    num_tiles = triton.cdiv(m, _BLOCK_M)
    num_slices = triton.cdiv(d, _BLOCK_D)
    if counters is None:
        counters = torch.zeros(num_tiles, dtype=torch.int32, device=dev)
    _require(counters.dtype == torch.int32 and counters.is_contiguous() and counters.device == dev
             and counters.numel() >= num_tiles,
             f"counters: expected contiguous int32 with >= {num_tiles} elements on {dev}")
    partials = torch.empty(m, num_slices, r + 1, dtype=torch.float32, device=dev)
    _mhc_post_combine_kernel[(num_tiles, num_slices)](
        streams, y, post, comb, fn, base, scale, norm_weight,
        *out, partials, counters,
        m, float(hc_eps), float(rms_eps),
        D=d, NUM_SLICES=num_slices, SINKHORN_ITERS=int(sinkhorn_iters),
        N=n, NP=triton.next_power_of_2(n), RP=triton.next_power_of_2(r),
        BLOCK_M=_BLOCK_M, BLOCK_D=_BLOCK_D,
        FINISH_BLOCK=min(_MAX_FINISH_BLOCK, triton.next_power_of_2(d)),
        ROUND_BF16=act == torch.bfloat16,
        num_warps=4, enable_fp_fusion=False,
    )
    return out
