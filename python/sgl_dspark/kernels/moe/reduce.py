"""Masked local route reduce + routed scale + shared-expert add in one launch, deterministic
(`moe_reduce_ref` is the spec; `reference.py` gives the math).

Rounding happens exactly where the unfused chain (reduce -> scale -> shared add) stores to memory,
the slot sum has a fixed order and FMA contraction is off, so the result is bit-exact against
`moe_reduce_ref` on any backend, the CPU interpreter included (bf16 rounding is done on the
bits). Remote slots' `y` rows may hold garbage (even NaN): they are loaded (the buffer is
allocated) but never used, a select drops them; a token with no local slot gets
out = round(0 + shared), so an expert-parallel all-reduce still sees the shared expert once.

As a stage-2 GEMM epilogue (`token_down.moe_token_down_reduce`, the engine's path up to a few
tokens): the programs of a token's H tile form its slots' products themselves (the token's row
of ids is its slot list), one of them sums them in slot order instead of the caller storing
`y [M, topk, H]`, and runs this kernel's tail, `route_reduce_tail` (round, scale, round, +
shared, round, store); only the producer of the per-slot values differs, so the bits are the
same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import (
    interpreted,
    programmatic_launch,
    round_bf16_native_or_bits,
    wait_for_producers,
)

_MAX_BLOCK_H = 256  # more programs at small M: latency-bound loads overlap across SMs


def _reduce_meta(num_tokens: int, hidden: int) -> dict[str, int]:
    """Launch meta-parameters (H columns per program, warps). Each output column is its own
    slot-ordered sum, so any choice gives the same bits; `benchmark/kernels/sweep_launch.py`
    times alternatives against this default: narrow column blocks spread small M over more
    programs, wide single-warp blocks suit large M."""
    if num_tokens >= 128:
        return {"BLOCK_H": min(2 * _MAX_BLOCK_H, triton.next_power_of_2(hidden)), "num_warps": 1}
    return {"BLOCK_H": min(_MAX_BLOCK_H, triton.next_power_of_2(hidden)), "num_warps": 4}


@triton.jit
def route_reduce_tail(
    acc,
    shared_ptr,
    out_ptr,
    offs,
    in_cols,
    routed_scale,
    APPLY_SCALE: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """fp32 slot sum -> stored output, rounding where the unfused chain stores (on the bits in
    the interpreter, `ON_BITS`; by the native nearest-even cast when compiled: same bits)."""
    if ROUND_BF16:
        acc = round_bf16_native_or_bits(acc, ON_BITS)
    if APPLY_SCALE:
        acc = acc * routed_scale
        if ROUND_BF16:
            acc = round_bf16_native_or_bits(acc, ON_BITS)
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + offs, mask=in_cols, other=0.0).to(tl.float32)
        if ROUND_BF16 and ON_BITS:  # compiled, the store's cast rounds
            acc = round_bf16_native_or_bits(acc, ON_BITS)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=in_cols)


@triton.jit
def _moe_reduce_kernel(
    y_ptr,
    weights_ptr,
    ids_ptr,
    mask_ptr,
    shared_ptr,
    out_ptr,
    hidden,
    num_experts,
    routed_scale,
    TOPK: tl.constexpr,
    APPLY_SCALE: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ON_BITS: tl.constexpr,
    EVEN_H: tl.constexpr,
    UNIT_WEIGHTS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # y, the routes and shared come from earlier kernels
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    # EVEN_H: the programs tile H exactly, so no lane is masked (unpredicated, vectorised loads).
    in_cols = (cols < hidden) | EVEN_H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        expert = tl.load(ids_ptr + token * TOPK + slot)
        known = (expert >= 0) & (expert < num_experts)
        is_local = tl.load(mask_ptr + expert, mask=known, other=0) == 1
        if UNIT_WEIGHTS:  # weighted before the down projection: 1 * row is row, exactly
            weight = 1.0
        else:
            weight = tl.load(weights_ptr + token * TOPK + slot)
        # Read whether or not the expert is local (the row is allocated; a remote row's garbage
        # is discarded by the select below, never added): the load then does not wait for the
        # id -> mask lookup, so the three loads of a slot are in flight together.
        row = tl.load(y_ptr + (token * TOPK + slot) * hidden + cols, mask=in_cols, other=0.0).to(
            tl.float32
        )
        acc += tl.where(is_local, weight * row, 0.0)
    route_reduce_tail(
        acc,
        shared_ptr,
        out_ptr,
        token * hidden + cols,
        in_cols,
        routed_scale,
        APPLY_SCALE,
        HAS_SHARED,
        ROUND_BF16,
        ON_BITS,
    )


def moe_reduce(
    y: torch.Tensor,
    topk_weights: torch.Tensor | None,
    topk_ids: torch.Tensor,
    expert_mask: torch.Tensor,
    routed_scale: float = 1.0,
    shared: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce each token's local expert outputs in slot order, scale, add the shared expert.

    Args:
        y: [M, topk, H] bf16 or fp32, contiguous; y[t, k] is expert ids[t, k]'s output for token t
            (only read where that expert is local).
        topk_weights: fp32 [M, topk] contiguous, or None: unit weights (the routes were
            weighted before the down projection), the same bits as a tensor of ones, no read.
        topk_ids: int32 [M, topk] contiguous; ids outside [0, E) count as remote.
        expert_mask: int32 [E]; 1 = expert lives on this rank.
        routed_scale: multiplies the rounded routed sum (pass 1.0 when the router folded it in).
        shared: optional [M, H] in y's dtype, contiguous; the shared-expert output to add.
        out: optional [M, H] output in y's dtype, contiguous.
    Returns:
        out [M, H] in y's dtype.
    """
    require(
        y.dim() == 3 and y.dtype in (torch.bfloat16, torch.float32) and y.is_contiguous(),
        f"y must be contiguous bf16/fp32 [M, topk, H], got {y.dtype} {y.shape}",
    )
    num_tokens, topk, hidden = y.shape
    routes = (num_tokens, topk)
    require(
        topk_weights is None
        or (
            topk_weights.shape == routes
            and topk_weights.dtype == torch.float32
            and topk_weights.is_contiguous()
        ),
        f"topk_weights must be None or contiguous fp32 {routes}, got "
        f"{None if topk_weights is None else (topk_weights.dtype, tuple(topk_weights.shape))}",
    )
    require(
        topk_ids.shape == routes and topk_ids.dtype == torch.int32,
        f"topk_ids must be int32 {routes}, got {topk_ids.dtype}",
    )
    require(topk_ids.is_contiguous(), "topk_ids must be contiguous")
    require(
        expert_mask.dim() == 1 and expert_mask.dtype == torch.int32,
        f"expert_mask must be int32 [E], got {expert_mask.dtype}",
    )
    for name, tensor in (("shared", shared), ("out", out)):
        require(
            tensor is None
            or (
                tensor.shape == (num_tokens, hidden)
                and tensor.dtype == y.dtype
                and tensor.is_contiguous()
            ),
            f"{name} must be contiguous {y.dtype} {(num_tokens, hidden)}",
        )
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    if num_tokens == 0 or hidden == 0:
        return out
    meta = _reduce_meta(num_tokens, hidden)
    _moe_reduce_kernel[(num_tokens, triton.cdiv(hidden, meta["BLOCK_H"]))](
        y,
        topk_weights if topk_weights is not None else y,
        topk_ids,
        expert_mask,
        shared if shared is not None else out,
        out,
        hidden,
        expert_mask.numel(),
        float(routed_scale),
        TOPK=topk,
        APPLY_SCALE=routed_scale != 1.0,
        HAS_SHARED=shared is not None,
        ROUND_BF16=y.dtype == torch.bfloat16,
        ON_BITS=interpreted(_moe_reduce_kernel),
        EVEN_H=hidden % meta["BLOCK_H"] == 0,
        UNIT_WEIGHTS=topk_weights is None,
        enable_fp_fusion=False,  # the reference rounds w * y before adding it
        **programmatic_launch(_moe_reduce_kernel, y.device),
        **meta,
    )
    return out
