"""Sort the routes of one expert-parallel rank by local expert, in one launch, graph-safe
(`moe_sort_ref` is the spec). The same launch zeroes the stage-2 accumulator `moe_buf`.

Two steps:
  1. `prepare_moe_sort(expert_mask)` -- host side, reads the mask once (one device->host copy).
     Call it when the mask is created or changed (expert load balancing), never inside CUDA-graph
     capture. The caller owns the returned `MoeSortPlan` and passes it to every `moe_sort` call.
  2. `moe_sort(topk_ids, topk_weights, plan, hidden_size)` -- one launch.

Exactness: bit-exact. Every output equals `moe_sort_ref` (entries past `num_valid[0]` are
undefined on both sides and must not be read).

The plan's local table is also read in place by the kernels that skip the sort (the per-token
MoE kernels): `route_locality` is that read, `check_local_routes` its checks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers
from sgl_dspark.kernels.moe.reference import TOKEN_BITS, MoeSortOutput, moe_sort_capacity

_ZERO_CHUNK = 1024
_MAX_PAIR_CHUNK = 1024


class MoeSortPlan(NamedTuple):
    """Per-mask table built by `prepare_moe_sort` (host read happens there, once).

    local_table: int32 [E] on the mask's device; local id of each global expert, or `num_bins - 1`
                 for remote experts (an id no local expert uses).
    num_local:   number of local experts (E_loc).
    num_bins:    next_pow2(E_loc + 1): histogram bins, the last one collects dropped routes.
    """

    local_table: torch.Tensor
    num_local: int
    num_bins: int


@triton.jit
def route_locality(ids_ptr, table_ptr, route, num_experts, num_local, in_range=True):
    """(local expert id as int64, is local) of routes (a scalar or a tile of route indices), read
    from a plan's `local_table` on the device; unknown ids and routes outside `in_range` count as
    remote."""
    expert = tl.load(ids_ptr + route, mask=in_range, other=-1)
    known = (expert >= 0) & (expert < num_experts)
    local = tl.load(table_ptr + expert, mask=known, other=num_local)
    return local.to(tl.int64), local < num_local


def check_local_routes(
    ids: torch.Tensor, local_table: torch.Tensor, num_local: int, device: torch.device
) -> None:
    """Routes `ids` and a plan's local table as the per-token kernels read them (ValueError
    naming the argument)."""
    require(
        ids.dim() == 2 and ids.dtype == torch.int32 and ids.is_contiguous(),
        f"ids must be contiguous int32 [M, topk], got {ids.dtype} {tuple(ids.shape)}",
    )
    require(ids.shape[1] >= 1, "ids: topk must be >= 1")
    require(
        local_table.dim() == 1 and local_table.dtype == torch.int32 and local_table.is_contiguous(),
        "local_table must be contiguous int32 [E] (MoeSortPlan.local_table)",
    )
    require(
        0 <= num_local <= local_table.numel(),
        f"num_local must be in [0, {local_table.numel()}], got {num_local}",
    )
    for name, tensor in (("ids", ids), ("local_table", local_table)):
        require(tensor.device == device, f"{name} is on {tensor.device}, x on {device}")


def _check_routes(topk_ids: torch.Tensor, topk_weights: torch.Tensor, block_size: int) -> None:
    require(
        topk_ids.dim() == 2 and topk_ids.dtype == torch.int32,
        f"topk_ids must be int32 [M, topk], got {topk_ids.dtype} {topk_ids.shape}",
    )
    require(
        topk_weights.shape == topk_ids.shape and topk_weights.dtype == torch.float32,
        f"topk_weights must be fp32 {tuple(topk_ids.shape)}, got "
        f"{topk_weights.dtype} {tuple(topk_weights.shape)}",
    )
    require(
        topk_ids.shape[0] < 1 << TOKEN_BITS and topk_ids.shape[1] < 1 << 31 - TOKEN_BITS,
        f"topk_ids shape {tuple(topk_ids.shape)} does not fit the packed ids",
    )
    require(
        block_size > 0 and (not block_size & block_size - 1),
        f"block_size must be a power of two, got {block_size}",
    )


@triton.jit
def _local_bins(ids_ptr, table_ptr, offs, num_pairs, num_experts, NUM_BINS: tl.constexpr):
    """Local id of each route in `offs`; routes past the end, out of range or remote -> last bin."""
    in_range = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    known = in_range & (expert >= 0) & (expert < num_experts)
    return tl.load(table_ptr + expert, mask=known, other=NUM_BINS - 1)


@triton.jit
def _moe_sort_kernel(
    ids_ptr,
    weights_ptr,
    table_ptr,
    sorted_ids_ptr,
    sorted_weights_ptr,
    sorted_expert_ids_ptr,
    num_valid_ptr,
    moe_buf_ptr,
    num_tokens,
    num_pairs,
    num_experts,
    num_local,
    moe_buf_numel,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    PAIR_CHUNK: tl.constexpr,
    ZERO_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    # The routes are the router's output, and every buffer stored here (moe_buf included) may
    # still be read by an earlier kernel: wait before anything else.
    wait_for_producers(PDL)
    # One program per local expert (one program when E_loc == 0). Every program rebuilds the same
    # histogram: a few hundred routes at decode, cheaper than a second launch or a grid barrier.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    bins = tl.arange(0, NUM_BINS)

    hist = tl.zeros([NUM_BINS], dtype=tl.int32)
    for p0 in range(0, num_pairs, PAIR_CHUNK):
        offs = p0 + tl.arange(0, PAIR_CHUNK)
        hist += tl.histogram(
            _local_bins(ids_ptr, table_ptr, offs, num_pairs, num_experts, NUM_BINS), NUM_BINS
        )
    is_expert_bin = bins < num_local
    padded = tl.where(is_expert_bin, (hist + BLOCK - 1) // BLOCK * BLOCK, 0)

    if pid == 0:
        tl.store(num_valid_ptr, tl.sum(padded, axis=0))
        tl.store(num_valid_ptr + 1, num_tokens)

    # Zero a strided share of moe_buf; together the programs cover it exactly once.
    zero = tl.zeros([ZERO_CHUNK], dtype=moe_buf_ptr.dtype.element_ty)
    for z0 in range(pid * ZERO_CHUNK, moe_buf_numel, nprog * ZERO_CHUNK):
        offs = z0 + tl.arange(0, ZERO_CHUNK)
        tl.store(moe_buf_ptr + offs, zero, mask=offs < moe_buf_numel)

    if pid < num_local:
        start = tl.sum(tl.where(bins < pid, padded, 0), axis=0)
        count = tl.sum(tl.where(bins == pid, hist, 0), axis=0)
        my_padded = tl.sum(tl.where(bins == pid, padded, 0), axis=0)

        # Stable scatter: a route's rank is the number of this expert's routes before it.
        seen = 0
        for p0 in range(0, num_pairs, PAIR_CHUNK):
            offs = p0 + tl.arange(0, PAIR_CHUNK)
            mine = _local_bins(ids_ptr, table_ptr, offs, num_pairs, num_experts, NUM_BINS) == pid
            mine_i = mine.to(tl.int32)
            dest = start + seen + tl.cumsum(mine_i, axis=0) - mine_i
            token = offs // TOPK
            packed = ((offs - token * TOPK) << 24) | token
            tl.store(sorted_ids_ptr + dest, packed, mask=mine)
            weight = tl.load(weights_ptr + offs, mask=mine, other=0.0)
            tl.store(sorted_weights_ptr + dest, weight, mask=mine)
            seen += tl.sum(mine_i, axis=0)

        tail = tl.arange(0, BLOCK)
        is_pad = tail < my_padded - count
        sentinel = tl.full([BLOCK], (TOPK << 24), tl.int32) | num_tokens
        tl.store(sorted_ids_ptr + start + count + tail, sentinel, mask=is_pad)
        tl.store(
            sorted_weights_ptr + start + count + tail, tl.zeros([BLOCK], tl.float32), mask=is_pad
        )

        first_block = start // BLOCK
        num_blocks = my_padded // BLOCK
        for b0 in range(0, num_blocks, BLOCK):
            blk = b0 + tl.arange(0, BLOCK)
            tl.store(
                sorted_expert_ids_ptr + first_block + blk,
                tl.full([BLOCK], 0, tl.int32) + pid,
                mask=blk < num_blocks,
            )


def _check_out(
    out: MoeSortOutput,
    capacity: int,
    block_size: int,
    num_tokens: int,
    hidden_size: int,
    moe_buf_dtype: torch.dtype,
) -> None:
    expected = {
        "sorted_ids": ((capacity,), torch.int32),
        "sorted_weights": ((capacity,), torch.float32),
        "sorted_expert_ids": ((triton.cdiv(capacity, block_size),), torch.int32),
        "num_valid": ((2,), torch.int32),
        "moe_buf": ((num_tokens, hidden_size), moe_buf_dtype),
    }
    for name, (shape, dtype) in expected.items():
        tensor = getattr(out, name)
        require(
            tuple(tensor.shape) == shape and tensor.dtype == dtype and tensor.is_contiguous(),
            f"out.{name} must be contiguous {dtype} {shape}, got "
            f"{tensor.dtype} {tuple(tensor.shape)}",
        )


def sort_block_size(num_tokens: int, topk: int, num_local: int) -> int:
    """Rows per expert block of `moe_sort` (and the M tile of the grouped GEMMs) for a batch of
    `num_tokens` routed `topk` times over `num_local` experts: 16 while the routes average at
    most 16 per expert (decode sizes, where most of a block is padding: a 32-row tile doubles
    the matrix work and makes two warps share, and each dequantise, the same weight columns),
    else 32. The tile size changes no result bit (a compiled dot sums an output alike in any
    tile), only the time."""
    return 16 if num_tokens * topk <= 16 * max(num_local, 1) else 32


def prepare_moe_sort(expert_mask: torch.Tensor) -> MoeSortPlan:
    """Build the local-id table for `expert_mask` (int32 [E], 1 = expert lives on this rank).

    NOTE: reads the mask on the host (a blocking device->host copy). Call it once per mask, before
    CUDA-graph capture, and again only when the mask changes.
    """
    require(
        expert_mask.dim() == 1 and expert_mask.dtype == torch.int32,
        f"expert_mask must be int32 [E], got {expert_mask.dtype} {tuple(expert_mask.shape)}",
    )
    host_mask = expert_mask.cpu()
    require(bool(((host_mask == 0) | (host_mask == 1)).all()), "expert_mask values must be 0 or 1")
    num_local = int(host_mask.sum())
    num_bins = triton.next_power_of_2(num_local + 1)
    local_ids = torch.cumsum(host_mask, 0, dtype=torch.int32) - host_mask
    table = torch.where(host_mask == 1, local_ids, torch.full_like(local_ids, num_bins - 1))
    return MoeSortPlan(table.to(expert_mask.device), num_local, num_bins)


def moe_sort(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: MoeSortPlan,
    hidden_size: int,
    block_size: int = 32,
    moe_buf_dtype: torch.dtype = torch.bfloat16,
    out: MoeSortOutput | None = None,
) -> MoeSortOutput:
    """Sort the routes of this EP rank by local expert, in one launch (graph-safe).

    Args:
        topk_ids: int32 [M, topk], contiguous; global expert ids. Ids outside [0, E) are dropped
            (so -1 / E fill ids of padded rows vanish; fill id 0 is sorted like a real route).
        topk_weights: fp32 [M, topk], contiguous.
        plan: from `prepare_moe_sort(expert_mask)`, on the same device.
        hidden_size: H of the zeroed accumulator `moe_buf [M, H]`.
        out: optional preallocated outputs (shapes/dtypes as `moe_sort_ref` returns them).
    Returns:
        `MoeSortOutput`; see its docstring. Equal to `moe_sort_ref` on the valid prefix.
    """
    _check_routes(topk_ids, topk_weights, block_size)
    require(
        topk_ids.is_contiguous() and topk_weights.is_contiguous(),
        "topk_ids and topk_weights must be contiguous",
    )
    table = plan.local_table
    require(
        table.dtype == torch.int32 and table.dim() == 1,
        f"plan.local_table must be int32 [E], got {table.dtype} {tuple(table.shape)}",
    )
    require(
        table.device == topk_ids.device, f"plan is on {table.device}, routes on {topk_ids.device}"
    )
    num_tokens, topk = topk_ids.shape
    num_experts = table.numel()
    device = topk_ids.device
    capacity = moe_sort_capacity(num_tokens, topk, num_experts, block_size)
    if out is None:
        out = MoeSortOutput(
            torch.empty(capacity, dtype=torch.int32, device=device),
            torch.empty(capacity, dtype=torch.float32, device=device),
            torch.empty(triton.cdiv(capacity, block_size), dtype=torch.int32, device=device),
            torch.empty(2, dtype=torch.int32, device=device),
            torch.empty(num_tokens, hidden_size, dtype=moe_buf_dtype, device=device),
        )
    _check_out(out, capacity, block_size, num_tokens, hidden_size, moe_buf_dtype)
    sorted_ids, sorted_weights, sorted_expert_ids, num_valid, moe_buf = out
    require(moe_buf.numel() < 2**31, f"moe_buf {tuple(moe_buf.shape)} exceeds int32 indexing")
    if num_tokens == 0:
        num_valid.zero_()
        return out
    num_pairs = num_tokens * topk
    _moe_sort_kernel[(max(plan.num_local, 1),)](
        topk_ids,
        topk_weights,
        table,
        sorted_ids,
        sorted_weights,
        sorted_expert_ids,
        num_valid,
        moe_buf,
        num_tokens,
        num_pairs,
        num_experts,
        plan.num_local,
        moe_buf.numel(),
        TOPK=topk,
        BLOCK=block_size,
        NUM_BINS=plan.num_bins,
        PAIR_CHUNK=min(triton.next_power_of_2(num_pairs), _MAX_PAIR_CHUNK),
        ZERO_CHUNK=_ZERO_CHUNK,
        num_warps=2,
        **programmatic_launch(_moe_sort_kernel, device),
    )
    return out
