"""K14: greedy argmax over vocab-parallel logits shards without gathering the logits.

Each tensor-parallel rank holds a shard ``[M, V_s]`` of the logits that starts at global column
``vocab_offset``. Stage 1 (``shard_argmax_pairs``) reduces the shard to one ``(value, global index)``
pair per row; the pairs of all ranks are gathered (8 bytes per rank per row instead of ``4 * V``)
and stage 2 (``combine_shard_argmax``) picks the winner. ``vocab_argmax`` runs both stages for
shards that live in one process, and a single stage-1 launch that writes ids for one tensor.

Ordering rule, identical to ``torch.argmax`` on the concatenated row: NaN is larger than every
number, and among equal maxima (or among NaNs) the smallest global index wins. ``-0.0 == +0.0``
counts as a tie. A row of all ``-inf`` yields its first column.

Pairs layout: fp32 ``[M, 2]`` = (max value, global index as fp32). The index is exact because
the launchers require ``vocab_offset + V_s <= 2**24``. bf16 logits are widened to fp32 exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# Largest vocab whose indices fp32 represents exactly.
_MAX_EXACT_INDEX = 1 << 24
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def vocab_argmax_ref(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Reference: ``torch.argmax`` over the shards concatenated in column order -> int64 [M]."""
    return torch.argmax(torch.cat([s.float() for s in shards], dim=-1), dim=-1)


