"""RoPE tail in one launch: rotate the trailing rope channels of every head while writing full
rows, optionally pre-normalised, optionally scattered to pool rows (`rope_tail_ref` is the spec;
`rows.py` holds the shared row code).

Exactness: bit-exact against `rope_tail_ref` without the norm. Each product and the final
add/sub are separately rounded fp32 operations, as in the reference (the kernel is launched with
FMA contraction disabled), and the 16-bit rounding is to nearest even (on the bits in the
interpreter, whose own fp32 -> bf16 cast truncates), on GPU and in the interpreter alike.
With the norm: within a tolerance of `rope_tail_ref`. The sum of squares is reduced in the
kernel's own order (nope part and rope pairs summed separately, then added; the tree depends on
D and on the launch's head block and warps, themselves fixed by D and H_out, never on the token
count M, so a row's bits depend neither on M nor on the other rows) and the rsqrt is `tl.rsqrt`,
so rstd may differ from torch's in its last bits. Every later step is the reference's: weighted
`dtype(w * (x * rstd))`, weightless `dtype(x * dtype(rstd))`, each an fp32 operation rounded to
nearest even, then the exact rotation of the rounded normed values. bf16 outputs differ from the
reference only where rstd's last bit moves a rounding (1 element in 2.8M in tests), fp32 by a
few ulps. Fusing the norm saves its launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import interpreted, programmatic_launch, wait_for_producers
from sgl_dspark.kernels.rope.rows import plan_rope_rows, rope_rows


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
    KIND: tl.constexpr,
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
        KIND,
        ON_BITS,
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
    """`rope_tail_ref` in one launch: rotate the trailing rope channels of every head and write
    full rows.

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
            rope) with this eps before rotating, as `rope_tail_ref`'s ``norm_eps`` (within a
            tolerance, see the module doc); the nope channels are written normed. Not with
            ``inverse``.
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
