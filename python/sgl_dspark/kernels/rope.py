"""K13: interleaved RoPE on the trailing channels of each head while writing the full row.

DeepSeek-V4 layout (deepseek_v4_model.md §3): a head of D channels is ``[nope (D - rd) | rope (rd)]``;
inside the rope tail the pairs are interleaved, pair i = channels (D - rd + 2i, D - rd + 2i + 1):
    x'[2i]   = a * cos_i - b * sin_i
    x'[2i+1] = a * sin_i + b * cos_i          (a = x[2i], b = x[2i+1], fp32 maths)
The inverse rotation (attention output) uses -sin. The nope channels are copied bit for bit; the
rotated tail is rounded once to the input dtype (round-to-nearest-even). The output buffer may
hold a different head count: heads beyond the input's are written as zeros (attention kernels that
want a head multiple), heads beyond the output's are dropped (un-padding the attention output).

Exactness: X1. Each product and the final add/sub are separately rounded fp32 operations, as in
the reference (the kernel is launched with FMA contraction disabled), and the bf16 rounding is
done on the bits (RNE), so the kernel equals the reference bit for bit on GPU and in the
interpreter (whose own fp32 -> bf16 cast truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import (
    programmatic_launch,
    round_to_bf16,
    wait_for_producers,
)

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rope_tail_ref(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    out_heads: int | None = None,
) -> torch.Tensor:
    """Reference: rotate the trailing ``rd = 2 * cos.shape[1]`` channels of every head.

    x [M, H, D] (bf16/fp16/fp32), cos/sin fp32 [M, rd/2] (positions already applied).
    Returns [M, out_heads or H, D] in x's dtype.
    """
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
def _rope_tail_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    in_heads,
    out_heads,
    x_stride_m,
    x_stride_h,
    out_stride_m,
    out_stride_h,
    cs_stride_m,
    out_rows_ptr,
    NOPE: tl.constexpr,
    HALF: tl.constexpr,
    NOPE_POW2: tl.constexpr,
    HALF_POW2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INVERSE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SCATTER: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # x is the projection's output; out may still be read
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
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


def rope_tail(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
    out_heads: int | None = None,
    out_rows: torch.Tensor | None = None,
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
    Returns:
        ``out``: heads < min(H, H_out) rotated, heads in [H, H_out) zero.
    """
    if x.dim() != 3 or x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x must be [M, H, D] bf16/fp16/fp32, got {x.dtype} {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != num_tokens:
        raise ValueError(f"cos/sin must both be [M={num_tokens}, rd/2], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    half = cos.shape[1]
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or half < 1 or 2 * half > head_dim:
        raise ValueError(f"cos/sin must be fp32 with 1 <= rd/2 <= D/2 (D={head_dim}), got "
                         f"{cos.dtype}/{sin.dtype} rd/2={half}")
    if out is None:
        if out_rows is not None:
            raise ValueError("out_rows needs an out buffer to scatter into")
        out_heads = num_heads if out_heads is None else out_heads
        out = torch.empty((num_tokens, out_heads, head_dim), dtype=x.dtype, device=x.device)
    elif out_heads is not None and out.shape[1] != out_heads:
        raise ValueError(f"out has {out.shape[1]} heads but out_heads={out_heads}")
    if out_rows is not None and (out_rows.shape != (num_tokens,) or out_rows.dtype not in (
            torch.int32, torch.int64) or out_rows.device != x.device):
        raise ValueError(f"out_rows must be int32/int64 [{num_tokens}] on {x.device}, got "
                         f"{out_rows.dtype} {tuple(out_rows.shape)} on {out_rows.device}")
    rows_ok = out_rows is not None or out.shape[0] == num_tokens
    if out.dim() != 3 or not rows_ok or out.shape[2] != head_dim or out.dtype != x.dtype:
        raise ValueError(f"out must be [{num_tokens if out_rows is None else 'rows'}, H_out, "
                         f"{head_dim}] {x.dtype}, got {out.dtype} {tuple(out.shape)}")
    if num_tokens == 0 or out.shape[1] == 0:
        return out
    for name, t in (("x", x), ("out", out), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got {t.stride()}")
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos and sin must share a row stride, got {cos.stride(0)}, "
                         f"{sin.stride(0)}")
    if out.data_ptr() == x.data_ptr() and (out.shape != x.shape or out.stride() != x.stride()
                                           or out_rows is not None):
        raise ValueError("in-place rope needs out to be x itself (same heads and strides)")
    nope = head_dim - 2 * half
    out_heads = out.shape[1]
    block_h = max(1, min(16, 4096 // triton.next_power_of_2(head_dim)))
    grid = (num_tokens, triton.cdiv(out_heads, block_h))
    _rope_tail_kernel[grid](
        x, cos, sin, out, num_heads, out_heads,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
        cos if out_rows is None else out_rows, NOPE=nope, HALF=half,
        NOPE_POW2=triton.next_power_of_2(max(nope, 1)), HALF_POW2=triton.next_power_of_2(half),
        BLOCK_H=block_h, INVERSE=inverse, OUT_BF16=x.dtype == torch.bfloat16,
        SCATTER=out_rows is not None,
        enable_fp_fusion=False,
        **programmatic_launch(_rope_tail_kernel, x.device),
    )
    return out
