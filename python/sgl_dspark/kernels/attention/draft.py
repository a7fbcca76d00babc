"""DSpark draft attention core in one launch per draft stage: context keys read through slots,
the draft block, sinks (`draft_attention_ref` is the spec).

Request b has Q block rows and H query heads over one shared KV head (keys are values). Its keys
are the C context rows ``ctx_pool[ctx_slots[b, j]]`` (visible iff ``ctx_valid[b, j]``; cast to the
block's dtype) followed by its Q block rows (always visible). No row is ever empty (the block
keys are visible), and context slots of invalid positions (the dummy slot 0 by convention) are
never read.

Kernel: all Q*H query rows of a request see the same keys, so the rows (i, h) are flattened and
tiled by ``BLOCK_M``; program (b, row block) loads its query tile once and runs an online softmax
over the context keys in ``BLOCK_N`` tiles (slot ids, then the rows they name), then over the block
keys. Tiles are bounded by ``_TILE_ELEMS`` elements (BLOCK_M x Dh accumulator, BLOCK_N x Dh keys),
so Dh 512 / 64 heads (DeepSeek-V4-Flash) uses more, smaller row blocks than Dh 128 / 16 heads.

Exactness: within a tolerance of the reference. The kernel keeps logits and the softmax in fp32
(online softmax, exp2 with log2(e) folded into the scale, sinks used in fp32) where the reference
rounds the logits and probabilities to the input dtype, and it sums the keys tile by tile. 16-bit
inputs still round the probabilities to the key dtype before the PV product, as the reference
does; the accumulator is fp32. fp32 inputs agree with the reference to ~1e-6; bf16 to a few 1e-2
(the reference's bf16 logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_unit_stride,
    require,
)
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    programmatic_launch,
    round_to_dtype,
    wait_for_producers,
)
from sgl_dspark.kernels.attention.online_softmax import online_softmax_step
from sgl_dspark.kernels.rope.epilogue import epilogue_tables, rotate_rounded_tail

_LOG2E = 1.4426950408889634
# Register budget of one program: BLOCK_M x Dh fp32 accumulator and BLOCK_N x Dh key tile.
_TILE_ELEMS = 8192


@triton.jit
def _draft_attention_kernel(
    q_ptr,
    pool_ptr,
    slots_ptr,
    valid_ptr,
    block_ptr,
    sinks_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    cs_stride,
    num_heads,
    q_len,
    num_ctx,
    qk_scale,
    rope_dim,
    q_stride_b,
    q_stride_i,
    q_stride_h,
    pool_stride,
    slots_stride_b,
    slots_stride_j,
    valid_stride_b,
    valid_stride_j,
    block_stride_b,
    block_stride_i,
    out_stride_b,
    out_stride_i,
    out_stride_h,
    HEAD_DIM: tl.constexpr,
    D_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROUND_P: tl.constexpr,
    ROPE: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (request b, row block): rows r = i * H + h of the request's Q x H query rows.
    # q, the block rows, the context pool and slots come from earlier kernels; the sinks
    # (parameters) are off the critical path, so nothing is loaded before the wait.
    wait_for_producers(PDL)
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * num_heads
    qi = (rows // num_heads).to(tl.int64)
    qh = (rows % num_heads).to(tl.int64)
    dims = tl.arange(0, D_POW2)
    dim_ok = dims < HEAD_DIM
    tile_ok = row_ok[:, None] & dim_ok[None, :]
    kv_dtype = block_ptr.dtype.element_ty
    q = tl.load(
        q_ptr + b * q_stride_b + (qi * q_stride_i + qh * q_stride_h)[:, None] + dims[None, :],
        mask=tile_ok,
        other=0.0,
    ).to(kv_dtype)
    sink = tl.load(sinks_ptr + qh, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    # The running max starts at the (finite) sink, so it stays finite and masked keys give
    # exp2(-inf) = 0.
    m_i = sink
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_POW2], dtype=tl.float32)
    offs = tl.arange(0, BLOCK_N)

    for j0 in range(0, num_ctx, BLOCK_N):
        j = j0 + offs
        in_range = j < num_ctx
        valid = (
            tl.load(valid_ptr + b * valid_stride_b + j * valid_stride_j, mask=in_range, other=0)
            != 0
        )
        # Invalid positions (dummy slots) are never dereferenced.
        slot = tl.load(slots_ptr + b * slots_stride_b + j * slots_stride_j, mask=valid, other=0).to(
            tl.int64
        )
        keys = tl.load(
            pool_ptr + slot[:, None] * pool_stride + dims[None, :],
            mask=valid[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(kv_dtype)
        m_i, l_i, acc = online_softmax_step(
            q, keys, valid, m_i, l_i, acc, qk_scale, DOT_FP32, ROUND_P
        )

    for i0 in range(0, q_len, BLOCK_N):
        i = i0 + offs
        valid = i < q_len
        keys = tl.load(
            block_ptr
            + b * block_stride_b
            + i[:, None].to(tl.int64) * block_stride_i
            + dims[None, :],
            mask=valid[:, None] & dim_ok[None, :],
            other=0.0,
        )
        m_i, l_i, acc = online_softmax_step(
            q, keys, valid, m_i, l_i, acc, qk_scale, DOT_FP32, ROUND_P
        )

    denom = l_i + tl.exp2(sink - m_i)  # the sink's share of the normaliser (its value is zero)
    out = round_to_dtype(acc / denom[:, None], KIND, ON_BITS)
    if ROPE:  # the inverse rotation of the output's rope channels at the row's position
        # Rows past Q x H (the last row block's tail, never stored) would index past the table.
        out = rotate_rounded_tail(
            out,
            b * q_len + qi,
            row_ok,
            cos_ptr,
            sin_ptr,
            cs_stride,
            0,
            HEAD_DIM,
            rope_dim,
            BLOCK_M,
            D_POW2,
            True,
            KIND,
            ON_BITS,
        )
    tl.store(
        out_ptr
        + b * out_stride_b
        + (qi * out_stride_i + qh * out_stride_h)[:, None]
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=tile_ok,
    )


def draft_attention(
    q: torch.Tensor,
    ctx_pool: torch.Tensor,
    ctx_slots: torch.Tensor,
    ctx_valid: torch.Tensor,
    kv_block: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`draft_attention_ref` in one launch, no host sync (CUDA-graph safe).

    Args:
        q: [B, Q, H, Dh] bf16/fp16/fp32 rotated block queries, unit stride along Dh.
        ctx_pool: [N, Dh] bf16/fp16/fp32 context-KV pool of the stage, unit stride along Dh;
            rows are cast to kv_block's dtype on load.
        ctx_slots: [B, C] int32/int64 pool slots of the context positions (C >= 0); slots of
            invalid positions are never read, so they may hold anything.
        ctx_valid: [B, C] bool visibility of the context positions.
        kv_block: [B, Q, Dh] the block's KV rows, q's dtype, unit stride along Dh.
        sinks: [H] finite sink logits (any float dtype, used in fp32).
        scale: logit scale.
        out: optional [B, Q, H, Dh] buffer of q's dtype, unit stride along Dh.
        inverse_rope: optional (cos, sin) fp32 [B * Q, rd/2] at the block rows' positions (one
            row stride, unit stride along rd/2): the output's trailing rd channels are rotated
            back in the epilogue, the bits of `rope_tail(out, cos, sin, inverse=True)` after
            this kernel (one launch less per stage). The kernel runs with FMA contraction off.
    Returns:
        [B, Q, H, Dh] in q's dtype (`out` when given).
    Raises:
        ValueError on a bad shape, dtype or layout (the message names the argument).
    Exactness: within a tolerance of `draft_attention_ref` (fp32 online softmax; module doc).
    Grid: (B, cdiv(Q * H, BLOCK_M)); every program walks all C + Q keys once.
    """
    require(
        q.dim() == 4 and q.dtype in FLOAT_DTYPES,
        f"q must be [B, Q, H, Dh] bf16/fp16/fp32, got {q.dtype} {tuple(q.shape)}",
    )
    batch, q_len, heads, head_dim = q.shape
    require(
        tuple(kv_block.shape) == (batch, q_len, head_dim) and kv_block.dtype == q.dtype,
        f"kv_block must be [{batch}, {q_len}, {head_dim}] {q.dtype}, got {kv_block.dtype} "
        f"{tuple(kv_block.shape)}",
    )
    require(
        ctx_pool.dim() == 2 and ctx_pool.shape[1] == head_dim and ctx_pool.dtype in FLOAT_DTYPES,
        f"ctx_pool must be [N, {head_dim}] bf16/fp16/fp32, got {ctx_pool.dtype} "
        f"{tuple(ctx_pool.shape)}",
    )
    require(
        ctx_slots.dim() == 2 and ctx_slots.shape[0] == batch and ctx_slots.dtype in INDEX_DTYPES,
        f"ctx_slots must be int32/int64 [{batch}, C], got {ctx_slots.dtype} "
        f"{tuple(ctx_slots.shape)}",
    )
    num_ctx = ctx_slots.shape[1]
    require(
        tuple(ctx_valid.shape) == (batch, num_ctx) and ctx_valid.dtype == torch.bool,
        f"ctx_valid must be bool [{batch}, {num_ctx}], got {ctx_valid.dtype} "
        f"{tuple(ctx_valid.shape)}",
    )
    require(
        sinks.dim() == 1 and sinks.shape[0] == heads and sinks.is_floating_point(),
        f"sinks must be float [{heads}], got {sinks.dtype} {tuple(sinks.shape)}",
    )
    check_same_device(
        q=q,
        ctx_pool=ctx_pool,
        ctx_slots=ctx_slots,
        ctx_valid=ctx_valid,
        kv_block=kv_block,
        sinks=sinks,
    )
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        require(
            out.shape == q.shape and out.dtype == q.dtype and out.device == q.device,
            f"out must be {q.dtype} {tuple(q.shape)} on {q.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}",
        )
    tables = epilogue_tables(inverse_rope, batch * q_len, head_dim, sinks)
    if out.numel() == 0:
        return out
    for name, t in (("q", q), ("kv_block", kv_block), ("ctx_pool", ctx_pool), ("out", out)):
        check_unit_stride(name, t)
    require(sinks.stride(0) == 1 or heads == 1, f"sinks must be contiguous, got {sinks.stride()}")
    d_pow2 = max(16, triton.next_power_of_2(head_dim))
    rows = q_len * heads
    block_m = max(16, min(triton.next_power_of_2(rows), _TILE_ELEMS // d_pow2))
    block_n = max(16, min(64, _TILE_ELEMS // d_pow2))
    valid_u8 = ctx_valid.view(torch.uint8)
    _draft_attention_kernel[(batch, triton.cdiv(rows, block_m))](
        q,
        ctx_pool,
        ctx_slots,
        valid_u8,
        kv_block,
        sinks,
        out,
        tables.cos,
        tables.sin,
        tables.stride,
        heads,
        q_len,
        num_ctx,
        scale * _LOG2E,
        tables.rope_dim,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        ctx_pool.stride(0),
        ctx_slots.stride(0),
        ctx_slots.stride(1),
        valid_u8.stride(0),
        valid_u8.stride(1),
        kv_block.stride(0),
        kv_block.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        HEAD_DIM=head_dim,
        D_POW2=d_pow2,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # fp32 must not go through tf32; the CPU interpreter's 16-bit tl.dot returns garbage
        # (triton 3.6), so there the exact 16-bit products are formed in fp32 instead.
        DOT_FP32=q.dtype == torch.float32 or interpreted(_draft_attention_kernel),
        ROUND_P=q.dtype != torch.float32,
        ROPE=inverse_rope is not None,
        KIND=DTYPE_KIND[q.dtype],
        ON_BITS=interpreted(_draft_attention_kernel),
        num_warps=8 if d_pow2 >= 256 else 4,
        enable_fp_fusion=False,
        **programmatic_launch(_draft_attention_kernel, q.device),
    )
    return out
