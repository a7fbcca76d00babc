"""Grouped expert GEMMs over `moe_sort`'s blocks (`moe_grouped_gemm_ref` and `fused_moe_ref` are
the spec).

`moe_sort` lays the routes of one rank out in blocks of `block_size` rows; every block belongs to
one local expert, every row is a packed route id `(slot << 24) | token` or the padding sentinel
`(topk << 24) | M`. One kernel (`moe_grouped_gemm`) runs one (block x N-tile) per program:

    out[token * topk + slot, :] = a[row] @ weight[local_expert_of_block].T      (fp32 accumulate)
    row = token              (stage 1: a = x [M, D], the token's hidden state)
    row = token * topk + slot (stage 2: a = h [M * topk, I], the route's activation)

With a `MixedExperts` (one extra expert in another format, the highest local id) each stage is
two launches: the stack's blocks, then the extra's (the last valid blocks, at most one route a
token) in its own format's specialisation.

Sentinel rows and pairs routed to remote experts are never written (their output rows keep
whatever the buffer held; `moe_reduce` never reads them). `fused_moe` runs the routed experts in
two launches: stage 1 with `gate_up_proj` and the clamped SwiGLU (`silu_mul_clamp`) as its
epilogue (`out_swiglu`), then stage 2 with `down_proj`, giving `y [M, topk, D]` per (token,
slot), the layout `moe_reduce` reduces. The activation as stage 2's input prologue instead would
be recomputed by every N tile (x D / BLOCK_N, dead rows of each block too); as its own launch it
costs a launch and a round trip.

Exactness against stage 1 -> `silu_mul_clamp` -> stage 2: the activation is evaluated with
`silu_mul_clamp`'s fp32 ops in its order (selects for the clamps, exp2, `div_rn`,
(g * sigmoid) * u; no mul feeds an add, so FMA contraction cannot differ) on the values the plain
GEMM stores (the epilogue rounds its accumulators to bf16 first, as the store would), then
rounded to bf16 as its plain output is (nearest even: the store cast compiled, on the bits
interpreted): both call `activation.clamped_swiglu_values`. The epilogue's tile holds
BLOCK_N / 2 gate and BLOCK_N / 2 up rows of the weight: the same dot shape, A tile and K steps
as the plain stage 1, only with columns at other positions of the tile, and a compiled dot (mma
or FMA) sums each output in an order that does not depend on its column, so the bits match on
the GPU. The CPU interpreter's dot is numpy's fp32 matmul, whose sums do depend on a column's
position: there the epilogue matches to fp32 rounding only.

Against the references: within a tolerance (the fp32 accumulation order differs from torch's
matmul). fp32 inputs use IEEE fp32 dot products (no tf32); bf16 inputs multiply exactly and
accumulate in fp32, then round once to bf16 (nearest even, on the bits, so the CPU interpreter
rounds like a GPU). The CPU interpreter's bf16 `tl.dot` is unreliable (triton 3.6), so there
bf16 tiles are widened to fp32 first (the same products, exact either way). Per-row results
depend only on (N, K), never on M or the grid.
"""

from __future__ import annotations

from typing import Any

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
from sgl_dspark.kernels.linear.weight_loads import quantized_stages
from sgl_dspark.kernels.moe.activation import swiglu_tile, weighted_activation
from sgl_dspark.kernels.moe.expert_weights import (
    EXPERT_WARPS,
    ExpertWeight,
    ExpertWeights,
    MixedExperts,
    check_expert_weights,
    expert_block_k,
    expert_product,
    expert_split_k,
    expert_weight_args,
    expert_weight_data,
)
from sgl_dspark.kernels.moe.reference import MoeSortOutput


