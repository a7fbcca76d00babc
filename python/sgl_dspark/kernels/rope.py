"""K13: interleaved RoPE on the trailing channels of each head while writing the full row.

DeepSeek-V4 layout (deepseek_v4_model.md §3): a head of D channels is ``[nope (D - rd) | rope (rd)]``;
inside the rope tail the pairs are interleaved, pair i = channels (D - rd + 2i, D - rd + 2i + 1):
    x'[2i]   = a * cos_i - b * sin_i
    x'[2i+1] = a * sin_i + b * cos_i          (a = x[2i], b = x[2i+1], fp32 maths)
The inverse rotation (attention output) uses -sin. The nope channels are copied bit for bit; the
rotated tail is rounded once to the input dtype (round-to-nearest-even). The output buffer may
hold a different head count: heads beyond the input's are written as zeros (attention kernels that
want a head multiple), heads beyond the output's are dropped (un-padding the attention output).

Optional pre-norm (``norm_eps``): each (token, head) row of D channels is first RMS-normalised
over all D channels as `kernels/rmsnorm.py` does (the q heads' weightless norm, or the KV row's
weighted one), rounded to x's dtype where the unfused `rms_norm` -> `rope_tail` chain stores it;
the nope channels are then written normed and the tail rotated from the rounded normed values.
This saves the norm's launch: H200, CUDA graphs, bf16, M = 1, norm + rope went from 2.03 to 1.53
us for q (16 heads of 512, padded to 64) and from 1.70 to 1.02 us for the KV row (scatter).

Exactness: X1 without the norm. Each product and the final add/sub are separately rounded fp32
operations, as in the reference (the kernel is launched with FMA contraction disabled), and the
bf16 rounding is done on the bits (RNE), so the kernel equals the reference bit for bit on GPU and
in the interpreter (whose own fp32 -> bf16 cast truncates).
With the norm: X2 against `rms_norm_ref` -> `rope_tail_ref`. The sum of squares is reduced in the
kernel's own order (nope part and rope pairs summed separately, then added; the tree depends on D
and on the launch's head block and warps, themselves fixed by D and H_out, never on the token
count M, so a row's bits depend neither on M nor on the other rows) and the rsqrt is `tl.rsqrt`,
so rstd may differ from torch's in its last bits. Every later step is the reference's: weighted
`dtype(w * (x * rstd))`, weightless `dtype(x * dtype(rstd))`, each an fp32 operation rounded to
nearest even, then the X1 rotation of the rounded normed values. Given the kernel's own normed
row, the output is the reference rotation bit for bit. bf16 outputs differ from the composition
only where rstd's last bit moves a rounding (1 element in 2.8M in tests), fp32 by a few ulps.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import (
    interpreted,
    programmatic_launch,
    round_bf16_native_or_bits,
    round_to_bf16,
    wait_for_producers,
)
from sgl_dspark.kernels.rmsnorm import rms_norm_ref

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
X_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # `round_to_x`


def rope_tail_ref(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    out_heads: int | None = None,
    norm_eps: float | None = None,
    norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: rotate the trailing ``rd = 2 * cos.shape[1]`` channels of every head.

    x [M, H, D] (bf16/fp16/fp32), cos/sin fp32 [M, rd/2] (positions already applied).
    norm_eps: first apply `rms_norm_ref(x, norm_weight, norm_eps)` to every (token, head) row of
    D channels (norm_weight [D] or None for the weightless norm), i.e. the unfused composition
    `rms_norm` -> `rope_tail`; `rope_tail` with the same arguments is X2 against it (module).
    Returns [M, out_heads or H, D] in x's dtype.
    """
    if norm_eps is not None:
        if inverse:
            raise ValueError("norm_eps (pre-norm) is not supported with inverse=True")
        x = rms_norm_ref(x, norm_weight, norm_eps)
    elif norm_weight is not None:
        raise ValueError("norm_weight needs norm_eps")
    num_tokens, num_heads, head_dim = x.shape
    rope_dim = 2 * cos.shape[1]
    xf = x.float()
    a, b = xf[..., head_dim - rope_dim :: 2], xf[..., head_dim - rope_dim + 1 :: 2]
    c, s = cos[:, None, :], sin[:, None, :]
    if inverse:
        s = -s
    rotated = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    y = torch.cat([x[..., : head_dim - rope_dim], rotated.to(x.dtype)], dim=-1)
    out_heads = num_heads if out_heads is None else out_heads
    out = torch.zeros((num_tokens, out_heads, head_dim), dtype=x.dtype, device=x.device)
    kept = min(num_heads, out_heads)
    out[:, :kept] = y[:, :kept]
    return out


