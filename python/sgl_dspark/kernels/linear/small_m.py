"""Small-M linear layer `y = x @ W^T` for decode-sized batches (made for M <= 16 rows; any M
runs, in 16-row blocks: the batch-invariant linear of `--enable-deterministic-inference`).

At batch size 1 the dense projections of a decode step (q/kv/compressor/indexer projections,
output projection, shared expert, lm_head) are GEMVs that read a few MB each. The BLAS picks
wide output tiles for them (e.g. 64 columns per program: 16 programs for N = 1024, far fewer
than the GPU has SMs), so the weights stream through a fraction of the machine. This kernel
gives each program a narrow column block (16 columns, so N = 1024 spreads over 64 programs),
streams its K loop with a deep pipeline and does the math on the matrix units (`tl.dot` with the
M rows padded to 16; compute is free at this size). `small_m_linear_ref` is the spec.

Exactness: within a tolerance of the reference. Each output is an fp32 dot product over K in BLOCK_K
chunks (chunk order fixed, in-chunk order the matrix unit's), rounded once to the output dtype (RNE
on the bits for bf16, so the interpreter's truncating cast is never used); the BLAS sums in another
order. A row's result does not depend on M (the tile is always 16 rows, a larger M is more
row blocks of the same program) or on the other rows.

`small_m_grouped_linear` runs G such products side by side in one launch (the grouped output
projection: group g multiplies its own K columns of x by its own weight), each group exactly
as `small_m_linear` would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import FLOAT_DTYPES, require
from sgl_dspark.kernels._triton_utils import (
    interpreted,
    prefetch_tile_l2,
    programmatic_launch,
    round_to_bf16,
    wait_for_producers,
)

MAX_M = 16
_BLOCK_M = 16
_BLOCK_K = 256


@triton.jit
def _small_m_linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_xg,
    stride_wg,
    stride_yg,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (column block, group, row block): a group's x columns, weight and output columns
    # start at its group strides (0 and one group for a plain linear); row block r owns rows
    # [r * BLOCK_M, (r + 1) * BLOCK_M), each computed as it would be in a call of its own.
    group = tl.program_id(1).to(tl.int64)
    row0 = tl.program_id(2).to(tl.int64) * BLOCK_M
    x_ptr += group * stride_xg + row0 * stride_xm
    w_ptr += group * stride_wg
    y_ptr += group * stride_yg + row0 * stride_ym
    M -= row0
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if PDL:
        # The weight is no kernel's output and dominates the bytes: its first K tile streams
        # into L2 while the previous kernel finishes. A prefetch rather than a peeled load
        # keeps the pipelined K loop (and so every bit) as it is (K >= 1 here).
        prefetch_tile_l2(w_ptr, tl.minimum(offs_n, N - 1), stride_wn, 0, K, BLOCK_K)
    wait_for_producers(PDL)  # x is the previous kernel's output; y may still be read by it
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _linear_meta(n: int, element_size: int) -> dict[str, int]:
    """Launch shape (the one place sweeps and probes override): narrow column blocks spread
    small N over many programs; wide N (an lm_head) has programs enough with wider blocks,
    which amortise the reads of x."""
    block_n = 16 if n <= 8192 else 64
    # Shared memory per pipeline stage is (16 + BLOCK_N) x BLOCK_K elements: keep 4 stages of
    # fp32 wide blocks within the per-block shared memory of both GPU targets
    # (`test/registered/kernels/gpu_targets_check.py` checks it).
    block_k = _BLOCK_K if element_size <= 2 else _BLOCK_K // 2
    # Two warps for the 16 x 16 bf16 tile: the same bits, fewer threads waiting on the same
    # weight stream (`benchmark/kernels/probe_gemv.py` compares them).
    warps = 2 if block_n <= 16 and element_size <= 2 else 4
    return {
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "num_stages": 4 if block_n <= 16 else 3,
        "num_warps": warps,
    }


def small_m_linear(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`small_m_linear_ref` for M <= 16 rows in one launch (no host sync; graph-safe).

    Args:
        x: [M, K] bf16/fp16/fp32 with unit stride along K (any row stride: e.g. a column block
            of a wider activation); any M (16-row
            blocks, each row computed as in a call of its own).
        weight: [N, K] of x's dtype, unit stride along K.
        out: optional [M, N] buffer of x's dtype with unit stride along N.
    Returns:
        [M, N] in x's dtype (within a tolerance of `small_m_linear_ref`, module doc).
    """
    require(
        x.dim() == 2 and weight.dim() == 2,
        f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}",
    )
    m, k = x.shape
    n = weight.shape[0]
    require(
        x.dtype in FLOAT_DTYPES,
        f"x: dtype must be bf16/fp16/fp32, got {x.dtype}",
    )
    require(weight.dtype == x.dtype, f"weight: dtype {weight.dtype} != x's {x.dtype}")
    require(weight.shape[1] == k, f"weight: expected K={k} columns, got {weight.shape[1]}")
    require(x.device == weight.device, f"weight is on {weight.device}, x on {x.device}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    require(
        out.shape == (m, n) and out.dtype == x.dtype and (m == 0 or out.stride(1) == 1),
        f"out: expected [{m}, {n}] {x.dtype} with unit column stride, got "
        f"{out.dtype} {tuple(out.shape)}",
    )
    if m == 0 or n == 0:
        return out
    require(
        x.stride(1) == 1 and weight.stride(1) == 1,
        f"x and weight need unit stride along K, got {x.stride()} and {weight.stride()}",
    )
    if k == 0:
        return out.zero_()
    _launch(x, weight, out, groups=1, group_strides=(0, 0, 0))
    return out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    groups: int,
    group_strides: tuple[int, int, int],
) -> None:
    """One launch over (column blocks, groups); x / weight / out are a group's first [M, K] /
    [N, K] / [M, N] views (row strides from them), the group strides move to the next."""
    (m, k), n = x.shape, weight.shape[0]
    meta = _linear_meta(n, x.element_size())
    grid = (triton.cdiv(n, meta["BLOCK_N"]), groups, triton.cdiv(m, _BLOCK_M))
    _small_m_linear_kernel[grid](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        *group_strides,
        BLOCK_M=_BLOCK_M,
        ROUND_BF16=x.dtype == torch.bfloat16,
        # fp32 must not go through tf32; the CPU interpreter's bf16 tl.dot returns garbage
        # (triton 3.6), so there the (exact) bf16 products are formed in fp32 instead.
        DOT_FP32=x.dtype == torch.float32 or interpreted(_small_m_linear_kernel),
        **meta,
        **programmatic_launch(_small_m_linear_kernel, x.device),
    )


