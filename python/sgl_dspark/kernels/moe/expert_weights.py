"""The weight side of the expert GEMMs, shared by the grouped kernels (`grouped_gemm.py`) and the
per-token kernels (`token_gemm.py`, `token_down.py`): what an expert weight is (the stacked
experts in the activation dtype, or kept as stored), its checks and kernel arguments, the K
step, and the one definition of an expert product. Both MoE paths form every product through
`expert_product` with the same K step, so a route's product sums alike on either path: on a GPU
their bits agree, which keeps a token's result independent of the path its batch size picks.

An expert stack may carry one more expert stored in another format (`MixedExperts`: the shared
expert in FP8 beside MXFP4 routed experts, as DeepSeek-V4.1 releases them). Its local id is the
stack's expert count, and its products are formed with that format's own K step, as a stack
of its format would form them: the per-token kernels through `expert_or_extra_product` and
`extra_columns_product`, the grouped stages in a launch of their own for its blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels.linear.dequant import quantized_product
from sgl_dspark.kernels.linear.reference import QuantizedWeight, check_quantized_weight
from sgl_dspark.kernels.linear.weight_loads import (
    fp4_ptx_decode,
    fp4_rows_aligned,
    quantized_block_k,
    scale_alignment,
    scales_loaded_ahead,
)
from sgl_dspark.kernels.moe.reference import MixedExperts

# A weight of the expert GEMMs: the stacked experts in the activation dtype, or kept as stored.
ExpertWeight = torch.Tensor | QuantizedWeight


# What the expert kernels take: a stack, or a stack with one expert in another format.
ExpertWeights = ExpertWeight | MixedExperts

# Warps of every expert GEMM program (a quantised product's K split gives each warp one slice).
EXPERT_WARPS = 4


@triton.jit
def expert_dot(a_tile, w_tile, acc, DOT_FP32: tl.constexpr):
    """One K chunk of an expert product (the one definition: the per-token kernels form their
    products with it too, so every kernel sums a product's chunks the same way)."""
    if DOT_FP32:
        return tl.dot(a_tile.to(tl.float32), w_tile.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a_tile, w_tile, acc)


@triton.jit
def expert_product(
    a_rows,
    a_ok,
    w_rows,
    w_ok,
    s_rows,
    k_dim,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr,
    FP4: tl.constexpr,
    PTX: tl.constexpr,
    ALIGNED: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
    SCALES_AHEAD: tl.constexpr = False,
):
    """fp32 [BM, BN] = A rows (pointers `a_rows`, unit stride along K) times the weight columns
    (pointers `w_rows` to each output column's stored row), over all K in BLOCK_K steps of
    `expert_dot`, or with a quantised weight `quantized_product` (scale pointers `s_rows`; its
    K step split into SPLIT_K slices, `expert_split_k`; SCALES_AHEAD: `expert_scales_ahead`).
    The one definition of an expert product: the grouped and the per-token kernels call it with
    the same constants, so their products sum in the same order (SCALES_AHEAD changes when a
    scale byte is loaded, not a bit)."""
    if QUANT:
        acc = quantized_product(
            a_rows,
            a_ok,
            w_rows,
            w_ok,
            s_rows,
            k_dim,
            BM,
            BN,
            BLOCK_K,
            FP4,
            PTX,
            ALIGNED,
            GROUP,
            DOT_FP32,
            SPLIT_K,
            EVEN_K,
            SCALES_AHEAD,
        )
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_dim
            a_tile = tl.load(
                a_rows[:, None] + ks[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0
            )
            w_tile = tl.load(
                w_rows[None, :] + ks[:, None], mask=k_ok[:, None] & w_ok[None, :], other=0.0
            )
            acc = expert_dot(a_tile, w_tile, acc, DOT_FP32)
    return acc


@triton.jit
def expert_or_extra_product(
    is_extra,
    a_rows,
    a_ok,
    w_rows,
    s_rows,
    xw_rows,
    xs_rows,
    w_ok,
    k_dim,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr,
    FP4: tl.constexpr,
    PTX: tl.constexpr,
    ALIGNED: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SCALES_AHEAD: tl.constexpr,
    EXTRA: tl.constexpr,
    X_BLOCK_K: tl.constexpr,
    X_QUANT: tl.constexpr,
    X_FP4: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    X_GROUP: tl.constexpr,
    X_EVEN_K: tl.constexpr,
    X_SPLIT_K: tl.constexpr,
    X_SCALES_AHEAD: tl.constexpr,
):
    """`expert_product` of the stack's weight rows (`w_rows`, `s_rows`), or with EXTRA, where
    the scalar `is_extra` holds, of the extra expert's (`xw_rows`, `xs_rows`, its X_ constants:
    `extra_expert_args`). Without EXTRA the extra's branch is not compiled (a constexpr False
    ends the `and`)."""
    if EXTRA and is_extra:
        acc = expert_product(
            a_rows,
            a_ok,
            xw_rows,
            w_ok,
            xs_rows,
            k_dim,
            BM,
            BN,
            X_BLOCK_K,
            X_QUANT,
            X_FP4,
            PTX,
            X_ALIGNED,
            X_GROUP,
            DOT_FP32,
            X_EVEN_K,
            X_SPLIT_K,
            X_SCALES_AHEAD,
        )
    else:
        acc = expert_product(
            a_rows,
            a_ok,
            w_rows,
            w_ok,
            s_rows,
            k_dim,
            BM,
            BN,
            BLOCK_K,
            QUANT,
            FP4,
            PTX,
            ALIGNED,
            GROUP,
            DOT_FP32,
            EVEN_K,
            SPLIT_K,
            SCALES_AHEAD,
        )
    return acc


@triton.jit
def extra_columns_product(
    a_row,
    xw_ptr,
    stride_xwn,
    xs_ptr,
    stride_xsn,
    n0,
    n_cols,
    k_dim,
    PTX: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    X_BLOCK_N: tl.constexpr,
    X_BLOCK_K: tl.constexpr,
    X_QUANT: tl.constexpr,
    X_FP4: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    X_GROUP: tl.constexpr,
    X_SCALE_ROWS: tl.constexpr,
    X_EVEN_K: tl.constexpr,
    X_SPLIT_K: tl.constexpr,
    X_SCALES_AHEAD: tl.constexpr,
    X_SCALE_ALIGN: tl.constexpr,
):
    """fp32 [BLOCK_N]: one activation row (`a_row`, unit stride along K) times output columns
    [n0, n0 + BLOCK_N) of the extra expert's weight (`extra_expert_args`), formed by
    `expert_product` with its format's constants; X_BLOCK_N >= 16 columns are computed (a dot's
    width) and the first BLOCK_N kept (adding exact zeros)."""
    rows = tl.arange(0, ROWS)
    x_cols = n0 + tl.arange(0, X_BLOCK_N)
    x_ok = (tl.arange(0, X_BLOCK_N) < BLOCK_N) & (x_cols < n_cols)
    x_rows = x_cols.to(tl.int64)
    acc = expert_product(
        a_row + rows * 0,
        rows == 0,
        xw_ptr + x_rows * stride_xwn,
        x_ok,
        tl.multiple_of(xs_ptr + (x_rows // X_SCALE_ROWS) * stride_xsn, X_SCALE_ALIGN),
        k_dim,
        ROWS,
        X_BLOCK_N,
        X_BLOCK_K,
        X_QUANT,
        X_FP4,
        PTX,
        X_ALIGNED,
        X_GROUP,
        DOT_FP32,
        X_EVEN_K,
        X_SPLIT_K,
        X_SCALES_AHEAD,
    )
    row = tl.sum(tl.where(rows[:, None] == 0, acc, 0.0), axis=0)
    PARTS: tl.constexpr = X_BLOCK_N // BLOCK_N
    first = tl.arange(0, PARTS)[:, None] == 0
    return tl.sum(tl.where(first, tl.reshape(row, [PARTS, BLOCK_N]), 0.0), axis=0)


def expert_block_k(k_dim: int, weight: ExpertWeight | None = None) -> int:
    """K step of the expert GEMMs (the grouped and the per-token kernels share it, so their
    products sum alike): 128 channels of a bf16 / fp32 weight; 256 of a quantised one (256 or
    128 stored bytes a row)."""
    if isinstance(weight, QuantizedWeight):
        return quantized_block_k(weight.fmt, k_dim)
    return min(128, max(16, triton.next_power_of_2(k_dim)))


def expert_split_k(block_k: int, weight: ExpertWeight | None = None) -> int:
    """SPLIT_K of an expert product with K step `block_k` (a function of the format and K only,
    so the grouped and the per-token kernels sum a product alike).

    MXFP4: each of the EXPERT_WARPS warps multiplies its own slice of every dot's channels into
    its own accumulator, the accumulators summed at the end. At a few rows per block the
    activation tile costs a warp as much as its weights: split along N, every warp loads the
    whole tile and takes its even and odd channels apart for the two dots; split along K, only
    its slice (fewer instructions and registers per weight byte). A dot's slice must keep one
    matrix-unit step (16 channels) for each warp, else no split (a split finer than the warps
    would repeat the batched dot on idle warps). FP8 (its tile in channel order) and
    unquantised products do not split: split, the FP8 experts timed slower
    (`benchmark/results/kernels.md`)."""
    if not isinstance(weight, QuantizedWeight) or weight.fmt != "mxfp4":
        return 1
    return EXPERT_WARPS if block_k // 2 >= 16 * EXPERT_WARPS else 1


def expert_scales_ahead(weight: ExpertWeight, columns: int, block_k: int) -> bool:
    """`expert_product`'s SCALES_AHEAD for a program of `columns` weight columns over
    EXPERT_WARPS warps (`weight_loads.scales_loaded_ahead`; False for an unquantised stack)."""
    if not isinstance(weight, QuantizedWeight):
        return False
    return scales_loaded_ahead(weight, columns, block_k, EXPERT_WARPS)


def expert_weight_data(weight: ExpertWeight) -> torch.Tensor:
    """The tensor the expert kernels read the weight's rows from (its strides are the kernels'
    weight strides): the stacked experts, or a quantised weight's stored data (FP8 elements or
    MXFP4 bytes)."""
    if isinstance(weight, QuantizedWeight):
        return weight.data
    return weight


def expert_weight_args(weight: ExpertWeight) -> dict:
    """The kernel arguments that describe an expert weight: its scale pointer and strides (the
    data itself when unquantised, never read) and the dequantisation constants."""
    if isinstance(weight, QuantizedWeight):
        return {
            "s_ptr": weight.scale,
            "stride_se": weight.scale.stride(0),
            "stride_sn": weight.scale.stride(1),
            "QUANT": True,
            "FP4": weight.fmt == "mxfp4",
            "PTX": fp4_ptx_decode(weight.data.device),
            "ALIGNED": fp4_rows_aligned(weight),
            "GROUP": weight.group,
            "SCALE_ROWS": weight.block_rows,
            "SCALE_ALIGN": scale_alignment(weight),
        }
    return {
        "s_ptr": weight,
        "stride_se": 0,
        "stride_sn": 0,
        "QUANT": False,
        "FP4": False,
        "PTX": False,
        "ALIGNED": False,
        "GROUP": 1,
        "SCALE_ROWS": 1,
        "SCALE_ALIGN": 1,
    }


def expert_stack(weights: ExpertWeights) -> ExpertWeight:
    """The stack of `weights` (itself unless a `MixedExperts`)."""
    return weights.stack if isinstance(weights, MixedExperts) else weights


def extra_expert_args(weights: ExpertWeights, k_dim: int, columns: int) -> dict:
    """The kernel arguments of a `MixedExperts`' extra expert (`expert_or_extra_product`'s X_
    constants: its own format's K step and split, as a stack of its format would run it; its
    scale loads for a product of `columns` columns), its local id `extra_local` and its rows'
    pointer and strides; EXTRA False and placeholders (the stack's data, never read) for a
    plain stack."""
    if not isinstance(weights, MixedExperts):
        data = expert_weight_data(weights)
        return {
            "xw_ptr": data,
            "xs_ptr": data,
            "stride_xwn": 0,
            "stride_xsn": 0,
            "extra_local": -1,
            "EXTRA": False,
            "X_BLOCK_K": 16,
            "X_QUANT": False,
            "X_FP4": False,
            "X_ALIGNED": False,
            "X_GROUP": 1,
            "X_SCALE_ROWS": 1,
            "X_EVEN_K": False,
            "X_SPLIT_K": 1,
            "X_SCALES_AHEAD": False,
            "X_SCALE_ALIGN": 1,
        }
    extra = weights.extra
    data = expert_weight_data(extra)
    args = expert_weight_args(extra)
    block_k = expert_block_k(k_dim, extra)
    return {
        "xw_ptr": data,
        "xs_ptr": args["s_ptr"],
        "stride_xwn": data.stride(1),
        "stride_xsn": args["stride_sn"],
        "extra_local": weights.stack.shape[0],
        "EXTRA": True,
        "X_BLOCK_K": block_k,
        "X_QUANT": args["QUANT"],
        "X_FP4": args["FP4"],
        "X_ALIGNED": args["ALIGNED"],
        "X_GROUP": args["GROUP"],
        "X_SCALE_ROWS": args["SCALE_ROWS"],
        "X_EVEN_K": k_dim % block_k == 0,
        "X_SPLIT_K": expert_split_k(block_k, extra),
        "X_SCALES_AHEAD": expert_scales_ahead(extra, columns, block_k),
        "X_SCALE_ALIGN": args["SCALE_ALIGN"],
    }


def check_expert_weights(
    name: str, weights: ExpertWeights, a: torch.Tensor, num_local: int
) -> None:
    """`check_expert_weight` of a stack, or of a `MixedExperts`' stack (at least every local
    expert but the extra) and its extra `[1, N, K]` expert (local id: the stack's count, so
    `num_local` up to that count + 1)."""
    if not isinstance(weights, MixedExperts):
        check_expert_weight(name, weights, a, num_local)
        return
    stack, extra = weights
    check_expert_weight(f"{name}.stack", stack, a, max(num_local - 1, 0))
    check_expert_weight(f"{name}.extra", extra, a, 1)
    require(
        extra.shape[0] == 1 and extra.shape[1] == stack.shape[1],
        f"{name}.extra must be one expert [1, {stack.shape[1]}, K], got {tuple(extra.shape)}",
    )


def check_expert_weight(name: str, weight: ExpertWeight, a: torch.Tensor, num_local: int) -> None:
    """An expert stack `[>= num_local, N, K]` for activations `a [rows, K]`: in a's dtype with
    a contiguous last dim, or a well-formed `QuantizedWeight` (ValueError naming `name`)."""
    data = weight.data if isinstance(weight, QuantizedWeight) else weight
    if isinstance(weight, QuantizedWeight):
        check_quantized_weight(weight, name)
        dtype_ok = weight.scale.device == a.device and weight.scale.stride(2) == 1
    else:
        dtype_ok = weight.dtype == a.dtype
    shape = weight.shape
    require(
        len(shape) == 3
        and dtype_ok
        and data.stride(2) == 1
        and shape[2] == a.shape[1]
        and shape[0] >= num_local
        and data.device == a.device,
        f"{name} must be {a.dtype} (or quantised) [>= {num_local} experts, N, {a.shape[1]}] on "
        f"{a.device} with a contiguous last dim, got {data.dtype} {tuple(shape)} on "
        f"{data.device}",
    )


__all__ = [
    "EXPERT_WARPS",
    "ExpertWeight",
    "ExpertWeights",
    "MixedExperts",
    "check_expert_weight",
    "check_expert_weights",
    "expert_block_k",
    "expert_dot",
    "expert_or_extra_product",
    "expert_product",
    "expert_scales_ahead",
    "expert_split_k",
    "expert_stack",
    "expert_weight_args",
    "expert_weight_data",
    "extra_columns_product",
    "extra_expert_args",
]