@triton.jit
def round_to_x(v, X_KIND: tl.constexpr, ON_BITS: tl.constexpr):
    """fp32 -> the nearest-even value of x's dtype (X_KIND 0 fp32, 1 bf16, 2 fp16), kept in fp32
    (exact on store). bf16 on the bits in the interpreter only (its own cast truncates)."""
    if X_KIND == 1:
        v = round_bf16_native_or_bits(v, ON_BITS)
    elif X_KIND == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def rotate_rounded_tail(
    v,
    cs_rows,
    row_ok,
    cos_ptr,
    sin_ptr,
    cs_stride,
    dim0,
    head_dim,
    rope_dim,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INVERSE: tl.constexpr,
    X_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """`rope_rows`' rotation as an epilogue of another kernel's output tile: v fp32
    [ROWS, BLOCK_D] holds channels dim0 + [0, BLOCK_D) (dim0 even) of ROWS head rows, already
    rounded to x's dtype (what the producer would store); row r rotates by the angles of
    cos/sin row cs_rows[r], read only where row_ok[r] (rows the caller does not store, e.g. a
    row block's tail past the table, load nothing and pass through). The rope channels (the last rope_dim of head_dim) get the same
    fp32 products and rounding as `rope_rows` (the caller launches with FMA contraction off);
    the others pass through. Returns the tile to store."""
    a, b = tl.split(tl.reshape(v, [ROWS, BLOCK_D // 2, 2]))
    even = dim0 + 2 * tl.arange(0, BLOCK_D // 2)
    is_rope = (even >= head_dim - rope_dim) & (even < head_dim)
    pair = (even - (head_dim - rope_dim)) // 2
    cs = cs_rows[:, None].to(tl.int64) * cs_stride + pair[None, :]
    load = row_ok[:, None] & is_rope[None, :]
    cos = tl.load(cos_ptr + cs, mask=load, other=0.0)
    sin = tl.load(sin_ptr + cs, mask=load, other=0.0)
    if INVERSE:
        sin = -sin
    rot_a = tl.where(is_rope[None, :], round_to_x(a * cos - b * sin, X_KIND, ON_BITS), a)
    rot_b = tl.where(is_rope[None, :], round_to_x(a * sin + b * cos, X_KIND, ON_BITS), b)
    return tl.reshape(tl.join(rot_a, rot_b), [ROWS, BLOCK_D])


@triton.jit
def rope_rows(
    token,
    head_block,
    cos_ptr,
    sin_ptr,
    cs_stride_m,
    x_ptr,
    out_ptr,
    in_heads,
    out_heads,
    x_stride_m,
    x_stride_h,
    out_stride_m,
    out_stride_h,
    out_rows_ptr,
    norm_w_ptr,
    norm_eps,
    NOPE: tl.constexpr,
    HALF: tl.constexpr,
    NOPE_POW2: tl.constexpr,
    HALF_POW2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INVERSE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SCATTER: tl.constexpr,
    NORM: tl.constexpr,
    NORM_WEIGHT: tl.constexpr,
    X_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """One program's work: heads [head_block * BLOCK_H, +BLOCK_H) of token `token` (int64).
    The caller has waited for its producers (`wait_for_producers`)."""
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    is_src = heads < in_heads
    is_dst = heads < out_heads
    x_rows = x_ptr + token * x_stride_m + heads[:, None].to(tl.int64) * x_stride_h
    # SCATTER: token m's row goes to out[out_rows[m]] (e.g. a KV pool at the batch's slots).
    dst = tl.load(out_rows_ptr + token).to(tl.int64) if SCATTER else token
    out_rows = out_ptr + dst * out_stride_m + heads[:, None].to(tl.int64) * out_stride_h

    # Pass-through channels: copied in the storage dtype, bit for bit (zeros for pad heads).
    nope_cols = tl.arange(0, NOPE_POW2)[None, :]
    nope_mask = nope_cols < NOPE
    nope = tl.load(x_rows + nope_cols, mask=is_src[:, None] & nope_mask, other=0.0)
    if not NORM:
        tl.store(out_rows + nope_cols, nope, mask=is_dst[:, None] & nope_mask)

    pair = tl.arange(0, HALF_POW2)
    pair_mask = pair < HALF
    cos = tl.load(cos_ptr + token * cs_stride_m + pair, mask=pair_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * cs_stride_m + pair, mask=pair_mask, other=0.0)[None, :]
    if INVERSE:
        sin = -sin
    even_cols = NOPE + 2 * pair[None, :]
    load_mask = is_src[:, None] & pair_mask[None, :]
    a = tl.load(x_rows + even_cols, mask=load_mask, other=0.0).to(tl.float32)
    b = tl.load(x_rows + even_cols + 1, mask=load_mask, other=0.0).to(tl.float32)
    if NORM:
        # RMSNorm of the whole row (rmsnorm.py's rounding points). Masked lanes load 0 and add
        # nothing; the tree depends on NOPE_POW2, HALF_POW2, BLOCK_H and the warps (never M).
        nope = nope.to(tl.float32)
        sum_sq = tl.sum(nope * nope, axis=1) + tl.sum(a * a + b * b, axis=1)
        if ((NOPE + 2 * HALF) & (NOPE + 2 * HALF - 1)) == 0:
            mean_sq = sum_sq * (1.0 / (NOPE + 2 * HALF))  # exact reciprocal: same rounding
        else:
            mean_sq = tl.div_rn(sum_sq, (NOPE + 2 * HALF) * 1.0)
        rstd = tl.rsqrt(mean_sq + norm_eps)[:, None]
        if NORM_WEIGHT:
            w_nope = tl.load(norm_w_ptr + nope_cols, mask=nope_mask, other=0.0).to(tl.float32)
            w_pair = pair_mask[None, :]
            w_a = tl.load(norm_w_ptr + even_cols, mask=w_pair, other=0.0).to(tl.float32)
            w_b = tl.load(norm_w_ptr + even_cols + 1, mask=w_pair, other=0.0).to(tl.float32)
            nope = w_nope * (nope * rstd)
            a = w_a * (a * rstd)
            b = w_b * (b * rstd)
        else:
            rstd = round_to_x(rstd, X_KIND, ON_BITS)
            nope = nope * rstd
            a = a * rstd
            b = b * rstd
        # Rounded where the unfused chain stores the norm's output; the rotation reads these.
        nope = tl.where(is_src[:, None], round_to_x(nope, X_KIND, ON_BITS), 0.0)
        a = round_to_x(a, X_KIND, ON_BITS)
        b = round_to_x(b, X_KIND, ON_BITS)
        # After every load of the row (out may be x itself).
        tl.store(
            out_rows + nope_cols,
            nope.to(out_ptr.dtype.element_ty),
            mask=is_dst[:, None] & nope_mask,
        )
    # Pad heads get +0.0 exactly (0 * negative cos would give -0.0).
    rot_a = tl.where(is_src[:, None], a * cos - b * sin, 0.0)
    rot_b = tl.where(is_src[:, None], a * sin + b * cos, 0.0)
    store_mask = is_dst[:, None] & pair_mask[None, :]
    if OUT_BF16:
        rot_a = round_to_bf16(rot_a).to(tl.bfloat16)
        rot_b = round_to_bf16(rot_b).to(tl.bfloat16)
    else:
        rot_a = rot_a.to(out_ptr.dtype.element_ty)
        rot_b = rot_b.to(out_ptr.dtype.element_ty)
    tl.store(out_rows + even_cols, rot_a, mask=store_mask)
    tl.store(out_rows + even_cols + 1, rot_b, mask=store_mask)


@triton.jit
def _rope_tail_kernel(
    cos_ptr,
    sin_ptr,
    cs_stride_m,
    x_ptr,
    out_ptr,
    in_heads,
    out_heads,
    x_stride_m,
    x_stride_h,
    out_stride_m,
    out_stride_h,
    out_rows_ptr,
    norm_w_ptr,
    norm_eps,
    NOPE: tl.constexpr,
    HALF: tl.constexpr,
    NOPE_POW2: tl.constexpr,
    HALF_POW2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INVERSE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SCATTER: tl.constexpr,
    NORM: tl.constexpr,
    NORM_WEIGHT: tl.constexpr,
    X_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # x is the projection's output; out may still be read
    rope_rows(
        tl.program_id(0).to(tl.int64),
        tl.program_id(1),
        cos_ptr,
        sin_ptr,
        cs_stride_m,
        x_ptr,
        out_ptr,
        in_heads,
        out_heads,
        x_stride_m,
        x_stride_h,
        out_stride_m,
        out_stride_h,
        out_rows_ptr,
        norm_w_ptr,
        norm_eps,
        NOPE,
        HALF,
        NOPE_POW2,
        HALF_POW2,
        BLOCK_H,
        INVERSE,
        OUT_BF16,
        SCATTER,
        NORM,
        NORM_WEIGHT,
        X_KIND,
        ON_BITS,
    )


def _check_norm_args(
    x: torch.Tensor, inverse: bool, norm_eps: float | None, norm_weight: torch.Tensor | None
) -> None:
    if norm_eps is None:
        if norm_weight is not None:
            raise ValueError("norm_weight needs norm_eps (the pre-norm is off without it)")
        return
    if inverse:
        raise ValueError("norm_eps (pre-norm) is not supported with inverse=True")
    if (
        isinstance(norm_eps, bool)
        or not isinstance(norm_eps, (int, float))
        or not (math.isfinite(norm_eps) and norm_eps >= 0)
    ):
        raise ValueError(f"norm_eps must be a finite float >= 0, got {norm_eps!r}")
    if norm_weight is None:
        return
    head_dim = x.shape[2]
    if (
        norm_weight.shape != (head_dim,)
        or norm_weight.dtype not in (torch.float32, x.dtype)
        or (norm_weight.stride(0) != 1 or norm_weight.device != x.device)
    ):
        raise ValueError(
            f"norm_weight must be [D={head_dim}] fp32 or {x.dtype} with unit stride "
            f"on {x.device}, got {norm_weight.dtype} {tuple(norm_weight.shape)} "
            f"strides {norm_weight.stride()} on {norm_weight.device}"
        )


def rope_tail(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
    out_heads: int | None = None,
    out_rows: torch.Tensor | None = None,
    norm_eps: float | None = None,
    norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the trailing rope channels of every head and write full rows, in one launch.

    Args:
        x: [M, H, D] bf16/fp16/fp32, unit stride along D (token/head strides free, e.g. a view
            of a fused projection output).
        cos, sin: fp32 [M, rd/2] with unit stride along rd/2; row m holds the angles of token m's
            position (padded tokens: any valid row). rd = 2 * cos.shape[1] <= D.
        inverse: rotate by -angle (undo the rope on the attention output).
        out: optional [M, H_out, D] buffer of x's dtype, unit stride along D (e.g. a slice of a
            preallocated per-bucket buffer). May be ``x`` itself (in place) when H_out == H.
        out_heads: H_out when ``out`` is None (default H).
        out_rows: optional int32/int64 [M]: token m is written to ``out[out_rows[m]]`` (``out``
            required, any number of rows; e.g. the paged KV pool at the batch's cache slots),
            replacing a separate index_put. Rows must be distinct (else the last writer wins).
        norm_eps: fuse a pre-norm: RMS-normalise every (token, head) row of D channels (nope and
            rope) with this eps before rotating, as `rms_norm(x, norm_weight, norm_eps)` then
            `rope_tail` (X2 against that composition, see module); the nope channels are
            written normed. Not with ``inverse``.
        norm_weight: the norm's weight, [D] fp32 or x's dtype, unit stride (the weighted
            variant, `dtype(w * (x * rstd))`); None with ``norm_eps``: the weightless one,
            `dtype(x * dtype(rstd))`. Needs ``norm_eps``.
    Returns:
        ``out``: heads < min(H, H_out) rotated, heads in [H, H_out) zero.
    """
    plan = plan_rope_rows(
        x,
        cos,
        sin,
        inverse=inverse,
        out=out,
        out_heads=out_heads,
        out_rows=out_rows,
        norm_eps=norm_eps,
        norm_weight=norm_weight,
    )
    if plan.empty:
        return plan.out
    _rope_tail_kernel[(x.shape[0], plan.blocks)](
        cos,
        sin,
        cos.stride(0),
        *plan.args,
        **plan.meta,
        **plan.options,
        ON_BITS=interpreted(_rope_tail_kernel),
        enable_fp_fusion=False,
        **programmatic_launch(_rope_tail_kernel, x.device),
    )
    return plan.out


class RopeRowsPlan(NamedTuple):
    """One `rope_rows` job, validated: `args` are its runtime arguments after the shared
    cos/sin ones (x, out, heads, strides, out rows, norm weight, eps), `meta` its constexprs but
    ON_BITS, `options` its launch options (warps), `blocks` its head blocks per token; `empty`
    when there is nothing to launch."""

    out: torch.Tensor
    args: tuple
    meta: dict[str, Any]
    options: dict[str, int]
    blocks: int
    empty: bool


class EpilogueTables(NamedTuple):
    """Launch arguments of a `rotate_rounded_tail` epilogue: (cos, sin, their row stride, rd);
    without one, placeholders that the kernel never reads (ROPE off) and rd = 0."""

    cos: torch.Tensor
    sin: torch.Tensor
    stride: int
    rope_dim: int


def epilogue_tables(
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None,
    rows: int,
    head_dim: int,
    placeholder: torch.Tensor,
) -> EpilogueTables:
    """Checks the cos/sin rows another kernel rotates its output with (`rotate_rounded_tail`):
    fp32 [rows, rd/2], unit stride along rd/2, one row stride for both, on the placeholder's
    device, the rope channels pair-aligned (D - rd even)."""
    if inverse_rope is None:
        return EpilogueTables(placeholder, placeholder, 0, 0)
    cos, sin = inverse_rope
    device = placeholder.device
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != rows:
        raise ValueError(
            f"inverse_rope: cos/sin must both be [{rows}, rd/2], got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    rope_dim = 2 * cos.shape[1]
    if (
        cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or not 2 <= rope_dim <= head_dim
        or (head_dim - rope_dim) % 2
    ):
        raise ValueError(
            f"inverse_rope: cos/sin must be fp32 with 2 <= rd <= D = {head_dim} and "
            f"D - rd even, got {cos.dtype}/{sin.dtype} rd = {rope_dim}"
        )
    if (rows > 0 and (cos.stride(1) != 1 or sin.stride(1) != 1)) or cos.stride(0) != sin.stride(0):
        raise ValueError(
            f"inverse_rope: cos/sin need unit stride along rd/2 and one row stride, "
            f"got {cos.stride()} and {sin.stride()}"
        )
    if cos.device != device or sin.device != device:
        raise ValueError(f"inverse_rope: cos/sin are on {cos.device}/{sin.device}, not {device}")
    return EpilogueTables(cos, sin, cos.stride(0), rope_dim)


def plan_rope_rows(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool,
    out: torch.Tensor | None,
    out_heads: int | None,
    out_rows: torch.Tensor | None,
    norm_eps: float | None,
    norm_weight: torch.Tensor | None,
) -> RopeRowsPlan:
    """Validate `rope_tail`'s arguments (its docstring), allocate ``out`` when None and choose
    the tile; shared by `rope_tail` and the fused q + KV launch (`rope_qkv.py`)."""
    if x.dim() != 3 or x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x must be [M, H, D] bf16/fp16/fp32, got {x.dtype} {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != num_tokens:
        raise ValueError(
            f"cos/sin must both be [M={num_tokens}, rd/2], got {tuple(cos.shape)} "
            f"and {tuple(sin.shape)}"
        )
    _check_norm_args(x, inverse, norm_eps, norm_weight)
    half = cos.shape[1]
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or half < 1 or 2 * half > head_dim:
        raise ValueError(
            f"cos/sin must be fp32 with 1 <= rd/2 <= D/2 (D={head_dim}), got "
            f"{cos.dtype}/{sin.dtype} rd/2={half}"
        )
    if out is None:
        if out_rows is not None:
            raise ValueError("out_rows needs an out buffer to scatter into")
        out_heads = num_heads if out_heads is None else out_heads
        out = torch.empty((num_tokens, out_heads, head_dim), dtype=x.dtype, device=x.device)
    elif out_heads is not None and out.shape[1] != out_heads:
        raise ValueError(f"out has {out.shape[1]} heads but out_heads={out_heads}")
    if out_rows is not None and (
        out_rows.shape != (num_tokens,)
        or out_rows.dtype not in (torch.int32, torch.int64)
        or out_rows.device != x.device
    ):
        raise ValueError(
            f"out_rows must be int32/int64 [{num_tokens}] on {x.device}, got "
            f"{out_rows.dtype} {tuple(out_rows.shape)} on {out_rows.device}"
        )
    rows_ok = out_rows is not None or out.shape[0] == num_tokens
    if out.dim() != 3 or not rows_ok or out.shape[2] != head_dim or out.dtype != x.dtype:
        raise ValueError(
            f"out must be [{num_tokens if out_rows is None else 'rows'}, H_out, "
            f"{head_dim}] {x.dtype}, got {out.dtype} {tuple(out.shape)}"
        )
    if num_tokens == 0 or out.shape[1] == 0:
        return RopeRowsPlan(out, (), {}, {}, 0, True)
    for name, t in (("x", x), ("out", out), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got {t.stride()}")
    if cos.stride(0) != sin.stride(0):
        raise ValueError(
            f"cos and sin must share a row stride, got {cos.stride(0)}, {sin.stride(0)}"
        )
    if out.data_ptr() == x.data_ptr() and (
        out.shape != x.shape or out.stride() != x.stride() or out_rows is not None
    ):
        raise ValueError("in-place rope needs out to be x itself (same heads and strides)")
    nope = head_dim - 2 * half
    out_heads = out.shape[1]
    block_h = max(1, min(16, 4096 // triton.next_power_of_2(head_dim)))
    options: dict[str, int] = {}
    if norm_eps is not None:
        # The norm's reductions make a small tile's shape matter. H200, CUDA graphs, bf16 at
        # M = 1 / 32: the KV row (1 head of 512, scatter) took 1.43 / 1.51 us in 8-head blocks of
        # 4 warps and 1.05 / 1.07 us as one head on one warp (rope alone: 0.96); q (16 heads of
        # 512 padded to 64) 1.50 / 2.04 us at the default, slower on 1 or 2 warps. The block
        # (hence the summation tree) follows D and H_out, never M.
        block_h = min(block_h, triton.next_power_of_2(out_heads))
        if block_h * triton.next_power_of_2(head_dim) <= 512:
            options["num_warps"] = 1
    args = (
        x,
        out,
        num_heads,
        out_heads,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos if out_rows is None else out_rows,
        x if norm_weight is None else norm_weight,
        0.0 if norm_eps is None else float(norm_eps),
    )
    constexprs = dict(
        NOPE=nope,
        HALF=half,
        NOPE_POW2=triton.next_power_of_2(max(nope, 1)),
        HALF_POW2=triton.next_power_of_2(half),
        BLOCK_H=block_h,
        INVERSE=inverse,
        OUT_BF16=x.dtype == torch.bfloat16,
        SCATTER=out_rows is not None,
        NORM=norm_eps is not None,
        NORM_WEIGHT=norm_weight is not None,
        X_KIND=X_KIND[x.dtype],
    )
    return RopeRowsPlan(out, args, constexprs, options, triton.cdiv(out_heads, block_h), False)