def small_m_grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`small_m_grouped_linear_ref` in one launch: G independent `small_m_linear`s, each
    group's bits as its own call.

    Args:
        x: [M, G, K] bf16/fp16/fp32 with unit stride along K (row and group strides free);
            any M (16-row
            blocks, each row computed as in a call of its own).
        weight: [G, N, K] of x's dtype, unit stride along K.
    Returns:
        [M, G, N] contiguous in x's dtype (within a tolerance of `small_m_grouped_linear_ref`).
    """
    require(
        x.dim() == 3
        and weight.dim() == 3
        and x.shape[1] == weight.shape[0]
        and x.shape[2] == weight.shape[2],
        f"x must be [M, G, K] and weight [G, N, K], got {tuple(x.shape)} and {tuple(weight.shape)}",
    )
    require(
        x.dtype in FLOAT_DTYPES and weight.dtype == x.dtype,
        f"x and weight: one dtype of bf16/fp16/fp32, got {x.dtype} and {weight.dtype}",
    )
    m, groups, k = x.shape
    n = weight.shape[1]
    require(x.device == weight.device, f"weight is on {weight.device}, x on {x.device}")
    out = torch.empty((m, groups, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or groups == 0:
        return out
    require(
        x.stride(2) == 1 and weight.stride(2) == 1,
        f"x and weight need unit stride along K, got {x.stride()} and {weight.stride()}",
    )
    if k == 0:
        return out.zero_()
    _launch(x[:, 0], weight[0], out[:, 0], groups, (x.stride(1), weight.stride(0), out.stride(1)))
    return out
