"""Routed experts for decode-sized batches in two launches: per-route stage 1 with the clamped
SwiGLU as its epilogue (this module), stage 2 with the route reduce as its epilogue
(`token_down.py`); `moe_route_gate_up_ref` and `moe_token_down_reduce_ref` are the spec.

The sorted path (`moe_sort` -> grouped stage 1 with the activation -> grouped stage 2 ->
`moe_reduce`) is four launches and an `[M, topk, D]` round trip. At a few tokens the routes need
no sorting: a route is a one-row block whose expert is its own id, and a token's slot list is its
row of `ids`:

  stage 1, `moe_route_gate_up`, grid (M * topk routes, 2I tiles):
      h[t * topk + k] = act(x[t] @ gate_up_proj[l].T)       l = local id of ids[t, k]
      (remote and out-of-range routes leave their rows as they were);
  stage 2, `moe_token_down_reduce`: each local product h[t * topk + k] @ down_proj[l].T rounded
      as the grouped GEMM stores it, then weighted and summed in fp32 in slot order and
      finished by `moe_reduce`'s tail (`route_reduce_tail`: round, routed scale, round,
      + shared, round).

Exactness: on a GPU the same bits as the sorted path `fused_moe` -> `moe_reduce`. Each product
is `expert_dot` over K chunks from a zero accumulator, rounded once to bf16, and a compiled dot
sums an output in an order that depends neither on its row or column in the tile nor on the
tile's size (`grouped_gemm.py`'s module doc); the activation is `swiglu_tile`, the reduce has
the slot order, FMA contraction off and the same tail. The CPU interpreter's dot is numpy's fp32
matmul, whose sums depend on the tile shape, so there the products agree to fp32 rounding (one
bf16 ulp after rounding) and the tests use a tolerance. Against the references (torch's matmul):
within a tolerance, as the grouped GEMMs.

A `MixedExperts` stack (`expert_weights.py`): stage 1 forms the extra expert's routes with
`expert_or_extra_product`, stage 2 that slot (at most one a token) with
`extra_columns_product`; the sum keeps the slot order.

Cost: each route streams its expert's weights itself (the sorted path reads an expert once for
all its routes), so this path is for small M; `RoutedExperts` picks it up to a token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import (
    interpreted,
    programmatic_launch,
    wait_for_producers,
)
from sgl_dspark.kernels.linear.weight_loads import quantized_stages
from sgl_dspark.kernels.moe.activation import swiglu_tile, weighted_activation
from sgl_dspark.kernels.moe.expert_weights import (
    EXPERT_WARPS,
    ExpertWeight,
    ExpertWeights,
    check_expert_weights,
    expert_block_k,
    expert_or_extra_product,
    expert_scales_ahead,
    expert_split_k,
    expert_stack,
    expert_weight_args,
    expert_weight_data,
    extra_expert_args,
)
from sgl_dspark.kernels.moe.sort import check_local_routes, route_locality

# tl.dot's smallest row count; row 0 is the route's (or token's) row, the others are masked.
_TILE_M = tl.constexpr(16)


@triton.jit
def _moe_route_gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    h_ptr,
    ids_ptr,
    table_ptr,
    n_inter,
    k_dim,
    num_experts,
    num_local,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_h,
    limit,
    act_weights_ptr,
    xw_ptr,
    xs_ptr,
    stride_xwn,
    stride_xsn,
    extra_local,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr,
    FP4: tl.constexpr,
    PTX: tl.constexpr,
    ALIGNED: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SCALES_AHEAD: tl.constexpr,
    SCALE_ALIGN: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    WEIGHT_ACT: tl.constexpr,
    ON_BITS: tl.constexpr,
    EXTRA: tl.constexpr,
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
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the route ids and x come from the router / the previous layer
    route = tl.program_id(0).to(tl.int64)
    local, is_local = route_locality(ids_ptr, table_ptr, route, num_experts, num_local)
    if not is_local:  # remote or out of range: the reduce never reads this row
        return
    # Tile columns [0, HALF) are gate rows j, [HALF, BLOCK_N) the matching up rows I + j, as in
    # the grouped stage 1's activation epilogue.
    HALF: tl.constexpr = BLOCK_N // 2
    cols = tl.program_id(1) * HALF + tl.arange(0, BLOCK_N) % HALF
    col_ok = cols < n_inter
    w_rows = tl.where(tl.arange(0, BLOCK_N) < HALF, cols, cols + n_inter).to(tl.int64)
    live = tl.arange(0, _TILE_M) == 0
    x_row = x_ptr + (route // TOPK) * stride_x
    acc = expert_or_extra_product(
        local == extra_local,
        x_row + live * 0,
        live,
        w_ptr + local * stride_we + w_rows * stride_wn,
        tl.multiple_of(s_ptr + local * stride_se + (w_rows // SCALE_ROWS) * stride_sn, SCALE_ALIGN),
        xw_ptr + w_rows * stride_xwn,
        tl.multiple_of(xs_ptr + (w_rows // X_SCALE_ROWS) * stride_xsn, X_SCALE_ALIGN),
        col_ok,
        k_dim,
        _TILE_M,
        BLOCK_N,
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
        EXTRA,
        X_BLOCK_K,
        X_QUANT,
        X_FP4,
        X_ALIGNED,
        X_GROUP,
        X_EVEN_K,
        X_SPLIT_K,
        X_SCALES_AHEAD,
    )
    y = swiglu_tile(acc, limit, _TILE_M, HALF, HAS_LIMIT, ROUND_BF16, ON_BITS)
    if WEIGHT_ACT:  # the route's weight before the down projection (row 0 is the route's)
        w = tl.load(act_weights_ptr + route + tl.arange(0, _TILE_M) * 0)
        y = weighted_activation(y, w, ROUND_BF16, ON_BITS)
    j = tl.program_id(1) * HALF + tl.arange(0, HALF)
    tl.store(
        h_ptr + route * stride_h + live[:, None] * 0 + j[None, :],
        y.to(h_ptr.dtype.element_ty),
        mask=live[:, None] & (j < n_inter)[None, :],
    )


def moe_route_gate_up(
    x: torch.Tensor,
    gate_up_proj: ExpertWeights,
    ids: torch.Tensor,
    local_table: torch.Tensor,
    num_local: int,
    limit: float | None,
    h: torch.Tensor | None = None,
    act_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """`moe_route_gate_up_ref` in one launch: stage 1 per route with the clamped SwiGLU as its
    epilogue, no host sync (graph-safe).

    Args:
        x: [M, D] bf16 or fp32, last dim contiguous.
        gate_up_proj: [E_loc, 2I, D] in x's dtype (gate rows, then up rows), or kept as stored
            (`QuantizedWeight`, dequantised in the kernel), or a `MixedExperts` whose extra
            expert (local id E_loc - 1) is in another of those forms.
        ids: int32 [M, topk] contiguous: global expert per route; ids outside [0, E) are remote.
        local_table, num_local: `prepare_moe_sort`'s plan: local id per global expert,
            >= num_local for a remote one.
        limit: swiglu_limit (> 0), None for no clamp.
        h: optional [M * topk, I] output in x's dtype, contiguous.
        act_weights: optional fp32 [M, topk] contiguous routing weights: each route's
            activation times its weight, rounded as stored (DeepSeek-V4.1's weight before the
            down projection).
    Returns:
        h [M * topk, I]: row t * topk + k = act(x[t] @ gate_up_proj[l].T) (times the route's
        weight with act_weights) for a local route, untouched otherwise (undefined when h is
        allocated here).
    """
    require(
        x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32) and x.stride(1) == 1,
        f"x must be bf16/fp32 [M, D] with a contiguous last dim, got {x.dtype} {tuple(x.shape)}",
    )
    check_local_routes(ids, local_table, num_local, x.device)
    check_expert_weights("gate_up_proj", gate_up_proj, x, num_local)
    require(gate_up_proj.shape[1] % 2 == 0, "gate_up_proj must be [E_loc, 2I, D]")
    require(ids.shape[0] == x.shape[0], f"ids has {ids.shape[0]} rows, x {x.shape[0]}")
    require(limit is None or limit > 0, f"limit (swiglu_limit) must be > 0 or None, got {limit}")
    if act_weights is not None:
        require(
            act_weights.shape == ids.shape
            and act_weights.dtype == torch.float32
            and act_weights.is_contiguous()
            and act_weights.device == x.device,
            f"act_weights must be contiguous fp32 {tuple(ids.shape)}, got "
            f"{act_weights.dtype} {tuple(act_weights.shape)}",
        )
    routes, inter = ids.numel(), gate_up_proj.shape[1] // 2
    if h is None:
        h = torch.empty(routes, inter, dtype=x.dtype, device=x.device)
    require(
        tuple(h.shape) == (routes, inter) and h.dtype == x.dtype and h.is_contiguous(),
        f"h must be contiguous {x.dtype} {(routes, inter)}",
    )
    if routes == 0 or inter == 0 or num_local == 0:
        return h
    stack = expert_stack(gate_up_proj)
    meta = _gate_up_meta(x.shape[1], stack)
    data = expert_weight_data(stack)
    _moe_route_gate_up_kernel[(routes, triton.cdiv(2 * inter, meta["BLOCK_N"]))](
        x,
        data,
        h_ptr=h,
        ids_ptr=ids,
        table_ptr=local_table,
        n_inter=inter,
        k_dim=x.shape[1],
        num_experts=local_table.numel(),
        num_local=num_local,
        stride_x=x.stride(0),
        stride_we=data.stride(0),
        stride_wn=data.stride(1),
        stride_h=h.stride(0),
        limit=float(limit) if limit is not None else 0.0,
        **expert_weight_args(stack),
        **extra_expert_args(gate_up_proj, x.shape[1], meta["BLOCK_N"]),
        act_weights_ptr=act_weights if act_weights is not None else h,
        TOPK=ids.shape[1],
        EVEN_K=x.shape[1] % meta["BLOCK_K"] == 0,
        SCALES_AHEAD=expert_scales_ahead(stack, meta["BLOCK_N"], meta["BLOCK_K"]),
        # tf32 stays off for fp32; the CPU interpreter's bf16 tl.dot is unreliable (fused_moe).
        DOT_FP32=x.dtype == torch.float32 or interpreted(_moe_route_gate_up_kernel),
        ROUND_BF16=x.dtype == torch.bfloat16,
        HAS_LIMIT=limit is not None,
        WEIGHT_ACT=act_weights is not None,
        ON_BITS=interpreted(_moe_route_gate_up_kernel),
        **meta,
        **programmatic_launch(_moe_route_gate_up_kernel, x.device),
    )
    return h


def _gate_up_meta(k_dim: int, weight: ExpertWeight) -> dict[str, int]:
    """Launch shape of stage 1 (`benchmark/kernels/probe_moe_token.py --stage-metas` times
    others; BLOCK_N and the pipeline depth change no bit, BLOCK_K and SPLIT_K are the expert
    product's). 16 gate + 16 up columns, the grouped stage 1's tile; MXFP4 32 + 32, which
    halves the programs that each decode the same activation slice (faster at one token, where
    this stage runs for them: benchmark/results/kernels.md)."""
    block_k = expert_block_k(k_dim, weight)
    fmt = getattr(weight, "fmt", None)
    return {
        "BLOCK_N": 64 if fmt == "mxfp4" else 32,
        "BLOCK_K": block_k,
        "SPLIT_K": expert_split_k(block_k, weight),
        "num_warps": EXPERT_WARPS,
        "num_stages": quantized_stages(fmt, 4),
    }