@triton.jit
def _moe_grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_valid_ptr,
    num_tokens,
    n_cols,
    k_dim,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    limit,
    act_weights_ptr,
    extra_local,
    TOPK: tl.constexpr,
    A_PER_PAIR: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
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
    OUT_SWIGLU: tl.constexpr,
    TILE_MAJOR: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    WEIGHT_ACT: tl.constexpr,
    ON_BITS: tl.constexpr,
    EXTRA_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Everything depends on `moe_sort`'s layout (which blocks live, which expert's weights): no
    # weight can be fetched before the previous kernels' outputs are visible.
    wait_for_producers(PDL)
    # TILE_MAJOR: grid (N tiles, blocks), so the live blocks' programs are launched first.
    pid_m = tl.program_id(1) if TILE_MAJOR else tl.program_id(0)
    pid_n = tl.program_id(0) if TILE_MAJOR else tl.program_id(1)
    num_valid = tl.load(num_valid_ptr)
    if EXTRA_BLOCKS == 2:
        # Only the blocks of local expert `extra_local`, the weight's expert 0: the last local
        # id, so its blocks (at most one route a token) end the valid prefix; program p takes
        # the p-th block from the end.
        pid_m = num_valid // BLOCK_M - 1 - pid_m
        if pid_m < 0:
            return
    # Blocks past the valid prefix hold undefined ids (never written): leave at once.
    if pid_m * BLOCK_M >= num_valid:
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if EXTRA_BLOCKS == 1:  # the stack's experts only: the extra's blocks are another launch's
        if expert == extra_local:
            return
    if EXTRA_BLOCKS == 2:
        if expert != extra_local:
            return
        expert = expert * 0
    packed = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    token = (packed & 0xFFFFFF).to(tl.int64)
    pair = token * TOPK + (packed >> 24).to(tl.int64)
    live = token < num_tokens  # the sentinel's token field is M
    if A_PER_PAIR:
        a_rows = pair
    else:
        a_rows = token
    if OUT_SWIGLU:
        # Tile columns [0, HALF) are gate rows j of the weight, [HALF, BLOCK_N) the matching up
        # rows n_cols + j (n_cols = I): one dot of the plain GEMM's shape, HALF outputs.
        HALF: tl.constexpr = BLOCK_N // 2
        cols = pid_n * HALF + tl.arange(0, BLOCK_N) % HALF
        col_ok = cols < n_cols
        w_rows = tl.where(tl.arange(0, BLOCK_N) < HALF, cols, cols + n_cols)
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        w_rows = cols
    w_rows = w_rows.to(tl.int64)
    acc = expert_product(
        a_ptr + a_rows * stride_a,
        live,
        w_ptr + expert * stride_we + w_rows * stride_wn,
        col_ok,
        tl.multiple_of(
            s_ptr + expert * stride_se + (w_rows // SCALE_ROWS) * stride_sn, SCALE_ALIGN
        ),
        k_dim,
        BLOCK_M,
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
    )
    if OUT_SWIGLU:  # the activation of the [gate | up] values a plain stage 1 would store
        y = swiglu_tile(acc, limit, BLOCK_M, HALF, HAS_LIMIT, ROUND_BF16, ON_BITS)
        if WEIGHT_ACT:  # each row's route weight (sorted like the rows), then stored rounding
            w = tl.load(act_weights_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
            y = weighted_activation(y, w, ROUND_BF16, ON_BITS)
        j = pid_n * HALF + tl.arange(0, HALF)
        tl.store(
            out_ptr + pair[:, None] * stride_out + j[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=live[:, None] & (j < n_cols)[None, :],
        )
    else:
        if ROUND_BF16:
            acc = round_to_bf16(acc)
        tl.store(
            out_ptr + pair[:, None] * stride_out + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=live[:, None] & col_ok[None, :],
        )


def _check_sorted(
    sorted_ids: torch.Tensor,
    sorted_expert_ids: torch.Tensor,
    num_valid: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> None:
    require(
        block_size >= 16 and block_size & (block_size - 1) == 0,
        f"block_size must be a power of two >= 16 (tl.dot), got {block_size}",
    )
    require(
        sorted_ids.dim() == 1 and sorted_ids.dtype == torch.int32 and sorted_ids.is_contiguous(),
        "sorted_ids must be contiguous int32 [capacity]",
    )
    num_blocks = triton.cdiv(sorted_ids.numel(), block_size)
    require(
        tuple(sorted_expert_ids.shape) == (num_blocks,) and sorted_expert_ids.dtype == torch.int32,
        f"sorted_expert_ids must be int32 [{num_blocks}], got "
        f"{sorted_expert_ids.dtype} {tuple(sorted_expert_ids.shape)}",
    )
    require(
        num_valid.numel() >= 1 and num_valid.dtype == torch.int32,
        "num_valid must be int32 [2] (`moe_sort`'s output)",
    )
    for name, tensor in (
        ("sorted_ids", sorted_ids),
        ("sorted_expert_ids", sorted_expert_ids),
        ("num_valid", num_valid),
    ):
        require(
            tensor.device == device, f"{name} is on {tensor.device}, the activations on {device}"
        )


def fused_moe_out(
    x: torch.Tensor,
    gate_up_proj: ExpertWeights,
    down_proj: ExpertWeights,
    sort: MoeSortOutput,
    topk: int,
    limit: float | None,
    block_size: int,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The arguments every launcher of the two-stage routed experts takes (`fused_moe`, and
    `mx_fused_moe` for the MX formats), checked (ValueError naming the argument): x [M, D];
    gate_up_proj [E_loc, 2I, D] and down_proj [E_loc, D, I]; the sort's tensors for
    `block_size` on x's device; limit > 0 or None; out, when given, contiguous [M, topk, D] in
    x's dtype. Returns out, allocated when None. The weights' formats and x's layout are each
    launcher's own checks."""
    require(x.dim() == 2, f"x must be [M, D], got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    require(
        len(gate_up_proj.shape) == 3
        and gate_up_proj.shape[1] % 2 == 0
        and gate_up_proj.shape[2] == hidden,
        f"gate_up_proj must be [E_loc, 2I, {hidden}], got {tuple(gate_up_proj.shape)}",
    )
    inter = gate_up_proj.shape[1] // 2
    require(
        tuple(down_proj.shape) == (gate_up_proj.shape[0], hidden, inter),
        f"down_proj must be {(gate_up_proj.shape[0], hidden, inter)}, got {tuple(down_proj.shape)}",
    )
    require(limit is None or limit > 0, f"limit (swiglu_limit) must be > 0 or None, got {limit}")
    _check_sorted(sort.sorted_ids, sort.sorted_expert_ids, sort.num_valid, block_size, x.device)
    require(
        sort.sorted_weights.device == x.device,
        f"sorted_weights is on {sort.sorted_weights.device}, the activations on {x.device}",
    )
    if out is None:
        return torch.empty(num_tokens, topk, hidden, dtype=x.dtype, device=x.device)
    require(
        tuple(out.shape) == (num_tokens, topk, hidden)
        and out.is_contiguous()
        and out.dtype == x.dtype,
        f"out must be contiguous {x.dtype} {(num_tokens, topk, hidden)}",
    )
    return out


def moe_grouped_gemm(
    a: torch.Tensor,
    weight: ExpertWeights,
    sorted_ids: torch.Tensor,
    sorted_expert_ids: torch.Tensor,
    num_valid: torch.Tensor,
    topk: int,
    a_per_pair: bool = False,
    block_size: int = 32,
    out: torch.Tensor | None = None,
    *,
    out_swiglu: bool = False,
    swiglu_limit: float | None = None,
    tile_major: bool | None = None,
    act_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """`moe_grouped_gemm_ref` in one launch over `moe_sort`'s blocks, no host sync
    (graph-safe).

    Args:
        a: [M, K] (a_per_pair=False: row = token) or [M * topk, K] (a_per_pair=True: row =
            token * topk + slot); bf16 or fp32, last dim contiguous.
        weight: [E_loc, N, K] in a's dtype, last dim contiguous; indexed by the local expert id.
            Or a `QuantizedWeight` (FP8 / MXFP4 kept as stored), dequantised in the kernel, or a
            `MixedExperts` (its extra expert, local id E_loc - 1, in another of these forms).
        sorted_ids, sorted_expert_ids, num_valid: `moe_sort`'s outputs (`MoeSortOutput`) for topk and
            `block_size`, on a's device.
        topk: routes per token (the packing of sorted_ids).
        out: optional [M * topk, N] in a's dtype, last dim contiguous.
        out_swiglu: the clamped SwiGLU as output epilogue: weight is [E_loc, 2I, K] = [gate
            rows | up rows]; out [M * topk, I] = `silu_mul_clamp` of what the plain GEMM would
            store, evaluated once per element (each program's tile pairs gate and up columns).
        swiglu_limit: the activation's clamp (> 0), only with out_swiglu; None: no clamp.
        act_weights: with out_swiglu, `moe_sort`'s `sorted_weights` (fp32, one per sorted row):
            each route's activation is multiplied by its weight and rounded as stored
            (DeepSeek-V4.1 weights a route before its down projection).
        tile_major: program order (timing only, never a result bit): N tiles fastest, so the
            live blocks' programs come first. None: tile-major for one token (the static grid
            spans the largest block count, ~62 blocks for 6 live at 64 experts, so the live
            blocks' programs would otherwise start last), else blocks fastest
            (`benchmark/kernels/probe_moe_order.py` compares the orders).
    Returns:
        out [M * topk, N] ([M * topk, N / 2] with out_swiglu): row token * topk + slot =
        a[row] @ weight[e].T (the activation applied to the product with out_swiglu)
        for every route `moe_sort` kept; other rows are left as they were (undefined when out is
        allocated here).
    """
    require(
        a.dim() == 2 and a.dtype in (torch.bfloat16, torch.float32) and a.stride(1) == 1,
        f"a must be bf16/fp32 [rows, K] with a contiguous last dim, got {a.dtype} "
        f"{tuple(a.shape)} strides {a.stride()}",
    )
    require(out_swiglu or swiglu_limit is None, "swiglu_limit needs out_swiglu=True")
    if act_weights is not None:
        require(out_swiglu, "act_weights needs out_swiglu=True")
        require(
            act_weights.shape == sorted_ids.shape
            and act_weights.dtype == torch.float32
            and act_weights.is_contiguous()
            and act_weights.device == a.device,
            f"act_weights must be fp32 {tuple(sorted_ids.shape)} contiguous (moe_sort's "
            f"sorted_weights), got {act_weights.dtype} {tuple(act_weights.shape)}",
        )
    require(
        swiglu_limit is None or swiglu_limit > 0,
        f"swiglu_limit must be > 0 or None, got {swiglu_limit}",
    )
    check_expert_weights("weight", weight, a, 0)
    require(
        not out_swiglu or weight.shape[1] % 2 == 0,
        f"out_swiglu needs weight [E_loc, 2I, K], got {tuple(weight.shape)}",
    )
    require(topk >= 1, f"topk must be >= 1, got {topk}")
    require(
        not a_per_pair or a.shape[0] % topk == 0,
        f"a_per_pair needs a [M * {topk}, K], got {tuple(a.shape)}",
    )
    _check_sorted(sorted_ids, sorted_expert_ids, num_valid, block_size, a.device)
    num_tokens = a.shape[0] // topk if a_per_pair else a.shape[0]
    require(num_tokens < 1 << 24, f"M = {num_tokens} does not fit the packed route ids")
    n_cols, k_dim = weight.shape[1], weight.shape[2]
    n_out = n_cols // 2 if out_swiglu else n_cols
    if out is None:
        out = torch.empty(num_tokens * topk, n_out, dtype=a.dtype, device=a.device)
    require(
        tuple(out.shape) == (num_tokens * topk, n_out)
        and out.dtype == a.dtype
        and out.stride(1) == 1
        and out.device == a.device,
        f"out must be {a.dtype} {(num_tokens * topk, n_out)} with a contiguous last dim",
    )
    if num_tokens == 0 or n_out == 0 or weight.shape[0] == 0 or sorted_ids.numel() == 0:
        return out  # no route can be local (E_loc = 0) or nothing to compute
    stack = weight.stack if isinstance(weight, MixedExperts) else weight
    meta = _grouped_meta(n_cols, getattr(stack, "fmt", None), block_size)
    block_n = meta["BLOCK_N"]
    n_blocks, n_tiles = sorted_expert_ids.numel(), triton.cdiv(n_cols, block_n)  # 2I / BLOCK_N
    if tile_major is None:
        tile_major = num_tokens == 1
    launch: dict[str, Any] = dict(
        out=out,
        layout=(sorted_ids, sorted_expert_ids, num_valid),
        num_tokens=num_tokens,
        n_cols=n_out,
        k_dim=k_dim,
        limit=swiglu_limit,
        act_weights=act_weights,
        topk=topk,
        a_per_pair=a_per_pair,
        block_m=block_size,
        block_n=block_n,
        stages=meta["num_stages"],
        out_swiglu=out_swiglu,
        tile_major=tile_major,
    )
    if not isinstance(weight, MixedExperts):
        _launch_grouped(a, weight, n_blocks, n_tiles, 0, -1, **launch)
        return out
    # The extra expert in a launch of its own format's specialisation (one kernel holding both
    # formats' K loops needs far more registers: fewer resident programs for every block).
    # Its blocks are the last valid ones (the highest local id, at most one route a token).
    extra_local = weight.stack.shape[0]
    _launch_grouped(a, weight.stack, n_blocks, n_tiles, 1, extra_local, **launch)
    extra_blocks = min(n_blocks, triton.cdiv(num_tokens, block_size))
    _launch_grouped(a, weight.extra, extra_blocks, n_tiles, 2, extra_local, **launch)
    return out


def _grouped_meta(n_cols: int, fmt: str | None, block_m: int) -> dict[str, int]:
    """Column tile and pipeline depth of the grouped GEMMs for a weight of `n_cols` rows stored
    as `fmt` (None: unquantised; a `MixedExperts` launches both its parts at its stack's) and
    blocks of `block_m` rows, the one place sweeps override
    (`benchmark/kernels/probe_moe_token.py --stage-metas --stages sorted`). A compiled dot sums
    each output in an order that depends neither on its row nor on its column in the tile, so
    the tile changes no bit, only the time.

    Narrow column tiles and long K steps: at decode sizes a few sorted blocks are live and each
    program streams its expert's [BLOCK_N, K] weight slice, so more, shorter streams keep more
    SMs reading: 32 columns (2x the programs of 64). MXFP4 stacks in 16-row blocks (decode
    sizes) take 64: a K step of 32 columns is only 4 KB of their codes a program, and at
    V4.1-Flash's experts 64 columns were as fast at 4 tokens and faster from 8, where 128 and
    16 were slower (benchmark/results/kernels.md). 32-row blocks keep 32
    columns (64 compile to 218 registers at sm90, two programs an SM; not timed). out_swiglu
    keeps the tiles and the grid of the plain GEMM over the weight's 2I rows (a tile holds
    BLOCK_N / 2 gate and the matching BLOCK_N / 2 up rows), so it streams the same bytes with
    as many programs. Four pipeline stages (MXFP4 weights take at most three:
    `quantized_stages`); two were slower."""
    widest = 64 if fmt == "mxfp4" and block_m <= 16 else 32
    return {"BLOCK_N": min(widest, max(16, triton.next_power_of_2(n_cols))), "num_stages": 4}


def _launch_grouped(
    a: torch.Tensor,
    weight: ExpertWeight,
    n_blocks: int,
    n_tiles: int,
    extra_blocks: int,
    extra_local: int,
    *,
    out: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_tokens: int,
    n_cols: int,
    k_dim: int,
    limit: float | None,
    act_weights: torch.Tensor | None,
    topk: int,
    a_per_pair: bool,
    block_m: int,
    block_n: int,
    stages: int,
    out_swiglu: bool,
    tile_major: bool,
) -> None:
    """One launch of the grouped kernel over `n_blocks` sorted blocks; `extra_blocks` (the
    kernel's EXTRA_BLOCKS): 0 every block, 1 all but local expert `extra_local`'s, 2 only its
    (the last `n_blocks` valid blocks), read as `weight`'s expert 0."""
    sorted_ids, sorted_expert_ids, num_valid = layout
    block_k = expert_block_k(k_dim, weight)
    data = expert_weight_data(weight)
    grid = (n_tiles, n_blocks) if tile_major else (n_blocks, n_tiles)
    _moe_grouped_gemm_kernel[grid](
        a,
        data,
        out_ptr=out,
        sorted_ids_ptr=sorted_ids,
        expert_ids_ptr=sorted_expert_ids,
        num_valid_ptr=num_valid,
        num_tokens=num_tokens,
        n_cols=n_cols,
        k_dim=k_dim,
        stride_a=a.stride(0),
        stride_we=data.stride(0),
        stride_wn=data.stride(1),
        stride_out=out.stride(0),
        limit=float(limit) if limit is not None else 0.0,
        **expert_weight_args(weight),
        act_weights_ptr=act_weights if act_weights is not None else out,
        extra_local=extra_local,
        TOPK=topk,
        A_PER_PAIR=a_per_pair,
        # tf32 must stay off for fp32; see the module docstring for the CPU bf16 case.
        DOT_FP32=a.dtype == torch.float32 or interpreted(_moe_grouped_gemm_kernel),
        ROUND_BF16=a.dtype == torch.bfloat16,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k_dim % block_k == 0,
        SPLIT_K=expert_split_k(block_k, weight),
        # The scale bytes stay in their step here: loaded ahead, the MXFP4 stage 2 at 16-row
        # blocks compiled to 124 registers against 96 (four programs an SM instead of five),
        # and this kernel runs a DSpark verify's experts; untimed either way.
        SCALES_AHEAD=False,
        OUT_SWIGLU=out_swiglu,
        TILE_MAJOR=tile_major,
        HAS_LIMIT=limit is not None,
        WEIGHT_ACT=act_weights is not None,
        ON_BITS=interpreted(_moe_grouped_gemm_kernel),
        EXTRA_BLOCKS=extra_blocks,
        num_warps=EXPERT_WARPS,
        num_stages=quantized_stages(getattr(weight, "fmt", None), stages),
        **programmatic_launch(_moe_grouped_gemm_kernel, a.device),
    )


def fused_moe(
    x: torch.Tensor,
    gate_up_proj: ExpertWeights,
    down_proj: ExpertWeights,
    sort: MoeSortOutput,
    topk: int,
    limit: float | None,
    block_size: int = 32,
    out: torch.Tensor | None = None,
    weight_before_down: bool = False,
) -> torch.Tensor:
    """`fused_moe_ref` over `moe_sort`'s layout in two launches (four with `MixedExperts`), no
    host sync: stage 1 with the clamped SwiGLU as its epilogue (`out_swiglu`), then stage 2; compiled, the same bits as the
    three-launch chain stage 1 -> `silu_mul_clamp` -> stage 2 (module docstring).

    Args:
        x: [M, D] bf16 or fp32, last dim contiguous.
        gate_up_proj: [E_loc, 2I, D] in x's dtype (gate rows first, then up rows), or kept as
            stored (`QuantizedWeight`, dequantised in the kernel), or a `MixedExperts`.
        down_proj: [E_loc, D, I] in x's dtype, or kept as stored, or a `MixedExperts`.
        sort: `moe_sort(topk_ids, topk_weights, plan, ...)` for these routes and `block_size`.
        topk: routes per token.
        limit: swiglu_limit (None: no clamp).
        out: optional contiguous [M, topk, D] in x's dtype.
        weight_before_down: scale each route's activation by its weight (the sort's
            `sorted_weights`) before the down projection (DeepSeek-V4.1); the reduce then sums
            with unit weights.
    Returns:
        y [M, topk, D]; y[t, k] is expert topk_ids[t, k]'s output for token t where that expert
        is local, untouched elsewhere (`moe_reduce` reads only local slots).
    """
    out = fused_moe_out(x, gate_up_proj, down_proj, sort, topk, limit, block_size, out)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return out
    routes = (sort.sorted_ids, sort.sorted_expert_ids, sort.num_valid, topk)
    h = moe_grouped_gemm(
        x,
        gate_up_proj,
        *routes,
        block_size=block_size,
        out_swiglu=True,
        swiglu_limit=limit,
        act_weights=sort.sorted_weights if weight_before_down else None,
    )
    moe_grouped_gemm(
        h,
        down_proj,
        *routes,
        a_per_pair=True,
        block_size=block_size,
        out=out.view(num_tokens * topk, hidden),
    )
    return out
