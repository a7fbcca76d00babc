"""Routed experts for decode-sized batches in two launches: per-route stage 1 with the clamped
SwiGLU as its epilogue, per-token stage 2 with the route reduce as its epilogue
(`moe_route_gate_up_ref` and `moe_token_down_reduce_ref` are the spec).

The sorted path (`moe_sort` -> grouped stage 1 with the activation -> grouped stage 2 ->
`moe_reduce`) is four launches and an `[M, topk, D]` round trip. At a few tokens the routes need
no sorting: a route is a one-row block whose expert is its own id, and a token's slot list is its
row of `ids`:

  stage 1, `moe_route_gate_up`, grid (M * topk routes, 2I tiles):
      h[t * topk + k] = act(x[t] @ gate_up_proj[l].T)       l = local id of ids[t, k]
      (remote and out-of-range routes leave their rows as they were);
  stage 2, `moe_token_down_reduce`, grid (M tokens, D tiles): the program that owns token t's
      output tile forms all of its slots' products in one tile (row k of A = h[t * topk + k],
      column block k = slot k's expert: one dot per K step streams every slot's weights), each
      local product h[t * topk + k] @ down_proj[l].T rounded as the grouped GEMM stores it, then
      weighted and summed in fp32 in slot order and finished by `moe_reduce`'s tail
      (`route_reduce_tail`: round, routed scale, round, + shared, round). No per-slot rows are
      written.

Exactness: on a GPU the same bits as the sorted path `fused_moe` -> `moe_reduce`. Each product
is `expert_dot` over K chunks from a zero accumulator, rounded once to bf16, and a compiled dot
sums an output in an order that depends neither on its row or column in the tile nor on the
tile's size (`grouped_gemm.py`'s module doc); the activation is `swiglu_tile`, the reduce has
the slot order, FMA contraction off and the same tail. The CPU interpreter's dot is numpy's fp32
matmul, whose sums depend on the tile shape, so there the products agree to fp32 rounding (one
bf16 ulp after rounding) and the tests use a tolerance. Against the references (torch's matmul):
within a tolerance, as the grouped GEMMs.

A `MixedExperts` stack (`expert_weights.py`): stage 1 forms the extra expert's routes with
`expert_or_extra_product`, stage 2 that slot (at most one a token) beside the slot tile with
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
    round_to_bf16,
    wait_for_producers,
)
from sgl_dspark.kernels.linear.dequant import quantized_stages
from sgl_dspark.kernels.moe.expert_weights import (
    EXPERT_WARPS,
    ExpertWeight,
    ExpertWeights,
    check_expert_weights,
    expert_block_k,
    expert_or_extra_product,
    expert_product,
    expert_scales_ahead,
    expert_split_k,
    expert_stack,
    expert_weight_args,
    expert_weight_data,
    extra_columns_product,
    extra_expert_args,
)
from sgl_dspark.kernels.moe.grouped_gemm import swiglu_tile, weighted_activation
from sgl_dspark.kernels.moe.reduce import route_reduce_tail
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


@triton.jit
def _moe_token_down_kernel(
    h_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ids_ptr,
    table_ptr,
    weights_ptr,
    shared_ptr,
    n_cols,
    k_dim,
    num_experts,
    num_local,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    routed_scale,
    xw_ptr,
    xs_ptr,
    stride_xwn,
    stride_xsn,
    extra_local,
    TOPK: tl.constexpr,
    SLOTS: tl.constexpr,
    ROWS: tl.constexpr,
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
    APPLY_SCALE: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    UNIT_WEIGHTS: tl.constexpr,
    ON_BITS: tl.constexpr,
    EXTRA: tl.constexpr,
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
    PDL: tl.constexpr,
):
    # All of the token's slots in one tile: row k of A is route k's h row, and the columns hold
    # SLOTS blocks of BLOCK_N output columns, block k from slot k's expert. One dot per K chunk
    # then streams every slot's weights at once (a loop over slots waits on each expert's
    # weights in turn: latency-bound at decode sizes); the products wanted are the diagonal
    # blocks (row k, block k), the rest is discarded work of idle matrix units.
    wait_for_producers(PDL)  # h is stage 1's output; the routes and shared come earlier
    token = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    tile_cols = tl.arange(0, SLOTS * BLOCK_N)
    col_slot = tile_cols // BLOCK_N
    cols = n0 + tile_cols % BLOCK_N
    col_local, col_is_local = route_locality(
        ids_ptr, table_ptr, token * TOPK + col_slot, num_experts, num_local, col_slot < TOPK
    )
    if EXTRA:  # the extra expert's columns are not in the stack: formed below, on their own
        col_is_local = col_is_local & (col_local != extra_local)
    col_ok = col_is_local & (cols < n_cols)
    rows = tl.arange(0, ROWS)
    _, row_is_local = route_locality(
        ids_ptr, table_ptr, token * TOPK + rows, num_experts, num_local, rows < TOPK
    )
    h_rows = h_ptr + (token * TOPK + rows) * stride_h
    acc = expert_product(
        h_rows,
        row_is_local,
        w_ptr + col_local * stride_we + cols.to(tl.int64) * stride_wn,
        col_ok,
        tl.multiple_of(
            s_ptr + col_local * stride_se + (cols.to(tl.int64) // SCALE_ROWS) * stride_sn,
            SCALE_ALIGN,
        ),
        k_dim,
        ROWS,
        SLOTS * BLOCK_N,
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
    # Slot k's product: row k, column block k (adding exact zeros of the other rows).
    slots = tl.arange(0, SLOTS)
    on_diag = rows[:, None, None] == slots[None, :, None]
    product = tl.sum(tl.where(on_diag, tl.reshape(acc, [ROWS, SLOTS, BLOCK_N]), 0.0), axis=0)
    slot_local, slot_is_local = route_locality(
        ids_ptr, table_ptr, token * TOPK + slots, num_experts, num_local, slots < TOPK
    )
    if EXTRA:
        # The slot routed to the extra expert (the folded shared expert: at most one a token)
        # is formed from its own weight, as a stack of its format would form it.
        slot_is_extra = slot_is_local & (slot_local == extra_local)
        if tl.max(slot_is_extra.to(tl.int32), axis=0) > 0:
            extra_slot = tl.sum(tl.where(slot_is_extra, slots, 0), axis=0).to(tl.int64)
            extra_cols = extra_columns_product(
                h_ptr + (token * TOPK + extra_slot) * stride_h,
                xw_ptr,
                stride_xwn,
                xs_ptr,
                stride_xsn,
                n0,
                n_cols,
                k_dim,
                PTX,
                DOT_FP32,
                ROWS,
                BLOCK_N,
                X_BLOCK_N,
                X_BLOCK_K,
                X_QUANT,
                X_FP4,
                X_ALIGNED,
                X_GROUP,
                X_SCALE_ROWS,
                X_EVEN_K,
                X_SPLIT_K,
                X_SCALES_AHEAD,
                X_SCALE_ALIGN,
            )
            product = tl.where(slot_is_extra[:, None], extra_cols[None, :], product)
    if ROUND_BF16:  # as the grouped GEMM's store rounds it
        product = round_to_bf16(product)
    if UNIT_WEIGHTS:  # weighted in stage 1: 1 * product is product, exactly
        weight = tl.full([SLOTS], 1.0, dtype=tl.float32)
    else:
        weight = tl.load(weights_ptr + token * TOPK + slots, mask=slots < TOPK, other=0.0)
    terms = tl.where(slot_is_local[:, None], weight[:, None] * product, 0.0)
    # The reduce's sum in slot order (its own arithmetic; FMA contraction is off).
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        total += tl.sum(tl.where(slots[:, None] == k, terms, 0.0), axis=0)
    out_cols = n0 + tl.arange(0, BLOCK_N)
    route_reduce_tail(
        total,
        shared_ptr,
        out_ptr,
        token * n_cols + out_cols,
        out_cols < n_cols,
        routed_scale,
        APPLY_SCALE,
        HAS_SHARED,
        ROUND_BF16,
        ON_BITS,
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


def _down_meta(k_dim: int, weight: ExpertWeight, slots: int) -> dict[str, int]:
    """Launch shape of stage 2 (`benchmark/kernels/probe_moe_token.py` times others; every
    BLOCK_N and pipeline depth gives the same bits, a dot's sum not depending on the tile's
    columns; BLOCK_K and SPLIT_K are the expert product's, shared with the grouped path so a
    route's product sums alike on both). 16 output columns per program: D = 1024 spreads one
    token over 64 programs, each streaming a [BLOCK_K, 8 x 16] tile of all its slots' weights
    per step. MXFP4 8 columns: its K-split dots hold every slot's columns in each warp, and the
    narrower tile doubles the programs a token's stream is spread over (faster at one token:
    benchmark/results/kernels.md); 16 for a single slot, so a dot keeps at least 16 columns (a
    matrix unit's width on every target)."""
    block_k = expert_block_k(k_dim, weight)
    fp4 = getattr(weight, "fmt", None) == "mxfp4"
    return {
        "BLOCK_N": 8 if fp4 and slots >= 2 else 16,
        "BLOCK_K": block_k,
        "SPLIT_K": expert_split_k(block_k, weight),
        "num_warps": EXPERT_WARPS,
        "num_stages": 3,
    }


def moe_token_down_reduce(
    h: torch.Tensor,
    down_proj: ExpertWeights,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    local_table: torch.Tensor,
    num_local: int,
    routed_scale: float = 1.0,
    shared: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`moe_token_down_reduce_ref` in one launch: stage 2 per token with the route reduce as its
    epilogue, no host sync (graph-safe).

    Args:
        h: [M * topk, I] bf16 or fp32 contiguous (stage 1's output; remote routes' rows are
            never read).
        down_proj: [E_loc, D, I] in h's dtype, last dim contiguous, or kept as stored, or a
            `MixedExperts` (its extra expert at most once in a token's routes).
        ids: int32 [M, topk] contiguous; local_table, num_local: as `moe_route_gate_up`.
        weights: fp32 [M, topk] contiguous routing weights, or None: unit weights (stage 1
            weighted the routes), the same bits as a tensor of ones, no read.
        routed_scale: multiplies the rounded routed sum (1.0 when the router folded it in).
        shared: optional [M, D] in h's dtype, contiguous: the shared expert's output to add.
        out: optional [M, D] output in h's dtype, contiguous.
    Returns:
        out [M, D]: the route reduce of the local routes' products.
    """
    require(
        h.dim() == 2 and h.dtype in (torch.bfloat16, torch.float32) and h.is_contiguous(),
        f"h must be contiguous bf16/fp32 [M * topk, I], got {h.dtype} {tuple(h.shape)}",
    )
    check_local_routes(ids, local_table, num_local, h.device)
    check_expert_weights("down_proj", down_proj, h, num_local)
    num_tokens, topk = ids.shape
    require(h.shape[0] == num_tokens * topk, f"h has {h.shape[0]} rows, ids {num_tokens}x{topk}")
    require(
        weights is None
        or (
            weights.shape == ids.shape
            and weights.dtype == torch.float32
            and weights.is_contiguous()
            and weights.device == h.device
        ),
        f"weights must be None or contiguous fp32 {tuple(ids.shape)}, got "
        f"{None if weights is None else (weights.dtype, tuple(weights.shape))}",
    )
    hidden = down_proj.shape[1]
    for name, tensor in (("shared", shared), ("out", out)):
        require(
            tensor is None
            or (
                tuple(tensor.shape) == (num_tokens, hidden)
                and tensor.dtype == h.dtype
                and tensor.is_contiguous()
                and tensor.device == h.device
            ),
            f"{name} must be contiguous {h.dtype} {(num_tokens, hidden)}",
        )
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=h.dtype, device=h.device)
    if num_tokens == 0 or hidden == 0:
        return out
    slots = triton.next_power_of_2(topk)
    stack = expert_stack(down_proj)
    meta = _down_meta(h.shape[1], stack, slots)
    data = expert_weight_data(stack)
    extra_columns = max(16, meta["BLOCK_N"])
    _moe_token_down_kernel[(num_tokens, triton.cdiv(hidden, meta["BLOCK_N"]))](
        h,
        data,
        out_ptr=out,
        ids_ptr=ids,
        table_ptr=local_table,
        weights_ptr=weights if weights is not None else h,
        UNIT_WEIGHTS=weights is None,
        shared_ptr=shared if shared is not None else out,
        n_cols=hidden,
        k_dim=h.shape[1],
        num_experts=local_table.numel(),
        num_local=num_local,
        stride_h=h.stride(0),
        stride_we=data.stride(0),
        stride_wn=data.stride(1),
        routed_scale=float(routed_scale),
        **expert_weight_args(stack),
        **extra_expert_args(down_proj, h.shape[1], extra_columns),
        X_BLOCK_N=extra_columns,
        TOPK=topk,
        SLOTS=slots,
        ROWS=max(16, triton.next_power_of_2(topk)),
        EVEN_K=h.shape[1] % meta["BLOCK_K"] == 0,
        SCALES_AHEAD=expert_scales_ahead(stack, slots * meta["BLOCK_N"], meta["BLOCK_K"]),
        DOT_FP32=h.dtype == torch.float32 or interpreted(_moe_token_down_kernel),
        ROUND_BF16=h.dtype == torch.bfloat16,
        APPLY_SCALE=routed_scale != 1.0,
        HAS_SHARED=shared is not None,
        ON_BITS=interpreted(_moe_token_down_kernel),
        enable_fp_fusion=False,  # the reduce rounds w * y before adding it
        **meta,
        **programmatic_launch(_moe_token_down_kernel, h.device),
    )
    return out
