"""Decode/verify block pooling of the CSA/HCA compressors (`compressor_pool_ref` is the spec; its
module doc gives the math), and the kernel's launch for the decode and prefill steps
(`decode.py`, `extend.py`), which also rotate and store the entries and record the ring rows.

Rows that do not end a block write zeros and slot 0 (the reserved dummy entry) without loading
anything. `compressor_pool` does not rotate (the caller rotates at the block start p - m + 1).

Exactness: within a tolerance of the reference. Every rounding point of the torch chain is
reproduced (round to nearest even; bf16 on the bits, so the interpreter's truncating cast is never
used); what remains is the exp lowering and the order of the three fp32 sums (softmax
denominator, span sum, mean of squares). fp32 agrees to ~1e-6 relative; in bf16/fp16 a value
that lands within an ulp of a rounding boundary may round the other way, which the norm can
spread to ~2 ulps (rare).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    arrival_counters,
    programmatic_launch,
    round_to_storage,
    wait_for_producers,
)
from sgl_dspark.kernels.compressor.args import check_compressor_args
from sgl_dspark.kernels.compressor.reference import PooledEntries
from sgl_dspark.kernels.compressor.span import rope_pairs, rope_table_rows, span_logits, span_tile

# A row's pooling is split over programs of BLOCK_C channels (the span softmax and sum are per
# channel; only the RMSNorm couples them, and the last program of the row to arrive applies it)
# until a program's span x BLOCK_C tile is _PROGRAM_ELEMS (at least _MIN_CHANNELS wide); a span
# tile holds at most _TILE_ELEMS, more spans take several passes. A long span (HCA, m 128) at
# Dh 512 in one program per row serialises the whole span in one program; split into narrow
# channel blocks it spreads over many. Rows of <= 1024 elements (CSA at Dh 64/128) stay whole.
_PROGRAM_ELEMS = 1024
_MIN_CHANNELS = 8
_TILE_ELEMS = 4096


def _pool_meta(head_dim: int, span: int) -> dict[str, int]:
    """Launch meta-parameters, a function of (Dh, span) only, so a row's bits never depend on
    the batch (`benchmark/kernels/sweep_launch.py` overrides them): BLOCK_D (the row), BLOCK_C
    (the channels of one program: BLOCK_D, or a split), span slots per tile (one tile: the
    single pass) and warps."""
    block_d, span_p2 = triton.next_power_of_2(head_dim), triton.next_power_of_2(span)
    block_c = min(block_d, max(_MIN_CHANNELS, _PROGRAM_ELEMS // span_p2))
    return {
        "BLOCK_D": block_d,
        "BLOCK_C": block_c,
        "SPAN_BLOCK": min(span_p2, _TILE_ELEMS // block_c),
        "num_warps": 4,
    }


def _channel_blocks(meta: dict[str, int], head_dim: int) -> int:
    """Programs per row of a launch with `meta` (> 1: the last arrival norms the row)."""
    return triton.cdiv(head_dim, meta["BLOCK_C"])


@triton.jit
def _compressor_pool_kernel(
    kv_ptr,
    score_ptr,
    state_kv_ptr,
    state_score_ptr,
    bias_ptr,
    norm_w_ptr,
    pos_ptr,
    slot_ptr,
    prefix_ptr,
    table_ptr,
    out_ptr,
    out_slot_ptr,
    cos_ptr,
    sin_ptr,
    rows_ptr,
    counters_ptr,
    head_dim,
    ratio,
    ring,
    eps,
    kv_stride,
    score_stride,
    skv_stride_r,
    skv_stride_q,
    ss_stride_r,
    ss_stride_q,
    bias_stride,
    table_stride,
    out_stride,
    cs_stride,
    SPAN: tl.constexpr,
    OVERLAP: tl.constexpr,
    STORAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPAN_BLOCK: tl.constexpr,
    FUSED: tl.constexpr,
    NOPE_HALF: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROW_LIST: tl.constexpr,
    RING_STORE: tl.constexpr,
    POOL: tl.constexpr,
    PDL: tl.constexpr,
):
    """FUSED false: pooled entry and slot per row into out / out_slot (`compressor_pool`).
    FUSED true (`compressor_decode`): the row's raw kv/score go to its ring row (RING_STORE), and
    a block end's entry is rotated and written straight into the entry pool `out` at its slot
    (POOL). ROW_LIST: program i handles row rows[i] (`compressor_extend`), else row i. Program
    (i, c) pools channels [c * BLOCK_C, +BLOCK_C); with BLOCK_C < BLOCK_D it stores them un-normed
    in the destination row and counts itself in, and the row's last arrival norms (and rotates)
    the whole row there. A destination's counter only ever grows by whole rows' worth of arrivals
    (each arrival that completes a multiple of the programs per row takes that many back), so a
    counter zeroed once stays valid, even when padding rows share the dummy entry 0."""
    # Before everything: the row list, positions, kv/score rows and the rings come from earlier
    # kernels, and every path stores. The parameters (position bias, norm weight) are read only
    # deep in the pooling, where prefetching them would gain nothing.
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cblock = tl.program_id(1)
    if ROW_LIST:
        row = tl.load(rows_ptr + row)
        if row < 0:  # padding of a list with a static size (a prefill graph's)
            return
    cols = cblock * BLOCK_C + tl.arange(0, BLOCK_C)
    in_col = cols < head_dim
    # The row's scalars in one round trip (the prefix too, though only block ends use it), so
    # that the span loads below wait for nothing else.
    pos = tl.load(pos_ptr + row)
    req = tl.load(slot_ptr + row)
    prefix = tl.load(prefix_ptr + row)
    if FUSED and RING_STORE:
        if cblock == 0:
            # Ring rows of this forward never alias a ring row that any span reads (R >= span
            # + rows per request: a read position q < prefix and a written p >= prefix differ
            # by less than R), so this write may precede the other programs' reads.
            wcols = tl.arange(0, BLOCK_W)
            wmask = wcols < (2 * head_dim if OVERLAP else head_dim)
            ring_row = pos % ring
            ring_row = tl.where(ring_row < 0, ring_row + ring, ring_row)
            kv_raw = tl.load(kv_ptr + row * kv_stride + wcols, mask=wmask)
            sc_raw = tl.load(score_ptr + row * score_stride + wcols, mask=wmask)
            tl.store(
                state_kv_ptr + req * skv_stride_r + ring_row * skv_stride_q + wcols,
                kv_raw,
                mask=wmask,
            )
            tl.store(
                state_score_ptr + req * ss_stride_r + ring_row * ss_stride_q + wcols,
                sc_raw,
                mask=wmask,
            )
    if FUSED:
        if not POOL or (pos + 1) % ratio != 0:
            return
    else:
        if (pos + 1) % ratio != 0:
            # Not a block end: the dummy entry 0 gets zeros, nothing is loaded.
            tl.store(
                out_ptr + row * out_stride + cols,
                tl.zeros((BLOCK_C,), tl.float32).to(out_ptr.dtype.element_ty),
                mask=in_col,
            )
            tl.store(out_slot_ptr + row, pos * 0)
            return
    # What the entry needs besides the span does not depend on it: issued with the span loads.
    block_start = tl.load(table_ptr + req * table_stride + pos - (ratio - 1))
    if FUSED:
        dest = block_start // ratio
    else:
        dest = row
    if BLOCK_C == BLOCK_D:
        norm_w = tl.load(norm_w_ptr + cols, mask=in_col, other=0.0).to(tl.float32)
        if FUSED:
            cos_r, sin_r, is_rope = rope_table_rows(
                row, cos_ptr, sin_ptr, cs_stride, head_dim, NOPE_HALF, BLOCK_D
            )
    # torch's softmax over the span: the weights are normalised and rounded to the kv dtype
    # before they meet kv.
    if SPAN <= SPAN_BLOCK:
        # One tile: every load in one round trip, one pass. The passes below with one tile do
        # the same arithmetic.
        sc = span_logits(
            0,
            row,
            pos,
            prefix,
            req,
            ratio,
            ring,
            cols,
            in_col,
            head_dim,
            score_ptr,
            score_stride,
            state_score_ptr,
            ss_stride_r,
            ss_stride_q,
            bias_ptr,
            bias_stride,
            SPAN,
            OVERLAP,
            SPAN_BLOCK,
            STORAGE,
        )
        kv, _q, _offset, _keep = span_tile(
            0,
            row,
            pos,
            prefix,
            req,
            ratio,
            ring,
            cols,
            in_col,
            head_dim,
            kv_ptr,
            kv_stride,
            state_kv_ptr,
            skv_stride_r,
            skv_stride_q,
            SPAN,
            OVERLAP,
            SPAN_BLOCK,
        )
        top = tl.where(in_col, tl.max(sc, axis=0), 0.0)
        e = tl.exp(sc - top[None, :])
        denom = tl.where(in_col, tl.sum(e, axis=0), 1.0)
        acc = tl.sum(
            round_to_storage(kv * round_to_storage(e / denom[None, :], STORAGE), STORAGE), axis=0
        )
    else:
        # Three passes over the span in tiles of SPAN_BLOCK slots (max, denominator, sum).
        top = tl.full((BLOCK_C,), float("-inf"), tl.float32)
        for j0 in range(0, SPAN, SPAN_BLOCK):
            sc = span_logits(
                j0,
                row,
                pos,
                prefix,
                req,
                ratio,
                ring,
                cols,
                in_col,
                head_dim,
                score_ptr,
                score_stride,
                state_score_ptr,
                ss_stride_r,
                ss_stride_q,
                bias_ptr,
                bias_stride,
                SPAN,
                OVERLAP,
                SPAN_BLOCK,
                STORAGE,
            )
            top = tl.maximum(top, tl.max(sc, axis=0))
        top = tl.where(in_col, top, 0.0)
        denom = tl.zeros((BLOCK_C,), tl.float32)
        for j0 in range(0, SPAN, SPAN_BLOCK):
            sc = span_logits(
                j0,
                row,
                pos,
                prefix,
                req,
                ratio,
                ring,
                cols,
                in_col,
                head_dim,
                score_ptr,
                score_stride,
                state_score_ptr,
                ss_stride_r,
                ss_stride_q,
                bias_ptr,
                bias_stride,
                SPAN,
                OVERLAP,
                SPAN_BLOCK,
                STORAGE,
            )
            denom += tl.sum(tl.exp(sc - top[None, :]), axis=0)
        denom = tl.where(in_col, denom, 1.0)
        acc = tl.zeros((BLOCK_C,), tl.float32)
        for j0 in range(0, SPAN, SPAN_BLOCK):
            sc = span_logits(
                j0,
                row,
                pos,
                prefix,
                req,
                ratio,
                ring,
                cols,
                in_col,
                head_dim,
                score_ptr,
                score_stride,
                state_score_ptr,
                ss_stride_r,
                ss_stride_q,
                bias_ptr,
                bias_stride,
                SPAN,
                OVERLAP,
                SPAN_BLOCK,
                STORAGE,
            )
            weight = round_to_storage(tl.exp(sc - top[None, :]) / denom[None, :], STORAGE)
            # Absent slots load kv = 0 (and have weight 0), as the reference's masked_fill.
            kv, _q, _offset, _keep = span_tile(
                j0,
                row,
                pos,
                prefix,
                req,
                ratio,
                ring,
                cols,
                in_col,
                head_dim,
                kv_ptr,
                kv_stride,
                state_kv_ptr,
                skv_stride_r,
                skv_stride_q,
                SPAN,
                OVERLAP,
                SPAN_BLOCK,
            )
            acc += tl.sum(round_to_storage(kv * weight, STORAGE), axis=0)
    pooled = round_to_storage(acc, STORAGE)
    out_row = out_ptr + dest * out_stride
    if BLOCK_C < BLOCK_D:
        # The pooled values are kv-dtype values already, so the round trip through the
        # destination row is exact and the norm below sees what one program would have.
        tl.store(out_row + cols, pooled.to(out_ptr.dtype.element_ty), mask=in_col)
        tl.debug_barrier()  # every thread's store before the release
        ticket = tl.atomic_add(counters_ptr + dest, 1, sem="acq_rel")
        per_row = tl.num_programs(1)
        if ticket % per_row != per_row - 1:
            return
        tl.atomic_add(counters_ptr + dest, -per_row, sem="relaxed")
        cols = tl.arange(0, BLOCK_D)
        in_col = cols < head_dim
        pooled = tl.load(out_row + cols, mask=in_col, other=0.0).to(tl.float32)
        norm_w = tl.load(norm_w_ptr + cols, mask=in_col, other=0.0).to(tl.float32)
        if FUSED:
            cos_r, sin_r, is_rope = rope_table_rows(
                row, cos_ptr, sin_ptr, cs_stride, head_dim, NOPE_HALF, BLOCK_D
            )

    mean_sq = tl.sum(pooled * pooled, axis=0) / head_dim
    rstd = 1.0 / tl.sqrt_rn(mean_sq + eps)
    entry = round_to_storage(norm_w * (pooled * rstd), STORAGE)
    if FUSED:
        entry = rope_pairs(entry, cos_r, sin_r, is_rope, BLOCK_D, STORAGE)
    tl.store(out_row + cols, entry.to(out_ptr.dtype.element_ty), mask=in_col)
    if not FUSED:
        tl.store(out_slot_ptr + row, block_start // ratio)


def compressor_pool(
    kv: torch.Tensor,
    score: torch.Tensor,
    state_kv: torch.Tensor,
    state_score: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    token_prefix: torch.Tensor,
    req_to_token: torch.Tensor,
    ratio: int,
    overlap: bool,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    out_slots: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> PooledEntries:
    """Pool the entry of every block that a row of this decode/verify forward ends, one launch.

    Args:
        kv, score: [T, W] bf16/fp16/fp32 (one dtype), unit channel stride; W = 2*Dh with overlap.
        state_kv, state_score: [req_slots, R, W] of kv's dtype, unit channel stride. Rows of
            this forward must not have been written to the ring yet.
        position_bias: [m, W] fp32 or kv's dtype; norm_weight: [Dh] float; both contiguous.
        positions, token_slot, token_prefix: [T] int64 contiguous (see `compressor_pool_ref`).
            A request's rows are consecutive in the batch and in position.
        req_to_token: [slots, max_ctx] int64, unit stride along max_ctx.
        ratio: m >= 1; overlap: CSA span 2m (True) or HCA span m; eps: RMSNorm epsilon.
        out, out_slots: optional [T, Dh] kv-dtype / [T] int64 buffers.
        counters: int32 [>= T], zero before the first launch (the kernel leaves them so): the
            rows' arrival counters when `_pool_meta` splits a row's channels over programs;
            allocated (zeroed) per call when omitted.
    Returns:
        `PooledEntries(out, out_slots)`, equal to `compressor_pool_ref` within a tolerance
        (slots exactly).
    """
    tokens, head_dim = check_compressor_args(
        kv,
        score,
        state_kv,
        state_score,
        position_bias,
        norm_weight,
        positions,
        token_slot,
        token_prefix,
        req_to_token,
        ratio,
        overlap,
    )
    if out is None:
        out = torch.empty((tokens, head_dim), dtype=kv.dtype, device=kv.device)
    if out_slots is None:
        out_slots = torch.empty((tokens,), dtype=torch.int64, device=kv.device)
    require(
        out.shape == (tokens, head_dim) and out.dtype == kv.dtype and out.stride(-1) == 1,
        f"out must be [{tokens}, {head_dim}] {kv.dtype} with unit channel "
        f"stride, got {out.dtype} {tuple(out.shape)}",
    )
    require(
        out_slots.shape == (tokens,)
        and out_slots.dtype == torch.int64
        and out_slots.is_contiguous(),
        f"out_slots must be contiguous int64 [{tokens}], got "
        f"{out_slots.dtype} {tuple(out_slots.shape)}",
    )
    if tokens == 0:
        return PooledEntries(out, out_slots)
    span = 2 * ratio if overlap else ratio
    meta = _pool_meta(head_dim, span)
    per_row = _channel_blocks(meta, head_dim)
    _compressor_pool_kernel[(tokens, per_row)](
        kv,
        score,
        state_kv,
        state_score,
        position_bias,
        norm_weight,
        positions,
        token_slot,
        token_prefix,
        req_to_token,
        out,
        out_slots,
        out,
        out,
        positions,
        arrival_counters(counters, tokens, per_row > 1, positions),
        head_dim,
        ratio,
        state_kv.shape[1],
        eps,
        kv.stride(0),
        score.stride(0),
        state_kv.stride(0),
        state_kv.stride(1),
        state_score.stride(0),
        state_score.stride(1),
        position_bias.stride(0),
        req_to_token.stride(0),
        out.stride(0),
        0,
        SPAN=span,
        OVERLAP=overlap,
        STORAGE=DTYPE_KIND[kv.dtype],
        **meta,
        FUSED=False,
        NOPE_HALF=0,
        BLOCK_W=1,
        ROW_LIST=False,
        RING_STORE=False,
        POOL=True,
        enable_fp_fusion=False,
        **programmatic_launch(_compressor_pool_kernel, kv.device),
    )
    return PooledEntries(out, out_slots)


def launch_fused(
    kv: torch.Tensor,
    score: torch.Tensor,
    state_kv: torch.Tensor,
    state_score: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    token_prefix: torch.Tensor,
    req_to_token: torch.Tensor,
    ratio: int,
    overlap: bool,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    entries: torch.Tensor,
    *,
    rows: torch.Tensor | None,
    ring_store: bool,
    pool: bool,
    counters: torch.Tensor | None,
) -> None:
    """One FUSED launch (arguments checked by `args.check_fused_args`) over every
    row, or over the rows listed in `rows` (int64 [n], contiguous): the ring store and/or the
    pooled entry. `counters`: int32 [>= entry slots] (see `compressor_decode`). Launched here,
    beside the kernel, so that a test that swaps the module's kernel (`gpu_targets_check.py`'s
    recorder) swaps this launch too."""
    programs = kv.shape[0] if rows is None else rows.shape[0]
    if programs == 0:
        return
    head_dim = norm_weight.shape[0]
    span = 2 * ratio if overlap else ratio
    meta = _pool_meta(head_dim, span)
    per_row = _channel_blocks(meta, head_dim) if pool else 1
    _compressor_pool_kernel[(programs, per_row)](
        kv,
        score,
        state_kv,
        state_score,
        position_bias,
        norm_weight,
        positions,
        token_slot,
        token_prefix,
        req_to_token,
        entries,
        positions,
        cos,
        sin,
        positions if rows is None else rows,
        arrival_counters(counters, entries.shape[0], per_row > 1, positions),
        head_dim,
        ratio,
        state_kv.shape[1],
        eps,
        kv.stride(0),
        score.stride(0),
        state_kv.stride(0),
        state_kv.stride(1),
        state_score.stride(0),
        state_score.stride(1),
        position_bias.stride(0),
        req_to_token.stride(0),
        entries.stride(0),
        cos.stride(0),
        SPAN=span,
        OVERLAP=overlap,
        STORAGE=DTYPE_KIND[kv.dtype],
        **meta,
        FUSED=True,
        NOPE_HALF=(head_dim - 2 * cos.shape[1]) // 2,
        BLOCK_W=triton.next_power_of_2(kv.shape[1]),
        ROW_LIST=rows is not None,
        RING_STORE=ring_store,
        POOL=pool,
        enable_fp_fusion=False,
        **programmatic_launch(_compressor_pool_kernel, kv.device),
    )
