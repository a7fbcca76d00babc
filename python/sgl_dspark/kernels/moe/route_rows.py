"""The routing of rows of the router kernel (`router.py`) once their logits exist: the scoring
functions, top-k routing over all experts and hash routing (`router_topk_ref` is the spec)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sqrt_rn(x):
    """tl.sqrt_rn minus its per-element slow-path branch (which serialises the special-function
    unit's latencies): the fast path (the same instructions and bits; exact for
    2^-101 <= x < inf), small x scaled in."""
    small = x < 7.888609052210118e-31  # 2^-100
    xs = tl.where(small, x * 18446744073709551616.0, x)
    r = tl.rsqrt(xs)
    s = xs * r
    out = tl.fma(tl.fma(-s, s, xs), r * 0.5, s)
    out = tl.where(small, out * 2.3283064365386963e-10, out)  # 2^-32: exact
    return tl.where((x > 0.0) & (x < float("inf")), out, tl.where(x < 0.0, float("nan"), x))


@triton.jit
def score_logits(logits, SCORING: tl.constexpr, BRANCHLESS_SQRT: tl.constexpr):
    """sqrtsoftplus (SCORING 0) or sigmoid (1) of fp32 logits, as `router_topk_ref`."""
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
    gate_temp,
    FROM_LOGITS: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_TEMP: tl.constexpr,
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
        if HAS_TEMP:
            logits = tl.div_rn(logits, tl.zeros_like(logits) + gate_temp)
        w = score_logits(logits, SCORING, BRANCHLESS_SQRT)
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


@triton.jit
def _row_max(x):
    # Chunks first (in-thread when a warp owns the row), then the lanes.
    return tl.max(tl.max(x, axis=1, keep_dims=True), axis=2, keep_dims=True)


@triton.jit
def topk_route_rows(
    row0,
    row_end,
    n_valid,
    logits_ptr,
    partials_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    logits_out_ptr,
    num_rows,
    num_experts,
    routed_scale,
    shared_weight,
    fill_id,
    shared_id_base,
    gate_temp,
    FROM_LOGITS: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,
    TOPK: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BRANCHLESS_SQRT: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Top-k routing of rows [row0, row_end): scores of all E experts from the logits (or the
    split partials, summed in order s = 0..S-1, optionally written to logits_out), selection on
    scores + bias, top-k with ties to the lower expert id, weights gathered exactly, renormalised,
    scaled; shared columns appended; rows >= n_valid filled."""
    # Rows [r0, r0 + ROWS) per loop step. Tile [ROWS, CHUNKS, CHUNK], expert = chunk *
    # CHUNK + lane: CHUNK 128 fills a warp's 32 lanes x 4 and the layout's next axis is
    # the rows, so warps split rows and a row's reductions stay in one warp. Per-row:
    # [ROWS, 1, 1].
    for r0 in range(row0, row_end, ROWS):
        rows = r0 + tl.arange(0, ROWS)[:, None, None]
        cols = tl.arange(0, CHUNKS)[None, :, None] * CHUNK + tl.arange(0, CHUNK)[None, None, :]
        row_ok = rows < num_rows
        col_ok = cols < num_experts
        tile_ok = row_ok & col_ok
        offs = rows * num_experts + cols
        if FROM_LOGITS:
            logits = tl.load(logits_ptr + offs, mask=tile_ok, other=0.0)
        else:
            # The reference's order s = 0..S-1; a group's loads are independent, so
            # SPLIT_GROUP are in flight at once (a round trip per group, bounded registers).
            logits = tl.load(partials_ptr + offs, mask=tile_ok, other=0.0)
            for s0 in range(1, NUM_SPLITS, SPLIT_GROUP):
                for j in tl.static_range(SPLIT_GROUP):
                    live = s0 + j < NUM_SPLITS
                    part = tl.load(
                        partials_ptr + (s0 + j) * num_rows * num_experts + offs,
                        mask=tile_ok & live,
                        other=0.0,
                    )
                    logits = tl.where(live, logits + part, logits)
            if WRITE_LOGITS:
                tl.store(logits_out_ptr + offs, logits, mask=tile_ok)
        if HAS_TEMP:  # the router temperature, correctly rounded (the reference's division)
            logits = tl.div_rn(logits, tl.zeros_like(logits) + gate_temp)
        scores = score_logits(logits, SCORING, BRANCHLESS_SQRT)
        # Scores are >= +0.0 (NaN -> 0), so their bits are int32 >= 0 and a max over
        # "hit ? bits : 0" with one hit gathers them exactly (an int REDUX, no float tree).
        gather_bits = tl.where(scores != scores, 0.0, scores).to(tl.int32, bitcast=True)
        out_cols = tl.arange(0, BLOCK_OUT)[None, None, :]
        out_ids = tl.zeros([ROWS, 1, BLOCK_OUT], dtype=tl.int32)
        out_w = tl.zeros([ROWS, 1, BLOCK_OUT], dtype=tl.float32)
        total = tl.zeros([ROWS, 1, 1], dtype=tl.float32)
        choice = scores
        if HAS_BIAS:  # a full-tile load: a [1, CHUNKS, CHUNK] one gets a layout with the
            # warps on the chunks, and the whole top-k would follow it
            choice += tl.load(bias_ptr + rows * 0 + cols, mask=tile_ok, other=0.0)
        choice = tl.where(choice != choice, float("-inf"), choice)
        choice = tl.where(choice == 0.0, 0.0, choice)  # -0.0 and +0.0 must tie
        # Order-preserving int32 key; "taken" (INT_MIN) is below every real key (NaN and
        # -inf included). Per slot: the max key, then the lowest expert holding it.
        bits = choice.to(tl.int32, bitcast=True)
        key = tl.where(col_ok, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), -2147483648)
        for slot in tl.range(0, TOPK, loop_unroll_factor=UNROLL):
            # the lowest expert holding the max key (a max over negated ids)
            expert = -_row_max(tl.where(key == _row_max(key), -cols, -2147483647))
            hit = cols == expert
            key = tl.where(hit, -2147483648, key)
            picked = _row_max(tl.where(hit, gather_bits, 0)).to(tl.float32, bitcast=True)
            out_ids = tl.where(out_cols == slot, expert, out_ids)
            out_w = tl.where(out_cols == slot, picked, out_w)
            total += picked
        if RENORMALIZE:
            out_w = tl.div_rn(out_w, tl.zeros_like(out_w) + (total + 1e-20))
        out_w = out_w * routed_scale
        is_shared = (out_cols >= TOPK) & (out_cols < TOPK + NUM_SHARED)
        out_ids = tl.where(is_shared, shared_id_base + out_cols - TOPK, out_ids)
        out_w = tl.where(is_shared, shared_weight, out_w)
        out_ids = tl.where(rows >= n_valid, fill_id, out_ids)
        out_w = tl.where(rows >= n_valid, 0.0, out_w)
        out_offs = rows * (TOPK + NUM_SHARED) + out_cols
        out_ok = row_ok & (out_cols < TOPK + NUM_SHARED)
        tl.store(ids_ptr + out_offs, out_ids, mask=out_ok)
        tl.store(weights_ptr + out_offs, out_w, mask=out_ok)
