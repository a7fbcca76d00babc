"""Block compression of the CSA/HCA compressors in torch: the reference of the compressor kernels
(`pool.py`, `decode.py`, `extend.py`), and the addressing of the compressed entries in the KV
pool (`entry_pool_rows_ref`).

Every token row t (position p) is a candidate block end. When p ends a block of m positions, the
entry of that block is pooled from the span of rows before it: m rows for HCA, 2m for CSA
("overlap": slots 0..m-1 take the previous block's first-half channels Ca, slots m..2m-1 this
block's second-half channels Cb; the previous half of block 0 is absent). A span row at position
q comes from this forward (`q >= token_prefix[t]`: flat row t - (p - q)) or from the request's
state ring (`state[token_slot[t], q mod R]`). Per channel:
    z  = kv_dtype(score_row + kv_dtype(position_bias[q mod m]))
    a  = kv_dtype(softmax over the span of z, in fp32)
    e  = kv_dtype(sum over the span of kv_dtype(kv_row * a))    (sum accumulated in fp32)
    out = kv_dtype(norm_weight * (e * rsqrt(mean(e^2) + eps)))   (RMSNorm in fp32)
The entry slot is `req_to_token[token_slot[t], p - m + 1] // m`. Rows that do not end a block
get zeros and slot 0 (the reserved dummy entry). The decode and prefill steps then rotate the
entry at its block start (`rope_tail_ref`) and store it, and record the rows in the state ring.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_dspark.kernels.norm.reference import rms_norm_ref
from sgl_dspark.kernels.rope.reference import rope_tail_ref


def entry_pool_rows_ref(
    ids: torch.Tensor, req_to_token: torch.Tensor, token_slot: torch.Tensor, ratio: int
) -> torch.Tensor:
    """int64 ``[T, N]`` pool rows of compressed entries ``ids`` ``[T, N]`` (or ``[1, N]``,
    broadcast) of each row's request (``token_slot`` ``[T]``: its row of ``req_to_token``).

    Entry n of a request covers positions [n·m, (n + 1)·m) and lives at pool row
    ``req_to_token[request, n·m] // m`` (pages are multiples of m, so a block start's token slot
    is a multiple of m). The column is clamped to the table's last one, so entries past the
    table stay in bounds; their rows are garbage that the callers mask.
    """
    cols = (ids * ratio).clamp(max=req_to_token.shape[1] - 1)
    return req_to_token[token_slot[:, None], cols].long() // ratio


def picked_entry_rows_ref(
    values: torch.Tensor,
    indices: torch.Tensor,
    req_to_token: torch.Tensor,
    token_slot: torch.Tensor,
    ratio: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k selection of compressed entries ``[T, k]`` (scores ``values``, entry ids
    ``indices``) -> (their pool rows int64 ``[T, k]``, 0 where dropped; valid ``[T, k]``): a pick
    scored -inf is dropped."""
    valid = values > float("-inf")
    rows = entry_pool_rows_ref(indices, req_to_token, token_slot, ratio)
    return torch.where(valid, rows, torch.zeros_like(rows)), valid


