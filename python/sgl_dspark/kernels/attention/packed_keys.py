"""Sink attention over keys read from packed caches and decoded in the attention's own loads
(DeepSeek-V4.1: the FP8 window KV, then the FP4 latents a token's top-k selected), one launch
(two for small batches: `splits.py`). `sink_attention_ref` over the decoded keys is the spec.

A token attends up to two key sources, one after the other in its key range: each is a cache
(packed bytes and scale bytes, or plain rows) with the token's cache rows `[T, N]` and their
validity `[T, N]`. A key tile loads its rows' stored bytes and scale bytes and decodes them
(`quant/load.py::load_rows_tile`, `quant_load_ref`'s bits: an exact decode, one fp32 product, one
round to q's dtype), so no decoded copy of the keys is written or read back: a key costs its stored
bytes (a window key 528 bytes, a latent 288, instead of 1024 decoded and 1024 read again), and
the two sources need neither a joined validity nor a keys tensor per forward.

Exactness: the keys are `quant_load_ref`'s values; the tile shape, split choice, key order and
online softmax are `window_sparse_attention`'s over the same keys gathered per token (its extra
keys, no window), so where source a's key count is a multiple of the key tile (DeepSeek-V4.1's
window of 128: tiles of 16 keys at Dh 512) this kernel gives that kernel's bits (tested);
otherwise a tile holds one source's keys where the gathered keys' tile would straddle both, and
the sums are grouped otherwise: within the reference's tolerance, as both kernels are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import INDEX_DTYPES, require
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    programmatic_launch,
    sm_count,
    wait_for_producers,
)
from sgl_dspark.kernels.attention.online_softmax import online_softmax_step
from sgl_dspark.kernels.attention.splits import (
    auto_num_splits,
    finish_program,
    merge_splits,
    split_scratch,
    tile_shape,
)
from sgl_dspark.kernels.attention.window_sparse import LOG2E
from sgl_dspark.kernels.quant.load import BLOCKS, PLAIN, ROW_FORMATS, load_rows_tile, stored_width
from sgl_dspark.kernels.rope.epilogue import epilogue_tables


class KeySource(NamedTuple):
    """The keys a token attends in one cache: `data` uint8 [R, W] packed codes (W = Dh for
    "fp8_window", Dh / 2 E2M1 pairs for "fp4_latent" / "fp4_index") with `scales` uint8
    [R, Dh / block], or plain rows [R, Dh] of q's dtype (`fmt` "plain", `scales` None); `rows`
    int32/int64 [T, N] the token's cache rows, `valid` bool [T, N] which of them it sees (rows
    are read only where valid)."""

    data: torch.Tensor
    scales: torch.Tensor | None
    fmt: str
    rows: torch.Tensor
    valid: torch.Tensor


@triton.jit
def _source_keys(
    data_ptr,
    data_stride,
    scales_ptr,
    scales_stride,
    rows_row,
    valid_row,
    idx,
    in_range,
    dims,
    dim_ok,
    FMT: tl.constexpr,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """Keys idx [BLOCK_N] of one source for one token (its rows and validity from `rows_row`
    / `valid_row`), decoded to fp32 holding q's dtype's values (zero where not valid), and
    their validity."""
    valid = tl.load(valid_row + idx, mask=in_range, other=0) != 0
    rows = tl.load(rows_row + idx, mask=valid, other=0).to(tl.int64)
    keys = load_rows_tile(
        data_ptr,
        data_stride,
        scales_ptr,
        scales_stride,
        rows,
        valid,
        dims,
        dim_ok,
        FMT,
        BLOCK,
        KIND,
        ON_BITS,
    )
    return keys, valid


@triton.jit
def _packed_key_attention_kernel(
    q_ptr,
    sinks_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    cos_ptr,
    sin_ptr,
    cs_stride,
    a_data_ptr,
    a_data_stride,
    a_scales_ptr,
    a_scales_stride,
    a_rows_ptr,
    a_rows_stride,
    a_valid_ptr,
    a_valid_stride,
    a_n,
    b_data_ptr,
    b_data_stride,
    b_scales_ptr,
    b_scales_stride,
    b_rows_ptr,
    b_rows_stride,
    b_valid_ptr,
    b_valid_stride,
    b_n,
    num_heads,
    qk_scale,
    tiles_per_split,
    rope_dim,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    HEAD_DIM: tl.constexpr,
    D_POW2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    A_FMT: tl.constexpr,
    A_BLOCK: tl.constexpr,
    HAS_B: tl.constexpr,
    B_FMT: tl.constexpr,
    B_BLOCK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROUND_P: tl.constexpr,
    SPLIT: tl.constexpr,
    ROPE: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, head block, split) covers the key tiles [split, split + 1) *
    # tiles_per_split of the token's keys: source a's cdiv(a_n, BLOCK_N) tiles, then source
    # b's (the window's tiles, then the extra keys', as `window_sparse_attention` walks them).
    wait_for_producers(PDL)  # q and the cache rows come from the launches before this one
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dims = tl.arange(0, D_POW2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token * q_stride_t + heads[:, None].to(tl.int64) * q_stride_h + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    kv_dtype = q_ptr.dtype.element_ty
    sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    # The running max starts at the (finite) sink: masked keys give exp2(-inf) = 0.
    m_i = sink
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_POW2], dtype=tl.float32)

    a_rows = a_rows_ptr + token * a_rows_stride
    a_valid = a_valid_ptr + token * a_valid_stride
    b_rows = b_rows_ptr + token * b_rows_stride
    b_valid = b_valid_ptr + token * b_valid_stride
    tile_lo = tl.program_id(2) * tiles_per_split
    tile_hi = tile_lo + tiles_per_split
    a_tiles = tl.cdiv(a_n, BLOCK_N)
    offs = tl.arange(0, BLOCK_N)
    for n0 in range(
        tl.minimum(tile_lo, a_tiles) * BLOCK_N, tl.minimum(tile_hi, a_tiles) * BLOCK_N, BLOCK_N
    ):
        idx = n0 + offs
        v, valid = _source_keys(
            a_data_ptr,
            a_data_stride,
            a_scales_ptr,
            a_scales_stride,
            a_rows,
            a_valid,
            idx,
            idx < a_n,
            dims,
            dim_ok,
            A_FMT,
            A_BLOCK,
            KIND,
            ON_BITS,
        )
        m_i, l_i, acc = online_softmax_step(
            q, v.to(kv_dtype), valid, m_i, l_i, acc, qk_scale, DOT_FP32, ROUND_P
        )
    if HAS_B:
        # Negative when this split ends inside source a: the loop is then empty.
        b_start = tl.maximum(tile_lo - a_tiles, 0) * BLOCK_N
        b_stop = tl.minimum((tile_hi - a_tiles) * BLOCK_N, b_n)
        for n0 in range(b_start, b_stop, BLOCK_N):
            idx = n0 + offs
            v, valid = _source_keys(
                b_data_ptr,
                b_data_stride,
                b_scales_ptr,
                b_scales_stride,
                b_rows,
                b_valid,
                idx,
                idx < b_n,
                dims,
                dim_ok,
                B_FMT,
                B_BLOCK,
                KIND,
                ON_BITS,
            )
            m_i, l_i, acc = online_softmax_step(
                q, v.to(kv_dtype), valid, m_i, l_i, acc, qk_scale, DOT_FP32, ROUND_P
            )

    finish_program(
        acc,
        m_i,
        l_i,
        sink,
        token,
        heads,
        head_ok,
        dims,
        dim_ok,
        out_ptr,
        part_m_ptr,
        part_l_ptr,
        out_stride_t,
        out_stride_h,
        num_heads,
        cos_ptr,
        sin_ptr,
        cs_stride,
        rope_dim,
        HEAD_DIM,
        BLOCK_H,
        D_POW2,
        SPLIT,
        ROPE,
        KIND,
        ON_BITS,
    )


def _source_args(
    name: str, src: KeySource, tokens: int, head_dim: int, q: torch.Tensor
) -> tuple[list[object], int, int]:
    """A source's checks (ValueError naming it) -> (its pointer and stride arguments, the
    kernel's order; its format code; its block)."""
    require(isinstance(src, KeySource), f"{name}: expected a KeySource, got {type(src)}")
    data, scales, fmt, rows, valid = src
    require(
        rows.dim() == 2 and rows.shape[0] == tokens and rows.dtype in INDEX_DTYPES,
        f"{name}.rows: expected int32/int64 [{tokens}, N], got {rows.dtype} {tuple(rows.shape)}",
    )
    require(
        valid.shape == rows.shape and valid.dtype == torch.bool,
        f"{name}.valid: expected bool {tuple(rows.shape)}, got {valid.dtype} {tuple(valid.shape)}",
    )
    for part, t in (("rows", rows), ("valid", valid)):
        require(
            t.shape[1] <= 1 or t.stride(1) == 1,
            f"{name}.{part}: expected unit stride along N, got strides {t.stride()}",
        )
    for part, t in (("data", data), ("rows", rows), ("valid", valid)):
        require(t.device == q.device, f"{name}.{part}: expected device {q.device}, got {t.device}")
    if fmt == "plain":
        require(scales is None, f"{name}.scales: plain rows take none")
        require(
            data.dim() == 2 and data.shape[1] == head_dim and data.dtype == q.dtype,
            f"{name}.data: plain rows must be {q.dtype} [R, {head_dim}], got {data.dtype} "
            f"{tuple(data.shape)}",
        )
        scales_arg, scales_stride, code, block = data, 0, PLAIN, 1
    else:
        require(fmt in ROW_FORMATS, f"{name}.fmt: expected one of {tuple(ROW_FORMATS)}")
        block = BLOCKS[fmt]
        width = stored_width(fmt, head_dim)
        require(
            head_dim % block == 0
            and data.dtype == torch.uint8
            and data.dim() == 2
            and data.shape[1] == width,
            f"{name}.data: {fmt} rows of Dh={head_dim} must be uint8 [R, {width}] "
            f"(Dh a multiple of {block}), got {data.dtype} {tuple(data.shape)}",
        )
        require(
            scales is not None
            and scales.dtype == torch.uint8
            and scales.shape == (data.shape[0], head_dim // block)
            and scales.stride(1) == 1
            and scales.device == q.device,
            f"{name}.scales: expected uint8 [{data.shape[0]}, {head_dim // block}] with unit "
            f"stride on {q.device}",
        )
        assert scales is not None
        scales_arg, scales_stride, code = scales, scales.stride(0), ROW_FORMATS[fmt]
    require(data.stride(1) == 1, f"{name}.data: expected unit stride along a row")
    args = [
        data,
        data.stride(0),
        scales_arg,
        scales_stride,
        rows,
        rows.stride(0),
        valid.view(torch.uint8),
        valid.stride(0),
        rows.shape[1],
    ]
    return args, code, block


def packed_key_attention(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sinks: torch.Tensor,
    scale: float,
    *,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Sink attention of q `[T, H, Dh]` (bf16/fp16/fp32, unit stride along Dh) over one or two
    key sources (`KeySource`, attended in order), no host sync (CUDA-graph safe).

    sinks `[H]` finite, scale the logits' factor; inverse_rope, out and num_splits as in
    `window_sparse_attention` (None: split only when tokens x head blocks leaves SMs idle).
    Returns `[T, H, Dh]` in q's dtype (`out` when given). Raises ValueError on a bad shape,
    dtype or layout, naming the argument.
    """
    require(
        q.dim() == 3 and q.dtype in DTYPE_KIND and q.stride(2) == 1,
        f"q: expected [T, H, Dh] bf16/fp16/fp32 with unit stride along Dh, got {q.dtype} "
        f"{tuple(q.shape)}",
    )
    tokens, heads, head_dim = q.shape
    require(1 <= len(sources) <= 2, f"sources: expected one or two, got {len(sources)}")
    require(
        sinks.dim() == 1 and sinks.shape[0] == heads and (sinks.stride(0) == 1 or heads == 1),
        f"sinks: expected contiguous [{heads}], got {tuple(sinks.shape)}",
    )
    require(num_splits is None or num_splits >= 1, f"num_splits: must be >= 1, got {num_splits}")
    args_a, fmt_a, block_a = _source_args("sources[0]", sources[0], tokens, head_dim, q)
    n_a = sources[0].rows.shape[1]
    has_b = len(sources) == 2
    if has_b:
        args_b, fmt_b, block_b = _source_args("sources[1]", sources[1], tokens, head_dim, q)
        n_b = sources[1].rows.shape[1]
    else:  # b's pointers are never read (HAS_B false)
        args_b, fmt_b, block_b, n_b = [*args_a[:-1], 0], 0, 1, 0
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    require(
        out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1,
        f"out: expected {q.dtype} {tuple(q.shape)} with unit stride along Dh, got {out.dtype} "
        f"{tuple(out.shape)}",
    )
    tables = epilogue_tables(inverse_rope, tokens, head_dim, sinks)
    if tokens == 0 or heads == 0:
        return out
    shape = tile_shape(heads, head_dim)
    head_blocks = triton.cdiv(heads, shape.block_h)
    total_tiles = triton.cdiv(n_a, shape.block_n) + triton.cdiv(n_b, shape.block_n)
    if num_splits is None:
        num_splits = auto_num_splits(tokens * head_blocks, total_tiles, sm_count(q.device))
    scratch = split_scratch(out, num_splits)
    _packed_key_attention_kernel[(tokens, head_blocks, num_splits)](
        q,
        sinks,
        scratch.first_out,
        scratch.part_m,
        scratch.part_l,
        tables.cos,
        tables.sin,
        tables.stride,
        *args_a,
        *args_b,
        heads,
        scale * LOG2E,
        triton.cdiv(total_tiles, num_splits),
        tables.rope_dim,
        q.stride(0),
        q.stride(1),
        *scratch.out_strides,
        HEAD_DIM=head_dim,
        D_POW2=shape.d_pow2,
        BLOCK_H=shape.block_h,
        BLOCK_N=shape.block_n,
        A_FMT=fmt_a,
        A_BLOCK=block_a,
        HAS_B=has_b,
        B_FMT=fmt_b,
        B_BLOCK=block_b,
        # as `window_sparse_attention`: no tf32 for fp32; exact products on the interpreter
        DOT_FP32=q.dtype == torch.float32 or q.device.type == "cpu",
        ROUND_P=q.dtype != torch.float32,
        SPLIT=num_splits > 1,
        ROPE=inverse_rope is not None,
        KIND=DTYPE_KIND[q.dtype],
        ON_BITS=interpreted(_packed_key_attention_kernel),
        num_warps=shape.num_warps,
        enable_fp_fusion=False,
        **programmatic_launch(_packed_key_attention_kernel, q.device),
    )
    if num_splits > 1:
        merge_splits(scratch, sinks, out, tables, inverse_rope is not None)
    return out


__all__ = ["KeySource", "packed_key_attention"]
