"""An attention layer's two rotations at one set of positions in one launch: the query heads'
RoPE tail and the KV row's norm + RoPE + store (`rope_q_kv_ref` is the spec).

An attention layer of DeepSeek-V4 (and a DSpark draft stage) rotates two things per token at the
same positions: the query heads (optionally after the weightless per-head norm, written into a
possibly head-padded buffer) and the single shared KV row (after its weighted kv_norm, stored
into the paged pool at the token's cache slot, or into a dense buffer). The launch that writes
the KV row also reads each query head row once, rotates its tail and writes the full row; each
program does one job:

    grid (M, q_blocks + 1): program (m, b < q_blocks) rotates query heads [b*BLOCK_H, ...) of
    token m exactly as `rope_tail` would (same head block, same warps); program (m, q_blocks)
    writes token m's KV row.

Exactness: the query rows equal `rope_tail(q, ...)` with the same arguments bit for bit (the same
`rope_rows` code, tile and warps). The KV row is `rope_tail`'s arithmetic too; with its norm, the
sum of squares is reduced over the launch's warps (the query tile's), so rstd may differ in its
last bits from a standalone `rope_tail` call on the row (one warp there): within a tolerance of
`rope_q_kv_ref`, like `rope_tail`'s own norm. A row's bits never depend on M or on the other
rows.

`rope_q_quant_store_kv` is DeepSeek-V4.1's form: the KV row is rotated, quantised to FP8 and
written into the packed window cache (`quant_store`'s row code) by program (m, q_blocks). Every
value is its own launch's: the query rows as `rope_tail`'s (same code, tile and warps), the
stored bytes as `quant_store`'s (per-block maxima and elementwise operations, the same whatever
the warps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import interpreted, programmatic_launch, wait_for_producers
from sgl_dspark.kernels.quant.store import plan_quant_store, quant_store, quant_store_row
from sgl_dspark.kernels.rope.rows import plan_rope_rows, rope_rows
from sgl_dspark.kernels.rope.tail import rope_tail


@triton.jit
def _rope_q_kv_kernel(
    cos_ptr,
    sin_ptr,
    cs_stride_m,
    q_ptr,
    q_out_ptr,
    q_heads,
    q_out_heads,
    q_stride_m,
    q_stride_h,
    q_out_stride_m,
    q_out_stride_h,
    q_rows_ptr,
    q_w_ptr,
    q_eps,
    kv_ptr,
    kv_out_ptr,
    kv_heads,
    kv_out_heads,
    kv_stride_m,
    kv_stride_h,
    kv_out_stride_m,
    kv_out_stride_h,
    kv_rows_ptr,
    kv_w_ptr,
    kv_eps,
    Q_BLOCKS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_POW2: tl.constexpr,
    Q_NOPE: tl.constexpr,
    Q_NOPE_POW2: tl.constexpr,
    Q_BLOCK_H: tl.constexpr,
    Q_OUT_BF16: tl.constexpr,
    Q_NORM: tl.constexpr,
    Q_KIND: tl.constexpr,
    KV_NOPE: tl.constexpr,
    KV_NOPE_POW2: tl.constexpr,
    KV_OUT_BF16: tl.constexpr,
    KV_SCATTER: tl.constexpr,
    KV_NORM: tl.constexpr,
    KV_NORM_WEIGHT: tl.constexpr,
    KV_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # q and kv are the projections' outputs
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    if block < Q_BLOCKS:
        rope_rows(
            token,
            block,
            cos_ptr,
            sin_ptr,
            cs_stride_m,
            q_ptr,
            q_out_ptr,
            q_heads,
            q_out_heads,
            q_stride_m,
            q_stride_h,
            q_out_stride_m,
            q_out_stride_h,
            q_rows_ptr,
            q_w_ptr,
            q_eps,
            Q_NOPE,
            HALF,
            Q_NOPE_POW2,
            HALF_POW2,
            Q_BLOCK_H,
            False,
            Q_OUT_BF16,
            False,
            Q_NORM,
            False,
            Q_KIND,
            ON_BITS,
        )
    else:
        rope_rows(
            token,
            0,
            cos_ptr,
            sin_ptr,
            cs_stride_m,
            kv_ptr,
            kv_out_ptr,
            kv_heads,
            kv_out_heads,
            kv_stride_m,
            kv_stride_h,
            kv_out_stride_m,
            kv_out_stride_h,
            kv_rows_ptr,
            kv_w_ptr,
            kv_eps,
            KV_NOPE,
            HALF,
            KV_NOPE_POW2,
            HALF_POW2,
            1,
            False,
            KV_OUT_BF16,
            KV_SCATTER,
            KV_NORM,
            KV_NORM_WEIGHT,
            KV_KIND,
            ON_BITS,
        )


def rope_q_kv(
    q: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    q_out_heads: int | None = None,
    q_norm_eps: float | None = None,
    kv_norm_eps: float | None = None,
    kv_norm_weight: torch.Tensor | None = None,
    kv_out: torch.Tensor | None = None,
    kv_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_q_kv_ref` in one launch: rotate the query heads and write the KV row of every token.

    Args:
        q: [M, H, D] bf16/fp16/fp32 query heads, unit stride along D.
        kv: [M, Dkv] the KV row (one shared head), unit stride along Dkv; its own dtype.
        cos, sin: fp32 [M, rd/2], shared by q and kv (the same positions); rd <= min(D, Dkv).
        q_out / q_out_heads: as `rope_tail`'s out / out_heads for q (head padding, buckets).
        q_norm_eps: the weightless per-head q norm before the rotation (None: no norm).
        kv_norm_eps / kv_norm_weight: the KV row's norm (weight [Dkv] or None: weightless).
        kv_out: [M, Dkv] buffer, or with `kv_rows` the pool [N, Dkv] of kv's dtype.
        kv_rows: int32/int64 [M]: token m's row goes to kv_out[kv_rows[m]] (distinct rows).
    Every argument is validated as `rope_tail` validates it. Returns (q_out, kv_out).
    """
    require(
        kv.dim() == 2 and kv.device == q.device,
        f"kv must be [M, Dkv] on q's device {q.device}, got {tuple(kv.shape)} on {kv.device}",
    )
    require(
        kv_out is None or kv_out.dim() == 2,
        f"kv_out must be [rows, Dkv], got {None if kv_out is None else tuple(kv_out.shape)}",
    )
    q_plan = plan_rope_rows(
        q,
        cos,
        sin,
        inverse=False,
        out=q_out,
        out_heads=q_out_heads,
        out_rows=None,
        norm_eps=q_norm_eps,
        norm_weight=None,
    )
    kv_plan = plan_rope_rows(
        kv[:, None],
        cos,
        sin,
        inverse=False,
        out=None if kv_out is None else kv_out[:, None],
        out_heads=None,
        out_rows=kv_rows,
        norm_eps=kv_norm_eps,
        norm_weight=kv_norm_weight,
    )
    kv_out = kv_plan.out[:, 0]
    if kv_plan.empty:  # M = 0
        return q_plan.out, kv_out
    if q_plan.empty:  # no query heads to write: the KV row alone
        rope_tail(
            kv[:, None],
            cos,
            sin,
            out=kv_plan.out,
            out_rows=kv_rows,
            norm_eps=kv_norm_eps,
            norm_weight=kv_norm_weight,
        )
        return q_plan.out, kv_out
    qm, km = q_plan.meta, kv_plan.meta
    _rope_q_kv_kernel[(q.shape[0], q_plan.blocks + 1)](
        cos,
        sin,
        cos.stride(0),
        *q_plan.args,
        *kv_plan.args,
        Q_BLOCKS=q_plan.blocks,
        HALF=qm["HALF"],
        HALF_POW2=qm["HALF_POW2"],
        Q_NOPE=qm["NOPE"],
        Q_NOPE_POW2=qm["NOPE_POW2"],
        Q_BLOCK_H=qm["BLOCK_H"],
        Q_OUT_BF16=qm["OUT_BF16"],
        Q_NORM=qm["NORM"],
        Q_KIND=qm["KIND"],
        KV_NOPE=km["NOPE"],
        KV_NOPE_POW2=km["NOPE_POW2"],
        KV_OUT_BF16=km["OUT_BF16"],
        KV_SCATTER=km["SCATTER"],
        KV_NORM=km["NORM"],
        KV_NORM_WEIGHT=km["NORM_WEIGHT"],
        KV_KIND=km["KIND"],
        ON_BITS=interpreted(_rope_q_kv_kernel),
        enable_fp_fusion=False,
        **q_plan.options,
        **programmatic_launch(_rope_q_kv_kernel, q.device),
    )
    return q_plan.out, kv_out