def topk_lower_index_first(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest entries of each row of `x` (values, indices), equal values in index order.

    `torch.topk` leaves the order of ties to the implementation, and it differs with the row
    width: a prefill row would then pick other entries than the same row decoded alone (the rows
    of a longer batch carry more -inf columns). The FP4-quantised index scores tie often, so
    the selection is a stable sort, whose ties go to the lower index whatever the width."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def topk_entry_rows_ref(
    scores: torch.Tensor,
    k: int,
    req_to_token: torch.Tensor,
    token_slot: torch.Tensor,
    ratio: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4.1's top-k selection of compressed entries: the `k` best scores of every row
    of `scores` `[T, N]` in descending order, ties to the lower entry
    (`topk_lower_index_first`), as (pool rows int64 `[T, k]`, 0 where dropped; valid `[T, k]`):
    a pick scored -inf is dropped (`picked_entry_rows_ref`)."""
    values, indices = topk_lower_index_first(scores, k)
    return picked_entry_rows_ref(values, indices, req_to_token, token_slot, ratio)


class PairGroups(NamedTuple):
    pooled: torch.Tensor  # [T, Dh] kv's dtype, before the norm
    start_positions: torch.Tensor  # [T] int64 first position of the group (-1 on row 0's)
    entry_rows: torch.Tensor  # [T] int64 pool row; 0 (the dummy row) on rows that close none


def csa2_pair_groups_ref(
    kv: torch.Tensor,
    score: torch.Tensor,
    ring_kv: torch.Tensor,
    ring_score: torch.Tensor,
    ends: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    token_prefix: torch.Tensor,
    req_to_token: torch.Tensor,
) -> PairGroups:
    """DeepSeek-V4.1's ratio-2 groups ending at rows `ends` `[n]` (flat row indices, each at a
    position p): the group {p - 1, p} pools, per channel, the two kv rows weighted by the
    softmax of their two gate scores (fp32), rounded to kv's dtype. The partner row p - 1 is
    the previous row of this forward when it belongs to it (`p - 1 >= token_prefix`), else the
    request's ring row `(p - 1) mod R`. Pool row: `req_to_token[slot, p - 1] // 2` (whether p
    closes a group is the caller's to mask). Reads only.

    Args:
        kv, score: [T, Dh] this forward's projections (wkv, wgate).
        ring_kv, ring_score: [slots, R, Dh] fp32 pending-pair rings.
        positions, token_slot, token_prefix: [T] int position, request slot, and first
            position of this forward's rows of the row's request.
        req_to_token: [slots, max_ctx] int page table.
    """
    m = 2
    end_pos = positions[ends]
    slot = token_slot[ends]
    partner_pos = end_pos - 1
    fresh = partner_pos >= token_prefix[ends]
    ring_idx = partner_pos.clamp(min=0).remainder(ring_kv.shape[1])
    prev = (ends - 1).clamp(min=0)
    kv_prev = torch.where(fresh[:, None], kv[prev].float(), ring_kv[slot, ring_idx])
    sc_prev = torch.where(fresh[:, None], score[prev].float(), ring_score[slot, ring_idx])
    kv_pair = torch.stack((kv_prev, kv[ends].float()), dim=1)  # [n, 2, Dh]
    sc_pair = torch.stack((sc_prev, score[ends].float()), dim=1)
    pooled = (torch.softmax(sc_pair, dim=1) * kv_pair).sum(dim=1).to(kv.dtype)
    start = end_pos - (m - 1)
    entry_rows = req_to_token[slot, start.clamp(min=0)].long() // m
    return PairGroups(pooled, start.long(), entry_rows)


def csa2_pair_pool_ref(
    kv: torch.Tensor,
    score: torch.Tensor,
    ring_kv: torch.Tensor,
    ring_score: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    token_prefix: torch.Tensor,
    req_to_token: torch.Tensor,
) -> PairGroups:
    """The ratio-2 compressor at decode / verify, in place on the pending-pair ring: every row
    is a candidate group end (`csa2_pair_groups_ref`; rows whose position p does not close a
    group, p even, get the dummy pool row 0); then every row's raw kv / score (fp32) goes to
    its ring row `p mod R` (after all reads; the ring outlasts a verify's rows, so no row read
    is written). Arguments as `csa2_pair_groups_ref`."""
    rows = torch.arange(positions.shape[0], device=positions.device)
    groups = csa2_pair_groups_ref(
        kv, score, ring_kv, ring_score, rows, positions, token_slot, token_prefix, req_to_token
    )
    closes = (positions + 1) % 2 == 0
    entry_rows = torch.where(closes, groups.entry_rows, torch.zeros_like(groups.entry_rows))
    ring_row = positions.remainder(ring_kv.shape[1])
    ring_kv[token_slot, ring_row] = kv.float()
    ring_score[token_slot, ring_row] = score.float()
    return groups._replace(entry_rows=entry_rows)


class PooledEntries(NamedTuple):
    entries: torch.Tensor  # [T, Dh] kv dtype, un-rotated; zeros on rows that end no block
    slots: torch.Tensor  # [T] int64 entry slot; 0 (the dummy entry) on rows that end no block


def compressor_pool_ref(
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
) -> PooledEntries:
    """The entry of every block a row of this forward ends (the module doc's pooling).

    Args:
        kv, score: [T, W] this forward's projected rows (W = 2*Dh with overlap, else Dh).
        state_kv, state_score: [req_slots, R, W] the state rings (rows of earlier forwards).
        position_bias: [m, W]; norm_weight: [Dh] (kv_norm's weight).
        positions, token_slot: [T] int position and request slot of each row.
        token_prefix: [T] int first position of this forward's rows of the row's request.
        req_to_token: [slots, max_ctx] int page table.
        ratio: m; overlap: CSA (True) or HCA (False); eps: RMSNorm epsilon.
    Returns:
        `PooledEntries` (entries [T, Dh] in kv's dtype, slots [T] int64).
    """
    m, ring = ratio, state_kv.shape[1]
    d = norm_weight.shape[0]
    pos = positions
    rows = torch.arange(pos.shape[0], device=pos.device)
    span = 2 * m if overlap else m
    rel = torch.arange(span, device=pos.device) - (span - 1)
    q = pos[:, None] + rel[None, :]  # absolute row positions
    fresh = (q >= token_prefix[:, None]).unsqueeze(-1)
    flat = (rows[:, None] + rel[None, :]).clamp(min=0)
    slot = token_slot[:, None]
    ring_idx = q.remainder(ring)
    kv_rows = torch.where(fresh, kv[flat], state_kv[slot, ring_idx])
    sc_rows = torch.where(fresh, score[flat], state_score[slot, ring_idx])
    sc_rows = sc_rows + position_bias[q.remainder(m)].to(sc_rows.dtype)
    if overlap:
        kv_rows = torch.cat((kv_rows[:, :m, :d], kv_rows[:, m:, d:]), dim=1)
        sc_rows = torch.cat((sc_rows[:, :m, :d], sc_rows[:, m:, d:]), dim=1)
        absent = (q < 0).unsqueeze(-1)  # block 0 has no previous block
        kv_rows = kv_rows.masked_fill(absent, 0.0)
        sc_rows = sc_rows.masked_fill(absent, float("-inf"))
    weights = torch.softmax(sc_rows, dim=1, dtype=torch.float32).to(kv_rows.dtype)
    pooled = (kv_rows * weights).sum(dim=1)
    entries = rms_norm_ref(pooled, norm_weight, eps)
    start = pos - (m - 1)
    slots = req_to_token[token_slot, start.clamp(min=0)] // m
    is_end = (pos + 1) % m == 0
    return PooledEntries(
        torch.where(is_end[:, None], entries, torch.zeros_like(entries)),
        torch.where(is_end, slots, torch.zeros_like(slots)),
    )


def compressor_decode_ref(
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
) -> None:
    """The whole decode/verify step of a compressor, in place: the entries of the
    blocks these rows end (`compressor_pool_ref`, then rope at the block start with the given
    cos/sin rows `[T, rd/2]`) are written into the entry pool `entries` `[slots, Dh]`; then every
    row's raw kv/score goes to its state ring row `pos mod R`."""
    pooled, slots = compressor_pool_ref(
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
        eps,
    )
    rotated = rope_tail_ref(pooled.unsqueeze(1), cos, sin).squeeze(1)
    ends = (positions + 1) % ratio == 0
    entries[slots[ends]] = rotated[ends].to(entries.dtype)
    ring_row = positions.remainder(state_kv.shape[1])
    state_kv[token_slot, ring_row] = kv.to(state_kv.dtype)
    state_score[token_slot, ring_row] = score.to(state_score.dtype)


def compressor_extend_ref(
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
    block_end_rows: torch.Tensor,
    ring_rows: torch.Tensor,
) -> None:
    """The prefill step of a compressor, in place: the entries of `block_end_rows`
    (`compressor_pool_ref`, then rope at the block start with cos / sin rows `[T, rd/2]`) go into
    the entry pool `entries`; then the raw kv/score of `ring_rows` go to their state ring rows
    `pos mod R`. Arguments as `compressor_decode_ref`; the row lists are int64 `[n]` flat row
    indices (no two ring rows of one request may share a ring row), where -1 entries (a list padded
    to a static size, as a prefill graph's) are skipped."""
    pooled, slots = compressor_pool_ref(
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
        eps,
    )
    ends = block_end_rows[block_end_rows >= 0]
    ring_rows = ring_rows[ring_rows >= 0]
    rotated = rope_tail_ref(pooled[ends].unsqueeze(1), cos[ends], sin[ends]).squeeze(1)
    entries[slots[ends]] = rotated.to(entries.dtype)
    ring_row = positions[ring_rows].remainder(state_kv.shape[1])
    state_kv[token_slot[ring_rows], ring_row] = kv[ring_rows].to(state_kv.dtype)
    state_score[token_slot[ring_rows], ring_row] = score[ring_rows].to(state_score.dtype)
