"""The rope rows of one token, shared by the rope launchers (`tail.py`, `q_kv.py`): the Triton
helper that rotates (and optionally pre-normalises) a block of heads of one token, and the host
plan that validates a launcher's arguments and picks its tile.

The output buffer may hold a different head count than the input: heads beyond the input's are
written as zeros (attention kernels that want a head multiple), heads beyond the output's are
dropped (un-padding the attention output). With the pre-norm, each (token, head) row is first
RMS-normalised over all D channels, rounded to x's dtype where the unfused chain RMSNorm -> rope
stores it; the nope channels are then written normed and the tail rotated from the rounded
normed values.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_unit_stride,
    require,
)
from sgl_dspark.kernels._triton_utils import DTYPE_KIND, round_to_bf16, round_to_dtype


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
    KIND: tl.constexpr,
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
        # RMSNorm of the whole row (`rms_norm_ref`'s rounding points). Masked lanes load 0 and add
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
            rstd = round_to_dtype(rstd, KIND, ON_BITS)
            nope = nope * rstd
            a = a * rstd
            b = b * rstd
        # Rounded where the unfused chain stores the norm's output; the rotation reads these.
        nope = tl.where(is_src[:, None], round_to_dtype(nope, KIND, ON_BITS), 0.0)
        a = round_to_dtype(a, KIND, ON_BITS)
        b = round_to_dtype(b, KIND, ON_BITS)
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


def _check_norm_args(
    x: torch.Tensor, inverse: bool, norm_eps: float | None, norm_weight: torch.Tensor | None
) -> None:
    if norm_eps is None:
        require(norm_weight is None, "norm_weight needs norm_eps (the pre-norm is off without it)")
        return
    require(not inverse, "norm_eps (pre-norm) is not supported with inverse=True")
    require(
        not isinstance(norm_eps, bool)
        and isinstance(norm_eps, (int, float))
        and math.isfinite(norm_eps)
        and norm_eps >= 0,
        f"norm_eps must be a finite float >= 0, got {norm_eps!r}",
    )
    if norm_weight is None:
        return
    head_dim = x.shape[2]
    require(
        norm_weight.shape == (head_dim,)
        and norm_weight.dtype in (torch.float32, x.dtype)
        and norm_weight.stride(0) == 1
        and norm_weight.device == x.device,
        f"norm_weight must be [D={head_dim}] fp32 or {x.dtype} with unit stride "
        f"on {x.device}, got {norm_weight.dtype} {tuple(norm_weight.shape)} "
        f"strides {norm_weight.stride()} on {norm_weight.device}",
    )


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
    the tile; shared by `rope_tail` (`tail.py`) and the fused q + KV launch (`q_kv.py`)."""
    require(
        x.dim() == 3 and x.dtype in FLOAT_DTYPES,
        f"x must be [M, H, D] bf16/fp16/fp32, got {x.dtype} {tuple(x.shape)}",
    )
    num_tokens, num_heads, head_dim = x.shape
    require(
        cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == num_tokens,
        f"cos/sin must both be [M={num_tokens}, rd/2], got {tuple(cos.shape)} "
        f"and {tuple(sin.shape)}",
    )
    _check_norm_args(x, inverse, norm_eps, norm_weight)
    half = cos.shape[1]
    require(
        cos.dtype == torch.float32 and sin.dtype == torch.float32 and 1 <= half <= head_dim // 2,
        f"cos/sin must be fp32 with 1 <= rd/2 <= D/2 (D={head_dim}), got "
        f"{cos.dtype}/{sin.dtype} rd/2={half}",
    )
    if out is None:
        require(out_rows is None, "out_rows needs an out buffer to scatter into")
        out_heads = num_heads if out_heads is None else out_heads
        out = torch.empty((num_tokens, out_heads, head_dim), dtype=x.dtype, device=x.device)
    else:
        require(
            out_heads is None or out.shape[1] == out_heads,
            f"out has {out.shape[1]} heads but out_heads={out_heads}",
        )
    if out_rows is not None:
        require(
            out_rows.shape == (num_tokens,)
            and out_rows.dtype in INDEX_DTYPES
            and out_rows.device == x.device,
            f"out_rows must be int32/int64 [{num_tokens}] on {x.device}, got "
            f"{out_rows.dtype} {tuple(out_rows.shape)} on {out_rows.device}",
        )
    rows_ok = out_rows is not None or out.shape[0] == num_tokens
    require(
        out.dim() == 3 and rows_ok and out.shape[2] == head_dim and out.dtype == x.dtype,
        f"out must be [{num_tokens if out_rows is None else 'rows'}, H_out, "
        f"{head_dim}] {x.dtype}, got {out.dtype} {tuple(out.shape)}",
    )
    if num_tokens == 0 or out.shape[1] == 0:
        return RopeRowsPlan(out, (), {}, {}, 0, True)
    for name, t in (("x", x), ("out", out), ("cos", cos), ("sin", sin)):
        check_unit_stride(name, t)
    require(
        cos.stride(0) == sin.stride(0),
        f"cos and sin must share a row stride, got {cos.stride(0)}, {sin.stride(0)}",
    )
    require(
        out.data_ptr() != x.data_ptr()
        or (out.shape == x.shape and out.stride() == x.stride() and out_rows is None),
        "in-place rope needs out to be x itself (same heads and strides)",
    )
    nope = head_dim - 2 * half
    out_heads = out.shape[1]
    block_h = max(1, min(16, 4096 // triton.next_power_of_2(head_dim)))
    options: dict[str, int] = {}
    if norm_eps is not None:
        # The norm's reductions make a small tile's shape matter: a single row (the KV row) is
        # fastest as one head on one warp, wider head blocks keep the default warps. The block
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
        KIND=DTYPE_KIND[x.dtype],
    )
    return RopeRowsPlan(out, args, constexprs, options, triton.cdiv(out_heads, block_h), False)
