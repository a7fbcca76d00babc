"""Small-M linear layers on weights kept as stored (W8A16 FP8 block-scaled, W4A16 MXFP4):
`y = x @ dequant(W)^T` for decode-sized batches (made for M <= 16 rows; any M runs, in 16-row
blocks: the batch-invariant linear of `--enable-deterministic-inference`), the weight dequantised
in the kernel (`dequant.py::quantized_product`); `small_m_linear_ref` / `small_m_grouped_linear_ref`
(which dequantise first) are the spec.

At decode sizes the GEMM streams its weight once: it is bound by how fast the stored bytes reach
the SMs and are turned into matrix-unit operands. Each program owns a column block and streams
its weight rows along K through a software pipeline of 16-byte asynchronous copies; each K
step's tile is dequantised in registers (a handful of integer or half-precision operations per
weight, the scale applied to the weights rather than per group to partial sums) and multiplied
by the activation rows, padded to the 16-row matrix tile, in one dot, batched over 128-channel
slices (one warp each) for the narrow blocks (`dequant.py::quantized_product`). Launch shapes
are fixed per shape class (`_quantized_meta`; no autotuning: the engine captures CUDA graphs).

Exactness: within a tolerance of the reference, like `small_m_linear`. The dequantised tile is
bit for bit the reference's dequantised weight (`dequant.py`), every product is exact in fp32 and
the sums are fp32 in an order fixed by the launch shape's K step and slices (per slice in K-step
order, each step in the matrix unit's order, then the slices' sums; the column block does not
enter it), rounded once to the output dtype (nearest even on the bits for bf16). A row's result
depends neither on M nor on the other rows (the tile is always 16 rows, a larger M is more row
blocks, and what orders the sums never depends on M), so a DSpark verify of W tokens gives each
token the bits of a single-token step. A program may own two row blocks (`ROW_BLOCKS`, a launch
shape of `_quantized_meta`) and multiply each dequantised weight tile by both (two dots, one
accumulator each): the weight is then read and decoded once for 32 rows, and each block's sums
are those of a program of its own. The previous kernel (a dot per scale group, scaled
partial sums) summed in another order: not the same bits, the same tolerance.
`quantized_grouped_linear` runs G such products in one launch (the grouped output projection),
each group's bits as its own call (its column blocks may be wider: the same sums).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import FLOAT_DTYPES, require
from sgl_dspark.kernels._triton_utils import (
    DEFAULT_SM_COUNT,
    interpreted,
    prefetch_tile_l2,
    programmatic_launch,
    round_to_bf16,
    sm_count,
    wait_for_producers,
)
from sgl_dspark.kernels.linear.dequant import quantized_product
from sgl_dspark.kernels.linear.reference import QuantizedWeight, check_quantized_weight
from sgl_dspark.kernels.linear.weight_loads import (
    fp4_ptx_decode,
    fp4_rows_aligned,
    quantized_block_k,
    quantized_stages,
    scale_alignment,
    scales_loaded_ahead,
)

MAX_M = 16
_BLOCK_M = 16
# Programs of the narrow launch shape (16-column blocks, four 512-channel stages) an SM holds:
# shared memory allows three.
_NARROW_PROGRAMS_PER_SM = 3
# Row blocks a program owns above 16 rows. Two (each dequantised weight tile multiplied by both)
# read and decode the weight once for 32 rows instead of once per 16; a pipeline stage then
# carries two activation tiles, so the narrow shape takes three stages instead of four (two
# programs an SM by shared memory instead of one). Timed on an H100 at V4.1-Flash's FP8
# projections, 32 rows: 1.05x (o_b) to 1.53x (q_b) against one block a program, 1.13x-1.43x at
# 64 (`benchmark/results/sweeps/2026-12-07_h100_row_blocks_attention_shape_fb35d8a.md`).
_ROW_BLOCKS_ABOVE_TILE = 2


@triton.jit
def _quantized_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_xg,
    stride_wg,
    stride_yg,
    FP4: tl.constexpr,
    PTX: tl.constexpr,
    ALIGNED: tl.constexpr,
    EVEN_K: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SCALES_AHEAD: tl.constexpr,
    SCALE_ALIGN: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (column block, group, row blocks): a group's x columns, weight, scales and output
    # columns start at its group strides (0 for a plain linear); program r owns the ROW_BLOCKS
    # row blocks from row r * ROW_BLOCKS * BLOCK_M, each computed as it would be in a call of
    # its own.
    group = tl.program_id(1).to(tl.int64)
    row0 = tl.program_id(2).to(tl.int64) * (ROW_BLOCKS * BLOCK_M)
    x_ptr += row0 * stride_xm
    y_ptr += row0 * stride_ym
    M -= row0
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_m_2 = offs_m + BLOCK_M < M  # the second row block's rows (ROW_BLOCKS 2)
    mask_n = offs_n < N
    w_ptr += group * stride_wg
    # A group's rows are rows group * N + n of the stacked weight (its scale blocks may span
    # groups).
    scale_row = (group * N + tl.minimum(offs_n, N - 1).to(tl.int64)) // SCALE_ROWS
    if PDL:
        # The weight and its scales are no kernel's output: the first K step's weight lines
        # and every scale line of the program's rows stream into L2 while the previous kernel
        # finishes (hints only: no result bit depends on them).
        PER_ELEMENT: tl.constexpr = 2 if FP4 else 1  # channels per stored byte
        row_len = (K + PER_ELEMENT - 1) // PER_ELEMENT
        FIRST: tl.constexpr = BLOCK_K // PER_ELEMENT
        prefetch_tile_l2(w_ptr, tl.minimum(offs_n, N - 1), stride_wn, 0, row_len, FIRST)
        groups = (K + GROUP - 1) // GROUP
        for g0 in range(0, groups, 256):
            prefetch_tile_l2(s_ptr, scale_row, stride_sn, g0, groups, 256)
    wait_for_producers(PDL)  # x is the previous kernel's output; y may still be read by it
    x_rows = x_ptr + group * stride_xg + offs_m.to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    s_rows = tl.multiple_of(s_ptr + scale_row * stride_sn, SCALE_ALIGN)
    product = quantized_product(
        x_rows,
        mask_m,
        w_rows,
        mask_n,
        s_rows,
        K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        FP4,
        PTX,
        ALIGNED,
        GROUP,
        DOT_FP32,
        SPLIT_K,
        EVEN_K,
        SCALES_AHEAD,
        ROW_BLOCKS == 2,
        x_rows + BLOCK_M * stride_xm,
        mask_m_2,
    )
    y_rows = y_ptr + group * stride_yg + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if ROW_BLOCKS == 2:
        acc, acc_2 = product
        _store_rows(
            y_rows + BLOCK_M * stride_ym,
            acc_2,
            mask_m_2[:, None] & mask_n[None, :],
            ROUND_BF16,
        )
    else:
        acc = product
    _store_rows(y_rows, acc, mask_m[:, None] & mask_n[None, :], ROUND_BF16)


@triton.jit
def _store_rows(y_ptrs, acc, mask, ROUND_BF16: tl.constexpr):
    """A row block's fp32 sums stored in y's dtype, rounded once (nearest even on the bits for
    bf16)."""
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)


def _quantized_meta(
    fmt: str, n: int, k: int, groups: int = 1, sms: int = DEFAULT_SM_COUNT, m: int = 1
) -> dict[str, int]:
    """Launch shape per shape class (the one place sweeps and probes override). What enters a
    sum's order (the K step and its slices) depends on (N, K) only, so a row's bits do not
    depend on the batch; the column block, the pipeline depth and the row blocks a program
    owns (`ROW_BLOCKS`) change no sum.

    More than 16 rows: each program owns `_ROW_BLOCKS_ABOVE_TILE` 16-row blocks; with two it
    multiplies both by every dequantised weight tile (`quantized_product`'s SECOND_ROWS), so 32
    rows read and decode the weight once instead of twice, and the narrow shape's pipeline
    takes three stages of the two blocks' activation tiles.

    N up to 8192: narrow column blocks (16 columns: N = 5120 gives 320 programs). A program then
    has few columns to keep warps busy, so each K step of up to 512 channels is split into
    128-channel slices, one warp each (`quantized_product`'s SPLIT_K): 4 warps and 8 independent
    matrix-unit chains per program. A pipeline stage is mostly the activation tile (16 rows x
    512 channels of bf16, 15 of them padding at M 1); four stages keep three steps in flight in
    74 KB, so three programs share an SM and a few hundred programs run in one wave. The
    previous shape (1024-channel steps over 8 warps, three stages: 99 KB and 124 registers, two
    programs an SM, 1.2 waves at N = 5120) was 1.27x slower at V4.1-Flash's o_b and the rank
    model's bs 1 step 4% slower (`benchmark/results/kernels.md`). More 16-column blocks than
    three an SM (the grouped output projection: 8 groups of 1024 columns give 512 programs, 1.3
    waves on 132 SMs, the last a third full) take 32-column blocks: half the programs in one
    wave, and each activation tile read for twice the weight columns (at 16 rows it outweighs
    the weight tile it multiplies): V4.1's o_a 1.36x / 1.55x / 1.48x at M 1 / 16 / 32 on an H100.
    Wider N (an lm_head): 64-column blocks, 256-channel steps in one dot; 512 programs at N =
    32768 with a pipeline of at most 48 KB, so four share an SM and they all run in one wave."""
    row_blocks = _ROW_BLOCKS_ABOVE_TILE if m > _BLOCK_M else 1
    if n > 8192:
        return {
            "BLOCK_N": 64,
            "BLOCK_K": quantized_block_k(fmt, k),
            "SPLIT_K": 1,
            "ROW_BLOCKS": row_blocks,
            "num_stages": 3,
            "num_warps": 4,
        }
    # fp32 activations (4 bytes) double the activation tile: four stages of it still fit the
    # 227 KB of shared memory an sm90 block may have.
    block_k = quantized_block_k(fmt, k, 512)
    split = max(1, block_k // 128)
    beyond_a_wave = triton.cdiv(n, 16) * groups > _NARROW_PROGRAMS_PER_SM * sms
    return {
        "BLOCK_N": 32 if beyond_a_wave else 16,
        "BLOCK_K": block_k,
        "SPLIT_K": split,
        "ROW_BLOCKS": row_blocks,
        "num_stages": quantized_stages(fmt, 4 if row_blocks == 1 else 3),
        "num_warps": max(2, split),
    }


def _check(x: torch.Tensor, weight: QuantizedWeight, k: int) -> None:
    require(x.dtype in FLOAT_DTYPES, f"x: dtype must be bf16/fp16/fp32, got {x.dtype}")
    check_quantized_weight(weight)
    require(weight.shape[-1] == k, f"weight: expected K={k} channels, got {weight.shape[-1]}")
    require(
        weight.data.device == x.device and weight.scale.device == x.device,
        f"weight is on {weight.data.device}, x on {x.device}",
    )
    require(
        weight.data.stride(-1) == 1 and weight.scale.stride(-1) == 1,
        "weight data and scale need unit stride along K",
    )


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`small_m_linear_ref(x, weight)` for M <= 16 rows in one launch (no host sync;
    graph-safe), the weight dequantised in the kernel.

    Args:
        x: [M, K] bf16/fp16/fp32 with unit stride along K; any M (16-row
            blocks, each row computed as in a call of its own).
        weight: `QuantizedWeight` [N, K] ("fp8" or "mxfp4"; K even for MXFP4).
        out: optional [M, N] buffer of x's dtype with unit stride along N.
    Returns:
        [M, N] in x's dtype (within a tolerance of the reference, module doc).
    """
    require(x.dim() == 2 and weight.data.dim() == 2, "x and weight must be 2-D")
    m, k = x.shape
    _check(x, weight, k)
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    require(
        out.shape == (m, n) and out.dtype == x.dtype and (m == 0 or out.stride(1) == 1),
        f"out: expected [{m}, {n}] {x.dtype} with unit column stride",
    )
    if m == 0 or n == 0:
        return out
    require(x.stride(1) == 1, f"x needs unit stride along K, got {x.stride()}")
    if k == 0:
        return out.zero_()
    _launch(x, weight, out, 1, (0, 0, 0))
    return out


def quantized_grouped_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`small_m_grouped_linear_ref(x, weight)` in one launch: G `quantized_linear`s, each
    group's bits as its own call of its rows.

    Args:
        x: [M, G, K] bf16/fp16/fp32 with unit stride along K; any M (16-row
            blocks, each row computed as in a call of its own).
        weight: `QuantizedWeight` [G * N, K], contiguous rows (group g's weight is rows
            [g * N, (g + 1) * N); its scale blocks may span groups).
    Returns:
        [M, G, N] contiguous in x's dtype.
    """
    require(
        x.dim() == 3 and weight.data.dim() == 2 and weight.shape[0] % max(x.shape[1], 1) == 0,
        f"x must be [M, G, K] and weight [G * N, K], got {tuple(x.shape)} and {weight.shape}",
    )
    m, groups, k = x.shape
    _check(x, weight, k)
    n = weight.shape[0] // max(groups, 1)
    out = torch.empty((m, groups, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or groups == 0:
        return out
    require(x.stride(2) == 1, f"x needs unit stride along K, got {x.stride()}")
    if k == 0:
        return out.zero_()
    first = weight._replace(data=weight.data[:n])
    strides = (x.stride(1), n * weight.data.stride(0), out.stride(1))
    _launch(x[:, 0], first, out[:, 0], groups, strides)
    return out


def _launch(
    x: torch.Tensor,
    weight: QuantizedWeight,
    out: torch.Tensor,
    groups: int,
    group_strides: tuple[int, int, int],
) -> None:
    """One launch over (column blocks, groups); x / weight / out are a group's first views
    (the weight group stride in stored elements)."""
    (m, k), n = x.shape, weight.data.shape[0]
    meta = _quantized_meta(weight.fmt, n, k, groups, sm_count(x.device), m)
    data = weight.data
    stride_xg, stride_wg, stride_yg = group_strides
    rows = meta["ROW_BLOCKS"] * _BLOCK_M
    grid = (triton.cdiv(n, meta["BLOCK_N"]), groups, triton.cdiv(m, rows))
    _quantized_linear_kernel[grid](
        x,
        data,
        weight.scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        data.stride(0),
        weight.scale.stride(0),
        out.stride(0),
        stride_xg,
        stride_wg,
        stride_yg,
        FP4=weight.fmt == "mxfp4",
        PTX=fp4_ptx_decode(x.device),
        ALIGNED=fp4_rows_aligned(weight),
        EVEN_K=k % meta["BLOCK_K"] == 0,
        SCALES_AHEAD=scales_loaded_ahead(
            weight, meta["BLOCK_N"], meta["BLOCK_K"], meta["num_warps"]
        ),
        SCALE_ALIGN=scale_alignment(weight),
        GROUP=weight.group,
        SCALE_ROWS=weight.block_rows,
        BLOCK_M=_BLOCK_M,
        ROUND_BF16=x.dtype == torch.bfloat16,
        # The matrix unit takes bf16 x with bf16 weights; fp32 (never through tf32) and fp16 x
        # multiply the exact fp32 weights, as does the CPU interpreter, whose 16-bit tl.dot and
        # bf16 arithmetic are unreliable (the products are exact either way).
        DOT_FP32=x.dtype != torch.bfloat16 or interpreted(_quantized_linear_kernel),
        **meta,
        **programmatic_launch(_quantized_linear_kernel, x.device),
    )


__all__ = ["MAX_M", "quantized_grouped_linear", "quantized_linear"]
