"""Greedy argmax over vocab-parallel logits shards without gathering the logits
(`vocab_argmax_ref` is the spec; bit-exact).

Each tensor-parallel rank holds a shard ``[M, V_s]`` of the logits that starts at global column
``vocab_offset``. Stage 1 (``shard_argmax_pairs``) reduces the shard to one
``(value, global index)`` pair per row; the pairs of all ranks are gathered (8 bytes per rank per
row instead of ``4 * V``) and stage 2 (``combine_shard_argmax``) picks the winner. ``vocab_argmax``
runs both stages for shards that live in one process (one tensor or several).

Ordering rule, identical to ``torch.argmax`` on the concatenated row: NaN is larger than every
number, and among equal maxima (or among NaNs) the smallest global index wins. ``-0.0 == +0.0``
counts as a tie. A row of all ``-inf`` yields its first column.

Pairs layout: fp32 ``[M, 2]`` = (max value, global index as fp32). The index is exact because
the launchers require ``vocab_offset + V_s <= 2**24``. bf16 logits are widened to fp32 exactly.

Work split (why two launches): one program scanning a 32k-129k column row is a long serial chain
of loads, so each row is cut into column chunks scanned by separate programs (grid
``[M, chunks]``, up to four shards per launch), which write one pair per chunk; a tiny second
launch combines the chunk pairs with the same order-independent rule as stage 2. The chunk size
comes from the shapes only (``_chunk_meta``): about ``_TARGET_PROGRAMS`` programs per launch
and at least ``_MIN_CHUNK`` columns each. A row that fits in one chunk of one shard is written
directly by stage 1 (single launch). Results do not depend on the chunking: max/min and
index compares are exact.

The greedy token's logprob in the same launches (``vocab_greedy_logprobs``, one tensor): a
greedy step reports `log_softmax` at its argmax, which is ``-log(sum_j exp(x_j - max))``. Each
chunk program also sums ``exp(x - its max)`` over its columns (a second pass over the chunk it
just read), and the combine rescales the chunks' sums to the row's max; no [M, V] row of
log-softmax values is written and no separate softmax launch reads the logits again. Within
fp32 rounding of `log_softmax`: the ids' bits are `vocab_argmax`'s, the sum runs in another
order through Triton's ``exp`` / ``log``. The chunking does change the logprob's last bits
(not the ids): a caller that compares runs keeps the default chunking, which the shape fixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import FLOAT_DTYPES, require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers

# Largest vocab whose indices fp32 represents exactly.
_MAX_EXACT_INDEX = 1 << 24
# Index of an empty slot in the combine pass: above every real index, exact in fp32.
_NO_INDEX = float(1 << 25)
# ~8 resident programs per SM on a GPU of ~130 SMs: enough loads in flight to cover the memory
# latency.
_TARGET_PROGRAMS = 1024
# A chunk is one 2 KB (fp32) load at least; smaller chunks only add combine work.
_MIN_CHUNK = 512
_MAX_BLOCK = 4096
_SHARDS_PER_LAUNCH = 4
_MAX_FORCED_CHUNKS = 4096


@triton.jit
def _is_finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def _greedy_logprob(row_max, total):
    """log_softmax of a row at its argmax from the row's max and its sum of exp(x - max):
    (max - max) - log(sum), NaN for a row whose max is not finite (a NaN, +inf or only -inf),
    as `log_softmax` gives."""
    return tl.where(_is_finite(row_max), -tl.log(total), float("nan"))


@triton.jit
def _chunk_argmax_kernel(
    shard0,
    shard1,
    shard2,
    shard3,
    pairs_ptr,
    ids_ptr,
    width0,
    width1,
    width2,
    width3,
    stride0,
    stride1,
    stride2,
    stride3,
    offset0,
    offset1,
    offset2,
    offset3,
    chunk0,
    chunk1,
    chunk2,
    chunk3,
    first1,
    first2,
    first3,
    pairs_row_stride,
    pairs_first,
    sums_ptr,
    logprobs_ptr,
    NUM_SHARDS: tl.constexpr,
    BLOCK: tl.constexpr,
    WRITE_PAIRS: tl.constexpr,
    WRITE_IDS: tl.constexpr,
    LOGSUMEXP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, c): chunk c of this launch's shards -> one (value, global index) pair at
    ``pairs_ptr + row * pairs_row_stride + (pairs_first + c) * 2`` (and/or the id when the chunk
    is the whole row). Shards 1..3 own chunks from ``first1..3``; the selects are scalar.
    LOGSUMEXP (one shard): also the chunk's sum of exp(x - shift), shift its maximum where
    finite, else 0, at ``sums_ptr + row * pairs_row_stride / 2 + c`` (or, for a whole row, the
    logprob of its id: `_greedy_logprob`)."""
    wait_for_producers(PDL)  # the logits come from the previous kernel
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    base, width, stride, offset, chunk, local = shard0, width0, stride0, offset0, chunk0, c
    if NUM_SHARDS > 1:
        in1 = c >= first1
        base = tl.where(in1, shard1, base)
        width, stride = tl.where(in1, width1, width), tl.where(in1, stride1, stride)
        offset, chunk = tl.where(in1, offset1, offset), tl.where(in1, chunk1, chunk)
        local = tl.where(in1, c - first1, local)
    if NUM_SHARDS > 2:
        in2 = c >= first2
        base = tl.where(in2, shard2, base)
        width, stride = tl.where(in2, width2, width), tl.where(in2, stride2, stride)
        offset, chunk = tl.where(in2, offset2, offset), tl.where(in2, chunk2, chunk)
        local = tl.where(in2, c - first2, local)
    if NUM_SHARDS > 3:
        in3 = c >= first3
        base = tl.where(in3, shard3, base)
        width, stride = tl.where(in3, width3, width), tl.where(in3, stride3, stride)
        offset, chunk = tl.where(in3, offset3, offset), tl.where(in3, chunk3, chunk)
        local = tl.where(in3, c - first3, local)
    start = local * chunk
    end = tl.minimum(start + chunk, width)
    row_ptr = base + row * stride
    cols = tl.arange(0, BLOCK)
    # Per-lane winners, one cross-lane reduction at the end (not three per block): a lane sees
    # its columns in increasing order, so a strict '>' keeps its first maximum, and its first
    # NaN sticks (nothing is '>' NaN, and a NaN is taken only over a number). A lane that never
    # takes a column keeps -inf and the index `end`.
    lane_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_idx = tl.zeros((BLOCK,), tl.int32) + end
    for block_start in range(start, end, BLOCK):
        idx = block_start + cols
        x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        take = (x > lane_val) | ((x != x) & (lane_val == lane_val))
        lane_val = tl.where(take, x, lane_val)
        lane_idx = tl.where(take, idx, lane_idx)
    # The first NaN wins; else the smallest column holding the maximum (-0.0 == +0.0).
    lane_nan = lane_val != lane_val
    nan_idx = tl.min(tl.where(lane_nan, lane_idx, end), axis=0)
    finite_val = tl.where(lane_nan, float("-inf"), lane_val)
    best_val = tl.max(finite_val, axis=0)
    best_idx = tl.min(tl.where(finite_val == best_val, lane_idx, end), axis=0)
    has_nan = nan_idx < end
    best_idx = tl.where(has_nan, nan_idx, best_idx)
    best_val = tl.where(has_nan, float("nan"), best_val)
    # No lane took a column: the chunk is all -inf (its first column is the answer) or empty
    # (only when a caller forces more chunks than columns: -inf and an index past the shard's
    # real columns, so it never beats one).
    best_idx = tl.where(best_idx < end, best_idx, start)
    global_idx = best_idx.to(tl.int64) + offset
    if LOGSUMEXP:
        # A second pass over the chunk (one block at decode sizes: its loads hit the cache).
        shift = tl.where(_is_finite(best_val), best_val, 0.0)
        lane_sum = tl.zeros((BLOCK,), tl.float32)
        for block_start in range(start, end, BLOCK):
            idx = block_start + cols
            x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
            lane_sum += tl.exp(x - shift)
        chunk_sum = tl.sum(lane_sum, axis=0)
        if WRITE_IDS:
            tl.store(logprobs_ptr + row, _greedy_logprob(best_val, chunk_sum))
        else:
            tl.store(sums_ptr + row * (pairs_row_stride // 2) + pairs_first + c, chunk_sum)
    if WRITE_PAIRS:
        out = pairs_ptr + row * pairs_row_stride + (pairs_first + c) * 2
        tl.store(out, best_val)
        tl.store(out + 1, global_idx.to(tl.float32))
    if WRITE_IDS:
        tl.store(ids_ptr + row, global_idx)


@triton.jit
def _combine_pairs_kernel(
    pairs_ptr,
    ids_ptr,
    pairs_out_ptr,
    num_rows,
    num_parts,
    stride_part,
    stride_row,
    sums_ptr,
    logprobs_ptr,
    ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    WRITE_IDS: tl.constexpr,
    WRITE_PAIRS: tl.constexpr,
    LOGSUMEXP: tl.constexpr,
    NO_INDEX: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows [pid * ROWS, +ROWS): winner over ``num_parts`` (value, index) pairs per row, the pair
    (row, p) at ``pairs_ptr + p * stride_part + row * stride_row``. LOGSUMEXP: also the winner's
    logprob from the parts' sums (at ``sums_ptr + (p * stride_part + row * stride_row) / 2``),
    each rescaled from its part's shift to the row's: sum_p s_p * exp(shift_p - shift)."""
    wait_for_producers(PDL)  # the pairs are stage 1's (or the other ranks') output
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    parts = tl.arange(0, BLOCK_P)
    best_val = tl.full((ROWS,), float("-inf"), tl.float32)
    best_idx = tl.full((ROWS,), NO_INDEX, tl.float32)
    best_nan = tl.zeros((ROWS,), tl.int1)
    for p0 in range(0, num_parts, BLOCK_P):
        ok = row_ok[:, None] & (p0 + parts < num_parts)[None, :]
        base = pairs_ptr + (p0 + parts)[None, :].to(tl.int64) * stride_part
        base += rows[:, None].to(tl.int64) * stride_row
        val = tl.load(base, mask=ok, other=float("-inf"))
        idx = tl.load(base + 1, mask=ok, other=NO_INDEX)
        is_nan = val != val
        nan_idx = tl.min(tl.where(is_nan, idx, NO_INDEX), axis=1)
        has_nan = nan_idx < NO_INDEX
        finite = tl.where(is_nan, float("-inf"), val)
        block_max = tl.max(finite, axis=1)
        max_idx = tl.min(tl.where(finite == block_max[:, None], idx, NO_INDEX), axis=1)
        # Lexicographic max of (is_nan, value, -index): order-independent, so the winner does
        # not depend on the order of the parts (chunks, or ranks in a gathered tensor).
        cand_val = tl.where(has_nan, float("nan"), block_max)
        cand_idx = tl.where(has_nan, nan_idx, max_idx)
        earlier = cand_idx < best_idx
        better_nan = has_nan & ((best_nan == 0) | earlier)
        better_num = (
            (has_nan == 0)
            & (best_nan == 0)
            & ((block_max > best_val) | ((block_max == best_val) & earlier))
        )
        better = better_nan | better_num
        best_val = tl.where(better, cand_val, best_val)
        best_idx = tl.where(better, cand_idx, best_idx)
        best_nan = best_nan | has_nan
    if LOGSUMEXP:
        # Once the row's max is known, a second pass over the parts (cached at decode sizes).
        row_shift = tl.where(_is_finite(best_val), best_val, 0.0)
        total = tl.zeros((ROWS,), tl.float32)
        for p0 in range(0, num_parts, BLOCK_P):
            ok = row_ok[:, None] & (p0 + parts < num_parts)[None, :]
            at = (p0 + parts)[None, :].to(tl.int64) * stride_part
            at += rows[:, None].to(tl.int64) * stride_row
            val = tl.load(pairs_ptr + at, mask=ok, other=0.0)
            part_sum = tl.load(sums_ptr + at // 2, mask=ok, other=0.0)
            shift = tl.where(_is_finite(val), val, 0.0)
            # A part without mass (masked, or all -inf: shift 0) adds exactly 0, also where
            # exp(0 - row_shift) overflows; a non-finite row is NaN whatever it adds.
            scaled = part_sum * tl.exp(shift - row_shift[:, None])
            total += tl.sum(tl.where(ok & (part_sum != 0.0), scaled, 0.0), axis=1)
        tl.store(logprobs_ptr + rows, _greedy_logprob(best_val, total), mask=row_ok)
    if WRITE_IDS:
        tl.store(ids_ptr + rows, best_idx.to(tl.int64), mask=row_ok)
    if WRITE_PAIRS:
        tl.store(pairs_out_ptr + rows * 2, best_val, mask=row_ok)
        tl.store(pairs_out_ptr + rows * 2 + 1, best_idx, mask=row_ok)


class _ChunkPlan(NamedTuple):
    chunks: list[int]  # columns per chunk, per shard
    counts: list[int]  # chunks per row, per shard
    block: int  # columns per load
    num_warps: int


def _chunk_meta(total_width: int, num_rows: int) -> dict[str, int]:
    """Stage-1 launch meta-parameters from the shapes only (graph-safe): ``per_row`` chunks per
    row (~_TARGET_PROGRAMS programs, >= _MIN_CHUNK columns each), ``max_block`` columns per load
    at most, ``num_warps``. Max/min and index compares are exact, so the results never depend on
    them; `benchmark/kernels/sweep_launch.py` times alternatives against this default: about
    512 programs in all up to M = 32 (enough loads in flight), from M = 128 one 16-warp program
    per row (the rows alone fill the GPU)."""
    if num_rows >= 128:
        return {"per_row": 1, "max_block": _MAX_BLOCK, "num_warps": 16}
    per_row = max(
        1, min(triton.cdiv(total_width, _MIN_CHUNK), triton.cdiv(_TARGET_PROGRAMS // 2, num_rows))
    )
    return {"per_row": per_row, "max_block": _MAX_BLOCK, "num_warps": 4}


def _plan_chunks(widths: Sequence[int], rows: int, num_chunks: int | None) -> _ChunkPlan:
    """Chunking of every shard's rows (`_chunk_meta`); ``num_chunks`` forces that many chunks
    per row of every shard (tests)."""
    meta = _chunk_meta(sum(widths), rows)
    if num_chunks is not None:
        # The grid's axis 1 is capped at 65535.
        require(
            1 <= num_chunks <= _MAX_FORCED_CHUNKS,
            f"num_chunks must lie in [1, {_MAX_FORCED_CHUNKS}], got {num_chunks}",
        )
        chunks = [triton.cdiv(w, num_chunks) for w in widths]
        block = max(16, min(meta["max_block"], triton.next_power_of_2(max(chunks))))
        return _ChunkPlan(chunks, [num_chunks] * len(widths), block, meta["num_warps"])
    chunk = triton.cdiv(sum(widths), meta["per_row"])
    block = max(16, min(meta["max_block"], triton.next_power_of_2(chunk)))
    chunk = triton.cdiv(chunk, block) * block
    return _ChunkPlan(
        [chunk] * len(widths), [triton.cdiv(w, chunk) for w in widths], block, meta["num_warps"]
    )


def _launch_chunks(
    shards: Sequence[torch.Tensor],
    offsets: Sequence[int],
    plan: _ChunkPlan,
    pairs: torch.Tensor,
    ids: torch.Tensor,
    write_ids: bool,
    lse: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Stage-1 launches: consecutive shards of one dtype, up to four per launch, fill
    ``pairs`` [M, sum(counts), 2] in shard order (or write ``ids`` when there is one chunk).
    ``lse`` (one shard): (sums [M, sum(counts)], logprobs [M]), the chunks' sums of exp, or the
    ids' logprobs when there is one chunk."""
    sums, logprobs = lse if lse is not None else (pairs, pairs)  # never touched without lse
    num_rows = shards[0].shape[0]
    row_stride = 2 * sum(plan.counts)
    first = 0
    i = 0
    while i < len(shards):
        group = [i]
        while (
            len(group) < _SHARDS_PER_LAUNCH
            and group[-1] + 1 < len(shards)
            and shards[group[-1] + 1].dtype == shards[i].dtype
        ):
            group.append(group[-1] + 1)
        pad = group + [group[0]] * (_SHARDS_PER_LAUNCH - len(group))  # unused slots: never read
        starts, total = [], 0
        for j in group:
            starts.append(total)
            total += plan.counts[j]
        starts += [total] * (_SHARDS_PER_LAUNCH - len(group))
        _chunk_argmax_kernel[(num_rows, total)](
            *(shards[j] for j in pad),
            pairs,
            ids,
            *(shards[j].shape[1] for j in pad),
            *(shards[j].stride(0) for j in pad),
            *(offsets[j] for j in pad),
            *(plan.chunks[j] for j in pad),
            starts[1],
            starts[2],
            starts[3],
            row_stride,
            first,
            sums,
            logprobs,
            NUM_SHARDS=len(group),
            BLOCK=plan.block,
            WRITE_PAIRS=not write_ids,
            WRITE_IDS=write_ids,
            LOGSUMEXP=lse is not None,
            num_warps=plan.num_warps,
            **programmatic_launch(_chunk_argmax_kernel, pairs.device),
        )
        first += total
        i = group[-1] + 1


def _launch_combine(
    pairs: torch.Tensor,
    num_rows: int,
    num_parts: int,
    stride_part: int,
    stride_row: int,
    ids: torch.Tensor | None,
    pairs_out: torch.Tensor | None,
    lse: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The combine launch; ``lse``: (the parts' sums laid out as the pairs' values, logprobs
    [M] to write)."""
    block_p = min(256, triton.next_power_of_2(num_parts))
    rows = max(1, min(64, 1024 // block_p))
    sums, logprobs = lse if lse is not None else (pairs, pairs)  # never touched without lse
    _combine_pairs_kernel[(triton.cdiv(num_rows, rows),)](
        pairs,
        ids if ids is not None else pairs,
        pairs_out if pairs_out is not None else pairs,
        num_rows,
        num_parts,
        stride_part,
        stride_row,
        sums,
        logprobs,
        ROWS=rows,
        BLOCK_P=block_p,
        WRITE_IDS=ids is not None,
        WRITE_PAIRS=pairs_out is not None,
        LOGSUMEXP=lse is not None,
        NO_INDEX=_NO_INDEX,
        **programmatic_launch(_combine_pairs_kernel, pairs.device),
    )


def _check_shard(logits: torch.Tensor, vocab_offset: int, name: str) -> None:
    require(logits.dim() == 2, f"{name} must be 2-D [M, V_s], got shape {tuple(logits.shape)}")
    require(
        logits.dtype in FLOAT_DTYPES, f"{name} dtype must be fp32/bf16/fp16, got {logits.dtype}"
    )
    require(
        logits.shape[1] <= 0 or logits.stride(1) == 1,
        f"{name} must be contiguous in the vocab dim, got strides {logits.stride()}",
    )
    require(
        vocab_offset >= 0 and vocab_offset + logits.shape[1] <= _MAX_EXACT_INDEX,
        f"{name}: vocab_offset {vocab_offset} + width {logits.shape[1]} must lie in [0, 2**24]",
    )


def shard_argmax_pairs(
    logits: torch.Tensor,
    vocab_offset: int,
    out: torch.Tensor | None = None,
    *,
    num_chunks: int | None = None,
) -> torch.Tensor:
    """Stage 1: reduce one vocab shard to per-row (max value, global index) pairs.

    Args:
        logits: [M, V_s] fp32/bf16/fp16, unit stride along the vocab dim (the row stride may be
            larger, e.g. a ``[:, :valid_width]`` slice of a padded shard). V_s >= 1.
        vocab_offset: global vocab index of column 0 of this shard.
        out: optional fp32 [M, 2] contiguous buffer.
        num_chunks: force this many column chunks per row (tests); default from the shape.
    Returns:
        fp32 [M, 2]: column 0 the row maximum (NaN if the row holds a NaN), column 1 the global
        index of its first occurrence, stored as fp32 (exact below 2**24).
    """
    _check_shard(logits, vocab_offset, "logits")
    num_rows, width = logits.shape
    require(width != 0, "logits: shard width V_s must be >= 1")
    if out is None:
        out = torch.empty((num_rows, 2), dtype=torch.float32, device=logits.device)
    require(
        out.shape == (num_rows, 2) and out.dtype == torch.float32 and out.is_contiguous(),
        f"out must be contiguous fp32 [{num_rows}, 2], got {out.dtype} {tuple(out.shape)}",
    )
    if num_rows == 0:
        return out
    plan = _plan_chunks([width], num_rows, num_chunks)
    if plan.counts[0] == 1:
        _launch_chunks([logits], [vocab_offset], plan, out, out, write_ids=False)
        return out
    scratch = torch.empty((num_rows, plan.counts[0], 2), dtype=torch.float32, device=out.device)
    _launch_chunks([logits], [vocab_offset], plan, scratch, scratch, write_ids=False)
    _launch_combine(scratch, num_rows, plan.counts[0], 2, 2 * plan.counts[0], None, out)
    return out


def combine_shard_argmax(pairs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 2: pick the global argmax from the gathered per-shard pairs.

    Args:
        pairs: fp32 [S, M, 2] contiguous (the stage-1 outputs of S shards, any shard order).
        out: optional int64 [M] buffer.
    Returns:
        int64 [M] global argmax ids (NaN wins, ties -> smallest global index).
    """
    require(
        pairs.dim() == 3 and pairs.shape[2] == 2 and (pairs.dtype == torch.float32),
        f"pairs must be fp32 [S, M, 2], got {pairs.dtype} {tuple(pairs.shape)}",
    )
    require(pairs.is_contiguous(), "pairs must be contiguous")
    num_shards, num_rows, _ = pairs.shape
    require(num_shards != 0, "pairs: need at least one shard")
    if out is None:
        out = torch.empty((num_rows,), dtype=torch.int64, device=pairs.device)
    require(
        out.shape == (num_rows,) and out.dtype == torch.int64 and out.is_contiguous(),
        f"out must be contiguous int64 [{num_rows}], got {out.dtype} {tuple(out.shape)}",
    )
    if num_rows == 0:
        return out
    _launch_combine(pairs, num_rows, num_shards, 2 * num_rows, 2, out, None)
    return out


def vocab_argmax(
    shards: torch.Tensor | Sequence[torch.Tensor],
    vocab_offsets: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
    *,
    num_chunks: int | None = None,
) -> torch.Tensor:
    """Greedy token ids over one logits tensor or over vocab shards held in this process.

    Args:
        shards: one tensor [M, V] or a sequence of shard tensors [M, V_s] (widths may differ),
            each fp32/bf16/fp16 with unit vocab stride, all on one device.
        vocab_offsets: global column of each shard's column 0; default: the shards in column
            order (cumulative widths). Shards must not overlap (not checked).
        out: optional int64 [M] buffer.
        num_chunks: force this many column chunks per row of every shard (tests); default from
            the shapes.
    Returns:
        int64 [M], equal to ``torch.argmax(torch.cat(shards, -1), -1)`` including NaN rows/ties.
    """
    if isinstance(shards, torch.Tensor):
        shards = [shards]
    require(len(shards) != 0, "shards: need at least one tensor")
    if vocab_offsets is None:
        vocab_offsets, start = [], 0
        for shard in shards:
            vocab_offsets.append(start)
            start += shard.shape[-1]
    require(
        len(vocab_offsets) == len(shards),
        f"vocab_offsets has {len(vocab_offsets)} entries for {len(shards)} shards",
    )
    num_rows = shards[0].shape[0]
    for i, (shard, offset) in enumerate(zip(shards, vocab_offsets)):
        _check_shard(shard, offset, f"shards[{i}]")
        require(
            shard.shape[0] == num_rows and shard.device == shards[0].device,
            f"shards[{i}] has {shard.shape[0]} rows on {shard.device}, expected "
            f"{num_rows} on {shards[0].device}",
        )
        require(shard.shape[1] != 0, f"shards[{i}] has zero width")
    device = shards[0].device
    if out is None:
        out = torch.empty((num_rows,), dtype=torch.int64, device=device)
    require(
        out.shape == (num_rows,) and out.dtype == torch.int64 and out.is_contiguous(),
        f"out must be contiguous int64 [{num_rows}], got {out.dtype} {tuple(out.shape)}",
    )
    if num_rows == 0:
        return out
    plan = _plan_chunks([s.shape[1] for s in shards], num_rows, num_chunks)
    parts = sum(plan.counts)
    if parts == 1:  # one shard, one chunk: stage 1 writes the ids, no combine launch
        _launch_chunks(shards, vocab_offsets, plan, out, out, write_ids=True)
        return out
    scratch = torch.empty((num_rows, parts, 2), dtype=torch.float32, device=device)
    _launch_chunks(shards, vocab_offsets, plan, scratch, scratch, write_ids=False)
    _launch_combine(scratch, num_rows, parts, 2, 2 * parts, out, None)
    return out


def vocab_greedy_logprobs(
    logits: torch.Tensor, *, num_chunks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ids and their logprobs of logits [M, V] (`greedy_logprobs_ref` is the spec), in
    the launches of `vocab_argmax`: each chunk program also sums exp(x - its max) over its
    columns, and the combine rescales the chunks' sums to the row's max (the split that
    `srt/layers/vocab_parallel.py::shard_greedy` applies across ranks). No row of log-softmax
    values is written.

    Args:
        logits: [M, V] fp32/bf16/fp16, unit stride along the vocabulary, V >= 1.
        num_chunks: force this many column chunks per row (tests); default from the shape.
    Returns:
        (ids int64 [M], equal to `torch.argmax` including NaN rows and ties; logprobs fp32 [M],
        `log_softmax(logits)` at the ids within fp32 rounding (another order of the sum of
        exponentials, and Triton's `exp` / `log`), NaN for a row whose max is not finite (a
        NaN, +inf or only -inf), as `log_softmax` gives).
    """
    _check_shard(logits, 0, "logits")
    num_rows, width = logits.shape
    require(width != 0, "logits: vocabulary width V must be >= 1")
    ids = torch.empty((num_rows,), dtype=torch.int64, device=logits.device)
    logprobs = torch.empty((num_rows,), dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return ids, logprobs
    plan = _plan_chunks([width], num_rows, num_chunks)
    parts = plan.counts[0]
    if parts == 1:
        _launch_chunks([logits], [0], plan, ids, ids, True, lse=(ids, logprobs))
        return ids, logprobs
    scratch = torch.empty((num_rows, parts, 2), dtype=torch.float32, device=logits.device)
    sums = torch.empty((num_rows, parts), dtype=torch.float32, device=logits.device)
    _launch_chunks([logits], [0], plan, scratch, scratch, False, lse=(sums, logprobs))
    _launch_combine(scratch, num_rows, parts, 2, 2 * parts, ids, None, lse=(sums, logprobs))
    return ids, logprobs