@triton.jit
def _shard_argmax_kernel(
    logits_ptr,
    pairs_ptr,
    ids_ptr,
    width,
    row_stride,
    vocab_offset,
    BLOCK: tl.constexpr,
    WRITE_PAIRS: tl.constexpr,
    WRITE_IDS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    cols = tl.arange(0, BLOCK)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    found_nan = tl.full((), 0, tl.int32)
    for start in range(0, width, BLOCK):
        idx = start + cols
        in_row = idx < width
        x = tl.load(row_ptr + idx, mask=in_row, other=float("-inf")).to(tl.float32)
        is_nan = (x != x) & in_row
        # First NaN of the block (NaN beats everything, earlier blocks have smaller indices).
        nan_idx = tl.min(tl.where(is_nan, idx, width), axis=0)
        block_has_nan = nan_idx < width
        finite_x = tl.where(is_nan, float("-inf"), x)
        block_max = tl.max(finite_x, axis=0)
        # Smallest column holding the block maximum (left tie-break; -0.0 == +0.0).
        max_idx = tl.min(tl.where((finite_x == block_max) & in_row, idx, width), axis=0)
        # Strict '>' across blocks keeps the earlier (smaller) index on ties.
        take_max = (found_nan == 0) & (block_max > best_val)
        best_idx = tl.where(take_max, max_idx, best_idx)
        best_val = tl.where(take_max, block_max, best_val)
        take_nan = (found_nan == 0) & block_has_nan
        best_idx = tl.where(take_nan, nan_idx, best_idx)
        best_val = tl.where(take_nan, float("nan"), best_val)
        found_nan = tl.where(take_nan, 1, found_nan)
    global_idx = best_idx.to(tl.int64) + vocab_offset
    if WRITE_PAIRS:
        tl.store(pairs_ptr + row * 2, best_val)
        tl.store(pairs_ptr + row * 2 + 1, global_idx.to(tl.float32))
    if WRITE_IDS:
        tl.store(ids_ptr + row, global_idx)


@triton.jit
def _combine_pairs_kernel(
    pairs_ptr,
    ids_ptr,
    num_rows,
    num_shards,
    BLOCK_ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_range = rows < num_rows
    best_val = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    # Larger than any valid index (< 2**24) yet finite, so masked rows cast cleanly to int64.
    best_idx = tl.full((BLOCK_ROWS,), 33554432.0, tl.float32)
    best_nan = tl.zeros((BLOCK_ROWS,), tl.int32)
    for shard in range(0, num_shards):
        base = pairs_ptr + (shard * num_rows + rows) * 2
        val = tl.load(base, mask=in_range, other=float("-inf"))
        idx = tl.load(base + 1, mask=in_range, other=33554432.0)
        is_nan = val != val
        # Lexicographic max of (is_nan, value, -index): order-independent, so the winner does
        # not depend on the order in which the ranks' pairs were gathered.
        earlier = idx < best_idx
        no_best_nan = best_nan == 0
        better_nan = is_nan & (no_best_nan | earlier)
        better_num = (val == val) & no_best_nan & ((val > best_val) | ((val == best_val) & earlier))
        better = better_nan | better_num
        best_val = tl.where(better, val, best_val)
        best_idx = tl.where(better, idx, best_idx)
        best_nan = tl.where(is_nan, 1, best_nan)
    tl.store(ids_ptr + rows, best_idx.to(tl.int64), mask=in_range)


def _check_shard(logits: torch.Tensor, vocab_offset: int, name: str) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, V_s], got shape {tuple(logits.shape)}")
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be fp32/bf16/fp16, got {logits.dtype}")
    if logits.shape[1] > 0 and logits.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in the vocab dim, got strides {logits.stride()}")
    if vocab_offset < 0 or vocab_offset + logits.shape[1] > _MAX_EXACT_INDEX:
        raise ValueError(
            f"{name}: vocab_offset {vocab_offset} + width {logits.shape[1]} must lie in [0, 2**24]"
        )


def _block_for(width: int) -> int:
    return max(16, min(4096, triton.next_power_of_2(max(width, 1))))


def shard_argmax_pairs(
    logits: torch.Tensor, vocab_offset: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Stage 1: reduce one vocab shard to per-row (max value, global index) pairs.

    Args:
        logits: [M, V_s] fp32/bf16/fp16, unit stride along the vocab dim (the row stride may be
            larger, e.g. a ``[:, :valid_width]`` slice of a padded shard). V_s >= 1.
        vocab_offset: global vocab index of column 0 of this shard.
        out: optional fp32 [M, 2] contiguous buffer.
    Returns:
        fp32 [M, 2]: column 0 the row maximum (NaN if the row holds a NaN), column 1 the global
        index of its first occurrence, stored as fp32 (exact below 2**24).
    """
    _check_shard(logits, vocab_offset, "logits")
    num_rows, width = logits.shape
    if width == 0:
        raise ValueError("logits: shard width V_s must be >= 1")
    if out is None:
        out = torch.empty((num_rows, 2), dtype=torch.float32, device=logits.device)
    assert out.shape == (num_rows, 2) and out.dtype == torch.float32 and out.is_contiguous(), (
        f"out must be contiguous fp32 [{num_rows}, 2], got {out.dtype} {tuple(out.shape)}"
    )
    if num_rows == 0:
        return out
    _shard_argmax_kernel[(num_rows,)](
        logits, out, out, width, logits.stride(0), vocab_offset,
        BLOCK=_block_for(width), WRITE_PAIRS=True, WRITE_IDS=False,
    )
    return out


def combine_shard_argmax(pairs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 2: pick the global argmax from the gathered per-shard pairs.

    Args:
        pairs: fp32 [S, M, 2] contiguous (the stage-1 outputs of S shards, any shard order).
        out: optional int64 [M] buffer.
    Returns:
        int64 [M] global argmax ids (NaN wins, ties -> smallest global index).
    """
    if pairs.dim() != 3 or pairs.shape[2] != 2 or pairs.dtype != torch.float32:
        raise ValueError(f"pairs must be fp32 [S, M, 2], got {pairs.dtype} {tuple(pairs.shape)}")
    if not pairs.is_contiguous():
        raise ValueError("pairs must be contiguous")
    num_shards, num_rows, _ = pairs.shape
    if num_shards == 0:
        raise ValueError("pairs: need at least one shard")
    if out is None:
        out = torch.empty((num_rows,), dtype=torch.int64, device=pairs.device)
    assert out.shape == (num_rows,) and out.dtype == torch.int64 and out.is_contiguous(), (
        f"out must be contiguous int64 [{num_rows}], got {out.dtype} {tuple(out.shape)}"
    )
    if num_rows == 0:
        return out
    block_rows = 128
    _combine_pairs_kernel[(triton.cdiv(num_rows, block_rows),)](
        pairs, out, num_rows, num_shards, BLOCK_ROWS=block_rows
    )
    return out


def vocab_argmax(
    shards: torch.Tensor | Sequence[torch.Tensor],
    vocab_offsets: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy token ids over one logits tensor or over vocab shards held in this process.

    Args:
        shards: one tensor [M, V] or a sequence of shard tensors [M, V_s] (widths may differ),
            each fp32/bf16/fp16 with unit vocab stride, all on one device.
        vocab_offsets: global column of each shard's column 0; default: the shards in column
            order (cumulative widths). Shards must not overlap (not checked).
        out: optional int64 [M] buffer.
    Returns:
        int64 [M], equal to ``torch.argmax(torch.cat(shards, -1), -1)`` including NaN rows/ties.
    """
    if isinstance(shards, torch.Tensor):
        shards = [shards]
    if len(shards) == 0:
        raise ValueError("shards: need at least one tensor")
    if vocab_offsets is None:
        vocab_offsets, start = [], 0
        for shard in shards:
            vocab_offsets.append(start)
            start += shard.shape[-1]
    if len(vocab_offsets) != len(shards):
        raise ValueError(f"vocab_offsets has {len(vocab_offsets)} entries for {len(shards)} shards")
    num_rows = shards[0].shape[0]
    for i, (shard, offset) in enumerate(zip(shards, vocab_offsets)):
        _check_shard(shard, offset, f"shards[{i}]")
        if shard.shape[0] != num_rows or shard.device != shards[0].device:
            raise ValueError(f"shards[{i}] has {shard.shape[0]} rows on {shard.device}, expected "
                             f"{num_rows} on {shards[0].device}")
        if shard.shape[1] == 0:
            raise ValueError(f"shards[{i}] has zero width")
    device = shards[0].device
    if out is None:
        out = torch.empty((num_rows,), dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    if len(shards) == 1:
        logits = shards[0]
        # One launch writes the ids directly; no pairs round trip.
        _shard_argmax_kernel[(num_rows,)](
            logits, out, out, logits.shape[1], logits.stride(0), vocab_offsets[0],
            BLOCK=_block_for(logits.shape[1]), WRITE_PAIRS=False, WRITE_IDS=True,
        )
        return out
    pairs = torch.empty((len(shards), num_rows, 2), dtype=torch.float32, device=device)
    for i, (shard, offset) in enumerate(zip(shards, vocab_offsets)):
        shard_argmax_pairs(shard, offset, out=pairs[i])
    return combine_shard_argmax(pairs, out=out)
