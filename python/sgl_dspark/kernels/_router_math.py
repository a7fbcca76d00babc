"""Triton pieces of the router kernel (`moe_route`): the scoring functions and hash routing's
gather. Kept apart so `moe_route.py` stays readable; numerics are documented there."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sqrt_rn(x):
    """tl.sqrt_rn minus its per-element slow-path branch (it serialised the MUFU latencies): the
    fast path (same sm90 instructions and bits; exact for 2^-101 <= x < inf), small x scaled in."""
    small = x < 7.888609052210118e-31  # 2^-100
    xs = tl.where(small, x * 18446744073709551616.0, x)
    r = tl.rsqrt(xs)
    s = xs * r
    out = tl.fma(tl.fma(-s, s, xs), r * 0.5, s)
    out = tl.where(small, out * 2.3283064365386963e-10, out)  # 2^-32: exact
    return tl.where((x > 0.0) & (x < float("inf")), out, tl.where(x < 0.0, float("nan"), x))


@triton.jit
def scores(logits, SCORING: tl.constexpr, BRANCHLESS_SQRT: tl.constexpr):
    """sqrtsoftplus (SCORING 0) or sigmoid (1) of fp32 logits, as `moe_route._scores_ref`."""
    if SCORING == 0:
        soft = tl.log2(1.0 + tl.exp2(logits * 1.4426950408889634)) * 0.6931471805599453
        soft = tl.where(logits > 20.0, logits, soft)
        # The interpreter's rsqrt and fma round twice (1-ulp errors): exact sqrt there.
        return _sqrt_rn(soft) if BRANCHLESS_SQRT else tl.sqrt_rn(soft)
    one = tl.full(logits.shape, 1.0, tl.float32)
    return tl.div_rn(one, 1.0 + tl.exp2(-logits * 1.4426950408889634))


@triton.jit
def hash_route_rows(
    row0,
    row_end,
    n_valid,
    logits_ptr,
    partials_ptr,
    input_ids_ptr,
    tid2eid_ptr,
    ids_ptr,
    weights_ptr,
    num_rows,
    num_experts,
    num_tokens,
    stride_tid,
    routed_scale,
    shared_weight,
    fill_id,
    shared_id_base,
    FROM_LOGITS: tl.constexpr,
    SCORING: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOPK: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BRANCHLESS_SQRT: tl.constexpr,
):
    """Hash routing of rows [row0, row_end): ids = tid2eid[input_ids], weights the scores of
    those TOPK experts only, gathered from the logits (or the split partials, summed in order
    s = 0..S-1 as the full path does), so a row costs three dependent loads and no reductions
    over all E experts. The token and expert ids are clamped into their tables: padding rows
    (whatever their ids hold) read in bounds without waiting for n_valid, and are filled after."""
    cols = tl.arange(0, BLOCK_OUT)[None, :]
    is_routed = cols < TOPK
    for r0 in range(row0, row_end, ROWS):
        rows = r0 + tl.arange(0, ROWS)[:, None]
        row_ok = rows < num_rows
        token = tl.load(input_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        token = tl.minimum(tl.maximum(token, 0), num_tokens - 1)
        ok = row_ok & is_routed
        expert = tl.load(tid2eid_ptr + token * stride_tid + cols, mask=ok, other=0).to(tl.int32)
        expert = tl.minimum(tl.maximum(expert, 0), num_experts - 1)
        offs = rows * num_experts + expert
        if FROM_LOGITS:
            logits = tl.load(logits_ptr + offs, mask=ok, other=0.0)
        else:
            logits = tl.load(partials_ptr + offs, mask=ok, other=0.0)
            for s in tl.static_range(1, NUM_SPLITS):
                logits += tl.load(
                    partials_ptr + s * num_rows * num_experts + offs, mask=ok, other=0.0
                )
        w = scores(logits, SCORING, BRANCHLESS_SQRT)
        w = tl.where(ok & (w == w), w, 0.0)  # NaN score -> weight 0
        if RENORMALIZE:
            total = tl.zeros([ROWS, 1], dtype=tl.float32)
            for slot in tl.static_range(TOPK):  # slot order, as the reference sums
                total += tl.sum(tl.where(cols == slot, w, 0.0), axis=1, keep_dims=True)
            w = tl.div_rn(w, tl.zeros_like(w) + (total + 1e-20))
        w = w * routed_scale
        is_shared = (cols >= TOPK) & (cols < TOPK + NUM_SHARED)
        ids = tl.where(is_shared, shared_id_base + cols - TOPK, expert)
        w = tl.where(is_shared, shared_weight, w)
        is_pad = rows >= n_valid
        ids = tl.where(is_pad, fill_id, ids)
        w = tl.where(is_pad, 0.0, w)
        out_offs = rows * (TOPK + NUM_SHARED) + cols
        out_ok = row_ok & (cols < TOPK + NUM_SHARED)
        tl.store(ids_ptr + out_offs, ids, mask=out_ok)
        tl.store(weights_ptr + out_offs, w, mask=out_ok)
