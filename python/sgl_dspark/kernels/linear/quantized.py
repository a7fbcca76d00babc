"""Small-M linear layers on weights kept as stored (W8A16 FP8 block-scaled, W4A16 MXFP4):
`y = x @ dequant(W)^T` for decode-sized batches (M <= 16 rows), the weight dequantised in the
kernel (`dequant.py::quantized_chunk_dot`); `small_m_linear_ref` / `small_m_grouped_linear_ref`
(which dequantise first) are the spec.

The shape of `small_m.py`'s kernel: each program owns a narrow column block and streams its
weight rows along K with a deep pipeline; the activation rows are padded to the 16-row matrix
tile. The stored weight has 1/2 (FP8) or 1/4 (MXFP4) of bf16's bytes, so the K step grows by the
same factor (`_quantized_meta`): a pipeline stage then moves as many weight bytes as the bf16
kernel's, which keeps as many loads in flight per program. Within a step the channels are taken
one scale group at a time (a dot per group, then the group's scale per column).

Exactness: within a tolerance of the reference, like `small_m_linear`: the products are exact
and the sums are fp32 in chunk order (each chunk in the matrix unit's order), rounded once to the
output dtype (nearest even on the bits for bf16). A row's result depends neither on M nor on the
other rows. `quantized_grouped_linear` runs G such products in one launch (the grouped output
projection), each group's bits as its own call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import FLOAT_DTYPES, require
from sgl_dspark.kernels._triton_utils import programmatic_launch, round_to_bf16, wait_for_producers
from sgl_dspark.kernels.linear.dequant import (
    chunk_channels,
    quantized_block_k,
    quantized_chunk_dot,
)
from sgl_dspark.kernels.linear.reference import QuantizedWeight, check_quantized_weight

MAX_M = 16
_BLOCK_M = 16


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
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (column block, group): a group's x columns, weight, scales and output columns
    # start at its group strides (0 for a plain linear).
    group = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    wait_for_producers(PDL)  # x is the previous kernel's output; y may still be read by it
    x_rows = x_ptr + group * stride_xg + offs_m.to(tl.int64) * stride_xm
    w_rows = w_ptr + group * stride_wg + offs_n.to(tl.int64) * stride_wn
    # A group's rows are rows group * N + n of the stacked weight (its scale blocks may span
    # groups).
    s_rows = s_ptr + ((group * N + offs_n.to(tl.int64)) // SCALE_ROWS) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB):
            acc += quantized_chunk_dot(
                x_rows, mask_m, w_rows, mask_n, s_rows, k0 + j * SUB, K, FP4, SUB, GROUP, DOT_FP32
            )
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    y_rows = y_ptr + group * stride_yg + offs_m[:, None].to(tl.int64) * stride_ym
    tl.store(
        y_rows + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _quantized_meta(fmt: str, group: int, n: int, k: int) -> dict[str, int]:
    """Launch shape (the one place sweeps and probes override). Column blocks as the bf16
    kernel's; the K step carries 512 weight bytes per row (as the bf16 kernel's 256 channels),
    so FP8 steps 512 channels and MXFP4 1024, at most 16 scale groups a step (each group is a
    dot of its own: small groups take a shorter step and a deeper pipeline instead)."""
    block_n = 16 if n <= 8192 else 64
    per_byte = 2 if fmt == "mxfp4" else 1
    block_k = quantized_block_k(fmt, k, min(512 * per_byte, 16 * group))
    stages = 4 if block_k * (1 if fmt == "fp8" else 0.5) >= 256 else 6
    return {
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "num_stages": stages if block_n <= 16 else 3,
        "num_warps": 4,
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
        x: [M, K] bf16/fp16/fp32 with unit stride along K; 0 <= M <= MAX_M.
        weight: `QuantizedWeight` [N, K] ("fp8" or "mxfp4"; K even for MXFP4).
        out: optional [M, N] buffer of x's dtype with unit stride along N.
    Returns:
        [M, N] in x's dtype (within a tolerance of the reference, module doc).
    """
    require(x.dim() == 2 and weight.data.dim() == 2, "x and weight must be 2-D")
    m, k = x.shape
    _check(x, weight, k)
    require(m <= MAX_M, f"x: at most {MAX_M} rows, got {m}")
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
        x: [M, G, K] bf16/fp16/fp32 with unit stride along K; 0 <= M <= MAX_M.
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
    require(m <= MAX_M, f"x: at most {MAX_M} rows, got {m}")
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
    """One launch over (column blocks, groups); x / weight / out are a group's first views."""
    (m, k), n = x.shape, weight.data.shape[0]
    meta = _quantized_meta(weight.fmt, weight.group, n, k)
    _quantized_linear_kernel[(triton.cdiv(n, meta["BLOCK_N"]), groups)](
        x,
        weight.data,
        weight.scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.data.stride(0),
        weight.scale.stride(0),
        out.stride(0),
        *group_strides,
        FP4=weight.fmt == "mxfp4",
        GROUP=weight.group,
        SCALE_ROWS=weight.block_rows,
        BLOCK_M=_BLOCK_M,
        SUB=chunk_channels(weight.group, meta["BLOCK_K"]),
        ROUND_BF16=x.dtype == torch.bfloat16,
        # fp32 must not go through tf32; the CPU interpreter's 16-bit tl.dot is unreliable, so
        # there the (exact) products are formed in fp32.
        DOT_FP32=x.dtype == torch.float32 or x.device.type == "cpu",
        **meta,
        **programmatic_launch(_quantized_linear_kernel, x.device),
    )


__all__ = ["MAX_M", "quantized_grouped_linear", "quantized_linear"]
