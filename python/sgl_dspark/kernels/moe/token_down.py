"""Stage 2 of the per-token routed experts (`token_gemm.py` describes the two launches; the
spec is `moe_token_down_reduce_ref`): each local route's down projection, rounded as the grouped
GEMM stores it, weighted and summed in fp32 in slot order, finished by `moe_reduce`'s tail. No
per-slot rows reach the caller.

Grid (slot groups, M tokens, D tiles). The program of (group, token, tile) forms the products of
the token's slots in the group on the tile's columns, all in one dot tile: row j of A = slot
j's h row, column block j = slot j's expert, so one dot per K step streams every slot's weights
at once (a loop over slots would wait on each expert's weights in turn: latency-bound at decode
sizes). The products wanted are the diagonal blocks (row j, block j); the rest is discarded work
of idle matrix units. The extra expert of a `MixedExperts` stack is not in the dot: its slot is
formed on its own, from its own weight, by `extra_columns_product`.

One group holding every slot: the program reduces its products itself. Several groups: each
group's program stores its rounded products into fp32 partials [M * topk, D], then counts
itself in on the tile's arrival counter; the last of the tile's programs to arrive reads every
slot's partials back, reduces them and re-arms the counter (zero again, ready for the next
launch or graph replay). Whichever program arrives last, it reads the same rounded products
and sums them in the same slot order: the bits do not depend on the grouping or on arrival
order. Slot groups let each program decode only its own slots' weights: in a tile of all of
V4.1's 6 routed + 1 shared slots, padded to 8, a quarter of the MXFP4 decode is on masked
columns and the FP8 shared expert's product follows the stack's in the same program; one slot a
program forms every product in parallel (`_down_meta`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import (
    arrival_counters,
    interpreted,
    programmatic_launch,
    round_to_bf16,
    wait_for_producers,
)
from sgl_dspark.kernels.moe.expert_weights import (
    EXPERT_WARPS,
    ExpertWeight,
    ExpertWeights,
    check_expert_weights,
    expert_block_k,
    expert_product,
    expert_scales_ahead,
    expert_split_k,
    expert_stack,
    expert_weight_args,
    expert_weight_data,
    extra_columns_product,
    extra_expert_args,
)
from sgl_dspark.kernels.moe.reduce import route_reduce_tail
from sgl_dspark.kernels.moe.sort import check_local_routes, route_locality


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
    partials_ptr,
    arrivals_ptr,
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
    GROUP_SLOTS: tl.constexpr,
    GROUPS: tl.constexpr,
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
    # Program (group, token, tile): the group's slots' products on the tile's columns, in one
    # dot tile (the module doc); reduced here with one group, else by the last to arrive.
    wait_for_producers(PDL)  # h is stage 1's output; the routes and shared come earlier
    group = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    n0 = tile * BLOCK_N
    first = group * GROUP_SLOTS
    tile_cols = tl.arange(0, GROUP_SLOTS * BLOCK_N)
    col_slot = first + tile_cols // BLOCK_N
    cols = n0 + tile_cols % BLOCK_N
    col_local, col_is_local = route_locality(
        ids_ptr, table_ptr, token * TOPK + col_slot, num_experts, num_local, col_slot < TOPK
    )
    if EXTRA:  # the extra expert's columns are not in the stack: formed below, on their own
        col_is_local = col_is_local & (col_local != extra_local)
    col_ok = col_is_local & (cols < n_cols)
    rows = tl.arange(0, ROWS)
    row_slot = first + rows
    _row_ids, row_is_local = route_locality(
        ids_ptr,
        table_ptr,
        token * TOPK + row_slot,
        num_experts,
        num_local,
        (rows < GROUP_SLOTS) & (row_slot < TOPK),
    )
    if tl.max(col_ok.to(tl.int32), axis=0) > 0:
        acc = expert_product(
            h_ptr + (token * TOPK + row_slot) * stride_h,
            row_is_local,
            w_ptr + col_local * stride_we + cols.to(tl.int64) * stride_wn,
            col_ok,
            tl.multiple_of(
                s_ptr + col_local * stride_se + (cols.to(tl.int64) // SCALE_ROWS) * stride_sn,
                SCALE_ALIGN,
            ),
            k_dim,
            ROWS,
            GROUP_SLOTS * BLOCK_N,
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
    else:  # no slot of this group in the stack (remote, absent, or the extra expert's)
        acc = tl.zeros([ROWS, GROUP_SLOTS * BLOCK_N], dtype=tl.float32)
    # Slot j's product: row j, column block j (adding exact zeros of the other rows).
    group_slots = first + tl.arange(0, GROUP_SLOTS)
    on_diag = rows[:, None, None] == tl.arange(0, GROUP_SLOTS)[None, :, None]
    product = tl.sum(tl.where(on_diag, tl.reshape(acc, [ROWS, GROUP_SLOTS, BLOCK_N]), 0.0), axis=0)
    slot_local, slot_is_local = route_locality(
        ids_ptr, table_ptr, token * TOPK + group_slots, num_experts, num_local, group_slots < TOPK
    )
    if EXTRA:
        # The slot routed to the extra expert (the folded shared expert: at most one a token)
        # is formed from its own weight, as a stack of its format would form it.
        slot_is_extra = slot_is_local & (slot_local == extra_local)
        if tl.max(slot_is_extra.to(tl.int32), axis=0) > 0:
            extra_slot = tl.sum(tl.where(slot_is_extra, group_slots, 0), axis=0).to(tl.int64)
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
    out_cols = n0 + tl.arange(0, BLOCK_N)
    col_in = out_cols < n_cols
    if GROUPS == 1:  # this program holds every slot's product
        reduce_here = True
        terms, terms_local = product, slot_is_local
    else:
        # Partials [M * TOPK, n_cols] fp32: this group's local slots' rounded products.
        tl.store(
            partials_ptr + (token * TOPK + group_slots[:, None]) * n_cols + out_cols[None, :],
            product,
            mask=slot_is_local[:, None] & col_in[None, :],
        )
        # Release ours, acquire the other groups' (the barrier orders every thread's store
        # before the one atomic); the last to arrive reduces and re-arms the counter.
        tl.debug_barrier()
        arrivals = arrivals_ptr + token * tl.num_programs(2) + tile
        reduce_here = tl.atomic_add(arrivals, 1, sem="acq_rel") == GROUPS - 1
        if reduce_here:
            tl.store(arrivals, 0)  # ready for the next launch (graph replay)
        slots = tl.arange(0, SLOTS)
        _all_ids, terms_local = route_locality(
            ids_ptr, table_ptr, token * TOPK + slots, num_experts, num_local, slots < TOPK
        )
        terms = tl.load(  # only the last to arrive reads (a masked load moves no bytes)
            partials_ptr + (token * TOPK + slots[:, None]) * n_cols + out_cols[None, :],
            mask=reduce_here & terms_local[:, None] & col_in[None, :],
            other=0.0,
            cache_modifier=".cg",  # written by other programs: past this SM's L1
        )
    if reduce_here:
        _reduce_slots(
            terms,
            terms_local,
            token,
            out_cols,
            col_in,
            weights_ptr,
            shared_ptr,
            out_ptr,
            n_cols,
            routed_scale,
            TOPK,
            SLOTS,
            BLOCK_N,
            APPLY_SCALE,
            HAS_SHARED,
            UNIT_WEIGHTS,
            ROUND_BF16,
            ON_BITS,
        )


@triton.jit
def _reduce_slots(
    product,
    slot_is_local,
    token,
    out_cols,
    col_in,
    weights_ptr,
    shared_ptr,
    out_ptr,
    n_cols,
    routed_scale,
    TOPK: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    APPLY_SCALE: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    UNIT_WEIGHTS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """The route reduce of a token's rounded slot products `product [SLOTS, BLOCK_N]` on
    columns `out_cols`: weighted, summed in fp32 in slot order, finished by `moe_reduce`'s
    tail."""
    slots = tl.arange(0, SLOTS)
    if UNIT_WEIGHTS:  # weighted in stage 1: 1 * product is product, exactly
        weight = tl.full([SLOTS], 1.0, dtype=tl.float32)
    else:
        weight = tl.load(weights_ptr + token * TOPK + slots, mask=slots < TOPK, other=0.0)
    terms = tl.where(slot_is_local[:, None], weight[:, None] * product, 0.0)
    # The reduce's sum in slot order (its own arithmetic; FMA contraction is off).
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        total += tl.sum(tl.where(slots[:, None] == k, terms, 0.0), axis=0)
    route_reduce_tail(
        total,
        shared_ptr,
        out_ptr,
        token * n_cols + out_cols,
        col_in,
        routed_scale,
        APPLY_SCALE,
        HAS_SHARED,
        ROUND_BF16,
        ON_BITS,
    )


def _down_meta(k_dim: int, weight: ExpertWeight, slots: int) -> dict[str, int]:
    """Launch shape of stage 2 (`benchmark/kernels/probe_moe_token.py --stage-metas` times
    others; every BLOCK_N, GROUP_SLOTS and pipeline depth gives the same bits, a dot's sum not
    depending on the tile's columns and the reduce reading the same rounded products in the
    same order; BLOCK_K and SPLIT_K are the expert product's, shared with the grouped path so a
    route's product sums alike on both). bf16 and FP8: every slot in one program, 16 output
    columns each (D = 1024 spreads one token over 64 programs, each streaming a
    [BLOCK_K, 8 x 16] tile of all its slots' weights per step). MXFP4: one slot a program over
    64 columns, stage 1's tile (the module doc; benchmark/results/kernels.md)."""
    block_k = expert_block_k(k_dim, weight)
    fp4 = getattr(weight, "fmt", None) == "mxfp4"
    return {
        "BLOCK_N": 64 if fp4 else 16,
        "GROUP_SLOTS": 1 if fp4 else slots,
        "BLOCK_K": block_k,
        "SPLIT_K": expert_split_k(block_k, weight),
        "num_warps": EXPERT_WARPS,
        "num_stages": 3,
    }


def _down_grid(num_tokens: int, hidden: int, topk: int, meta: dict[str, int]) -> tuple:
    """Stage 2's grid (slot groups, tokens, column tiles)."""
    return (
        triton.cdiv(topk, meta["GROUP_SLOTS"]),
        num_tokens,
        triton.cdiv(hidden, meta["BLOCK_N"]),
    )


def token_down_arrival_count(max_tokens: int, down_proj: ExpertWeights, topk: int) -> int:
    """How many int32 arrival counters `moe_token_down_reduce` calls of up to `max_tokens`
    tokens with these weights and top-k need (0 when one program reduces a whole tile). The
    kernel leaves them zero: a caller keeps one zeroed tensor per layer instead of a memset per
    call (captured graphs keep its address)."""
    meta = _down_meta(down_proj.shape[2], expert_stack(down_proj), triton.next_power_of_2(topk))
    groups, _, tiles = _down_grid(max_tokens, down_proj.shape[1], topk, meta)
    return max_tokens * tiles if groups > 1 else 0


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
    arrivals: torch.Tensor | None = None,
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
        arrivals: optional zeroed int32 counters, at least `token_down_arrival_count` of
            them (left zero), for a launch shape whose slot groups run in programs of their
            own; without them a zeroed tensor is allocated per call.
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
    grid = _down_grid(num_tokens, hidden, topk, meta)
    split = grid[0] > 1
    # Each group's rounded products, reduced by the last of a tile's programs to arrive.
    partials = (
        torch.empty(num_tokens * topk, hidden, dtype=torch.float32, device=h.device)
        if split
        else out  # never read with one slot group
    )
    arrivals = arrival_counters(arrivals, num_tokens * grid[2], split, out, "arrivals")
    _moe_token_down_kernel[grid](
        h,
        data,
        out_ptr=out,
        partials_ptr=partials,
        arrivals_ptr=arrivals,
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
        GROUPS=grid[0],
        ROWS=max(16, meta["GROUP_SLOTS"]),
        EVEN_K=h.shape[1] % meta["BLOCK_K"] == 0,
        SCALES_AHEAD=expert_scales_ahead(
            stack, meta["GROUP_SLOTS"] * meta["BLOCK_N"], meta["BLOCK_K"]
        ),
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