@triton.jit
def _rope_q_store_kv_kernel(
    cos_ptr,
    sin_ptr,
    cs_stride_m,
    q_ptr,
    q_out_ptr,
    q_heads,
    q_out_heads,
    q_stride_m,
    q_stride_h,
    q_out_stride_m,
    q_out_stride_h,
    q_rows_ptr,
    q_w_ptr,
    q_eps,
    kv_ptr,
    kv_row_stride,
    kv_head_stride,
    kv_heads,
    kv_cos_ptr,
    kv_sin_ptr,
    kv_cs_row_stride,
    kv_rows_ptr,
    data_ptr,
    data_row_stride,
    scales_ptr,
    scales_row_stride,
    Q_BLOCKS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_POW2: tl.constexpr,
    Q_NOPE: tl.constexpr,
    Q_NOPE_POW2: tl.constexpr,
    Q_BLOCK_H: tl.constexpr,
    Q_OUT_BF16: tl.constexpr,
    Q_NORM: tl.constexpr,
    Q_KIND: tl.constexpr,
    D: tl.constexpr,
    HALF_ROPE: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    BLOCK: tl.constexpr,
    FMT: tl.constexpr,
    VALUES: tl.constexpr,
    IDENTITY_ROWS: tl.constexpr,
    OUT_KIND: tl.constexpr,
    X_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # q and kv are the projections' outputs
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    if block < Q_BLOCKS:
        rope_rows(
            token,
            block,
            cos_ptr,
            sin_ptr,
            cs_stride_m,
            q_ptr,
            q_out_ptr,
            q_heads,
            q_out_heads,
            q_stride_m,
            q_stride_h,
            q_out_stride_m,
            q_out_stride_h,
            q_rows_ptr,
            q_w_ptr,
            q_eps,
            Q_NOPE,
            HALF,
            Q_NOPE_POW2,
            HALF_POW2,
            Q_BLOCK_H,
            False,
            Q_OUT_BF16,
            False,
            Q_NORM,
            False,
            Q_KIND,
            ON_BITS,
        )
    else:
        quant_store_row(
            token,
            kv_ptr,
            kv_row_stride,
            kv_head_stride,
            kv_heads,
            kv_cos_ptr,
            kv_sin_ptr,
            kv_cs_row_stride,
            kv_rows_ptr,
            data_ptr,
            data_row_stride,
            scales_ptr,
            scales_row_stride,
            D,
            HALF_ROPE,
            NB,
            NBP,
            BLOCK,
            FMT,
            VALUES,
            IDENTITY_ROWS,
            OUT_KIND,
            X_KIND,
            ON_BITS,
        )


def rope_q_quant_store_kv(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    kv_rows: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    *,
    q_norm_eps: float | None = None,
) -> torch.Tensor:
    """`rope_tail(q, cos, sin, norm_eps=q_norm_eps)` and `quant_store(kv, kv_rows, data,
    scales, fmt, cos, sin)` in one launch, each with its own call's bits.

    Args:
        q: [M, H, D] query heads, unit stride along D; cos, sin: fp32 [M, rd/2] (q's and the KV
            row's positions).
        kv: [M, Dkv] the KV row (already normed), unit stride along Dkv.
        kv_rows, data, scales, fmt: the packed cache rows to write, as `quant_store`'s.
        q_norm_eps: the weightless per-head q norm before the rotation (None: no norm).
    Returns:
        the rotated queries [M, H, D].
    """
    q_plan = plan_rope_rows(
        q,
        cos,
        sin,
        inverse=False,
        out=None,
        out_heads=None,
        out_rows=None,
        norm_eps=q_norm_eps,
        norm_weight=None,
    )
    store = plan_quant_store(kv, kv_rows, data, scales, fmt, cos, sin, values=False)
    require(store.rows == q.shape[0], f"kv: expected {q.shape[0]} rows, got {store.rows}")
    if q_plan.empty:  # no query heads (or no tokens): the store alone
        quant_store(kv, kv_rows, data, scales, fmt, cos, sin)
        return q_plan.out
    qm = q_plan.meta
    _rope_q_store_kv_kernel[(q.shape[0], q_plan.blocks + 1)](
        cos,
        sin,
        cos.stride(0),
        *q_plan.args,
        *store.args,
        Q_BLOCKS=q_plan.blocks,
        HALF=qm["HALF"],
        HALF_POW2=qm["HALF_POW2"],
        Q_NOPE=qm["NOPE"],
        Q_NOPE_POW2=qm["NOPE_POW2"],
        Q_BLOCK_H=qm["BLOCK_H"],
        Q_OUT_BF16=qm["OUT_BF16"],
        Q_NORM=qm["NORM"],
        Q_KIND=qm["KIND"],
        **store.meta,
        ON_BITS=interpreted(_rope_q_store_kv_kernel),
        enable_fp_fusion=False,
        **q_plan.options,
        **programmatic_launch(_rope_q_store_kv_kernel, q.device),
    )
    return q_plan.out
