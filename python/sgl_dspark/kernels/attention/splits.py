"""The key-range split of the sink-attention kernels (`window_sparse.py`, `packed_keys.py`): the
tile shape of a program, how many splits a small batch takes, a program's last step (the
normalised output, or its fp32 partial), and the launch that merges the partials.

A program owns (token, head block, split): the key tiles [split, split + 1) * tiles_per_split
of the token's key range. With one split it writes the normalised output (the sink's share in
the normaliser, the inverse rope of the output's rope channels in the epilogue); with several
(flash-decoding, for batches that leave SMs idle) each writes its running max m, sum l and
unnormalised accumulator to fp32 scratch, and `_merge_attention_splits_kernel` combines them
with the sink.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    programmatic_launch,
    round_to_dtype,
    wait_for_producers,
)
from sgl_dspark.kernels.rope.epilogue import EpilogueTables, rotate_rounded_tail

# Register budget of one program: BLOCK_H x Dh fp32 accumulator and BLOCK_N x Dh key tile.
_TILE_ELEMS = 8192
# Split-K choice (see `auto_num_splits`): aim for ~2 programs per SM, never fewer than two key
# tiles per split (a split must amortise its q load and its partial write), at most 32 splits.
_WAVES = 2
_MIN_TILES_PER_SPLIT = 2
_MAX_SPLITS = 32


class TileShape(NamedTuple):
    """A program's tile: Dh padded to a power of two, heads a program, keys a tile, warps."""

    d_pow2: int
    block_h: int
    block_n: int
    num_warps: int


def tile_shape(heads: int, head_dim: int) -> TileShape:
    """The tile of the sink-attention kernels for `heads` query heads of `head_dim` channels.
    Both kernels take the same one, so the same keys in the same order give the same bits."""
    d_pow2 = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, min(triton.next_power_of_2(heads), _TILE_ELEMS // d_pow2))
    block_n = max(16, min(64, _TILE_ELEMS // d_pow2))
    return TileShape(d_pow2, block_h, block_n, 8 if d_pow2 >= 256 else 4)


def auto_num_splits(programs: int, total_tiles: int, sm_count: int) -> int:
    """Splits per (token, head block): 1 when the single pass already has a program per SM,
    else enough to give ~`_WAVES` programs per SM, capped so each split keeps
    `_MIN_TILES_PER_SPLIT` key tiles and at most `_MAX_SPLITS` partials are merged."""
    if programs >= sm_count:
        return 1
    want = triton.cdiv(_WAVES * sm_count, programs)
    return max(1, min(want, triton.cdiv(total_tiles, _MIN_TILES_PER_SPLIT), _MAX_SPLITS))


class SplitScratch(NamedTuple):
    """Where a launch's programs write: the output (one split) or the fp32 partials
    (acc [T, S, H, Dh], m and l [T, S, H]) and the output's strides the kernel uses."""

    first_out: torch.Tensor
    part_m: torch.Tensor
    part_l: torch.Tensor
    out_strides: tuple[int, int]


def split_scratch(out: torch.Tensor, num_splits: int) -> SplitScratch:
    """The partials of `num_splits` splits of out `[T, H, Dh]` (fully overwritten by the split
    launch: every split writes, empty ones too), or `out` itself for one split."""
    if num_splits == 1:  # part_m / part_l are never touched (SPLIT false)
        return SplitScratch(out, out, out, (out.stride(0), out.stride(1)))
    tokens, heads, head_dim = out.shape
    dev = out.device
    part_acc = torch.empty((tokens, num_splits, heads, head_dim), dtype=torch.float32, device=dev)
    part_m = torch.empty((tokens, num_splits, heads), dtype=torch.float32, device=dev)
    # partial strides are implied by the shape
    return SplitScratch(part_acc, part_m, torch.empty_like(part_m), (0, 0))


@triton.jit
def finish_program(
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
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D_POW2: tl.constexpr,
    SPLIT: tl.constexpr,
    ROPE: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """A program's last step. SPLIT: its partial (rows of [T, S, H(, Dh)], contiguous over
    heads and dims; out_ptr is the fp32 acc). Else the normalised output rounded to the
    output's dtype, its rope channels rotated back when ROPE (`rope_tail`'s bits)."""
    if SPLIT:
        row = (token * tl.num_programs(2) + tl.program_id(2)) * num_heads + heads
        tl.store(part_m_ptr + row, m_i, mask=head_ok)
        tl.store(part_l_ptr + row, l_i, mask=head_ok)
        tl.store(
            out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=head_ok[:, None] & dim_ok[None, :],
        )
    else:
        denom = l_i + tl.exp2(sink - m_i)  # the sink's share of the normaliser (its value is zero)
        out = round_to_dtype(acc / denom[:, None], KIND, ON_BITS)
        if ROPE:
            out = rotate_rounded_tail(
                out,
                token + heads * 0,
                head_ok,
                cos_ptr,
                sin_ptr,
                cs_stride,
                0,
                HEAD_DIM,
                rope_dim,
                BLOCK_H,
                D_POW2,
                True,
                KIND,
                ON_BITS,
            )
        tl.store(
            out_ptr
            + token * out_stride_t
            + heads[:, None].to(tl.int64) * out_stride_h
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _merge_attention_splits_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    sinks_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    cs_stride,
    num_heads,
    num_splits,
    out_stride_t,
    out_stride_h,
    rope_dim,
    HEAD_DIM: tl.constexpr,
    S_POW2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, head, dim block): o = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s
    # + 2^(sink - M)) with M = max(sink, max_s m_s), which is finite, so a partial with
    # m_s = -inf (or a split slot past num_splits) has weight exactly 0 and never makes a NaN.
    wait_for_producers(PDL)  # the partials come from the split launch just before
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    splits = tl.arange(0, S_POW2)
    split_ok = splits < num_splits
    row = (token * num_splits + splits) * num_heads + head  # [S_POW2]
    m = tl.load(part_m_ptr + row, mask=split_ok, other=float("-inf"))
    l_part = tl.load(part_l_ptr + row, mask=split_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    m_max = tl.maximum(tl.max(m, axis=0), sink)
    weight = tl.exp2(m - m_max)
    denom = tl.sum(l_part * weight, axis=0) + tl.exp2(sink - m_max)
    out = round_to_dtype(tl.sum(acc * weight[:, None], axis=0) / denom, KIND, ON_BITS)
    if ROPE:  # the inverse rotation of the output's rope channels (`rope_tail`'s bits)
        out = tl.reshape(
            rotate_rounded_tail(
                out[None, :],
                token + tl.zeros([1], tl.int64),
                tl.full([1], True, tl.int1),
                cos_ptr,
                sin_ptr,
                cs_stride,
                tl.program_id(2) * BLOCK_D,
                HEAD_DIM,
                rope_dim,
                1,
                BLOCK_D,
                True,
                KIND,
                ON_BITS,
            ),
            [BLOCK_D],
        )
    tl.store(
        out_ptr + token * out_stride_t + head * out_stride_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def merge_splits(
    scratch: SplitScratch,
    sinks: torch.Tensor,
    out: torch.Tensor,
    tables: EpilogueTables,
    rope: bool,
) -> None:
    """The merge launch after a split launch wrote `scratch` (more than one split)."""
    tokens, num_splits, heads, head_dim = scratch.first_out.shape
    s_pow2 = triton.next_power_of_2(num_splits)
    d_pow2 = max(16, triton.next_power_of_2(head_dim))
    block_d = max(16, min(d_pow2, _TILE_ELEMS // s_pow2))
    _merge_attention_splits_kernel[(tokens, heads, triton.cdiv(head_dim, block_d))](
        scratch.first_out,
        scratch.part_m,
        scratch.part_l,
        sinks,
        out,
        tables.cos,
        tables.sin,
        tables.stride,
        heads,
        num_splits,
        out.stride(0),
        out.stride(1),
        tables.rope_dim,
        HEAD_DIM=head_dim,
        S_POW2=s_pow2,
        BLOCK_D=block_d,
        ROPE=rope,
        KIND=DTYPE_KIND[out.dtype],
        ON_BITS=interpreted(_merge_attention_splits_kernel),
        num_warps=4,
        enable_fp_fusion=False,
        **programmatic_launch(_merge_attention_splits_kernel, out.device),
    )


__all__ = [
    "SplitScratch",
    "TileShape",
    "auto_num_splits",
    "finish_program",
    "merge_splits",
    "split_scratch",
    "tile_shape",
]
