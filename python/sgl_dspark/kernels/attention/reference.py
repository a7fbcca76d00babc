"""DeepSeek-V4 attention in torch: the reference of the attention kernels (`window_sparse.py`,
`draft.py`) and the torch attention backend's math.

Both are multi-query attention over one shared KV head that is both key and value, with a
per-head sink: ``o = sum_j softmax([scale * q.k_j ; sinks[h]])_j * k_j``, i.e. the sink adds
``exp(sinks[h])`` to the denominator only (its value is zero). Logits and probabilities are
rounded to the keys' dtype, as the model's torch path computes them.
"""

from __future__ import annotations

import torch

from sgl_dspark.kernels.compressor.reference import entry_pool_rows_ref
from sgl_dspark.kernels.rope.reference import rope_tail_ref


def sink_attention_ref(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """The attention core over keys already gathered per token: q [T, H, Dh], keys [T, K, Dh] of
    q's dtype, valid [T, K] bool -> [T, H, Dh]."""
    logits = torch.einsum("thd,tkd->thk", q, keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_column = sinks.to(logits.dtype)[None, :, None].expand(logits.shape[0], -1, 1)
    logits = torch.cat((logits, sink_column), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)  # drop the sink column
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)


def window_rows_ref(
    positions: torch.Tensor, token_slot: torch.Tensor, req_to_token: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token slots `[T, W]` of the window positions (t - W, t] of every token, and whether each
    position exists (>= 0); missing positions read the request's slot of position 0."""
    offsets = torch.arange(window - 1, -1, -1, device=positions.device)
    win_pos = positions[:, None] - offsets[None, :]  # [T, W]
    return req_to_token[token_slot[:, None], win_pos.clamp(min=0)], win_pos >= 0


def dense_entries_ref(
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    req_to_token: torch.Tensor,
    num_entries: int,
    ratio: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool rows [T, N] int64, visible [T, N] bool) of ``extra_entries = (N, ratio)``: every
    compressed entry n < N of the token's request, visible once its block is complete."""
    entry = torch.arange(num_entries, device=positions.device)[None, :]
    rows = entry_pool_rows_ref(entry, req_to_token, token_slot, ratio)
    return rows, entry < ((positions + 1) // ratio)[:, None]


def window_sparse_attention_ref(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    req_to_token: torch.Tensor,
    window: int,
    sinks: torch.Tensor,
    scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_valid: torch.Tensor | None = None,
    *,
    extra_slots: torch.Tensor | None = None,
    extra_entries: tuple[int, int] | None = None,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode/verify/prefill attention: the sliding window through the page table plus the
    compressed entries of CSA/HCA layers, with sinks.

    Token t at position p sees the window keys at positions j in (p - window, p], j >= 0, read
    as ``window_kv[req_to_token[token_slot[t], j]]``, and extra keys from the entry pool
    ``extra_kv`` in one of two ways:
      * selected entries (CSA layers): ``extra_kv[extra_slots[t, n]]`` where
        ``extra_valid[t, n]`` (the indexer's picks);
      * dense entries (HCA layers), ``extra_entries = (N, ratio)``: every entry n < N of the
        token's request that is complete (n < (p + 1) // ratio), at its pool row
        (`dense_entries_ref`).

    Args:
        q: [T, H, Dh] rotated queries.
        window_kv: [num_slots, Dh] window KV of the layer, q's dtype or a storage dtype (FP8
            E4M3, bf16) whose rows are read converted to q's dtype.
        positions, token_slot: [T] int position and request slot (row of req_to_token).
        req_to_token: [slots, max_ctx] int token slot of (request slot, position).
        window: the window length.
        sinks: [H] sink logits.
        scale: logit scale (Dh ** -0.5 in the model).
        extra_kv: [rows, Dh] the entry pool, or None (sliding-window layers).
        extra_valid, extra_slots: [T, N] bool / int (selected entries).
        extra_entries: (N, ratio) (dense entries; extra_valid and extra_slots None).
        inverse_rope: optional (cos, sin) fp32 [T, rd/2]: the output's trailing rd channels are
            rotated back by -angle (`rope_tail_ref(o, cos, sin, inverse=True)`).
    Returns:
        [T, H, Dh] in q's dtype.
    """
    rows, valid = window_rows_ref(positions, token_slot, req_to_token, window)
    keys = read_rows(window_kv, rows, q.dtype)  # [T, W, Dh]
    if extra_entries is not None:
        extra_slots, extra_valid = dense_entries_ref(
            positions, token_slot, req_to_token, *extra_entries
        )
    if extra_kv is not None:
        if extra_slots is None or extra_valid is None:
            raise ValueError("extra_kv needs extra_slots and extra_valid, or extra_entries")
        keys = torch.cat((keys, extra_kv[extra_slots].to(keys.dtype)), dim=1)
        valid = torch.cat((valid, extra_valid), dim=1)
    out = sink_attention_ref(q, keys, valid, sinks, scale)
    if inverse_rope is None:
        return out
    return rope_tail_ref(out, *inverse_rope, inverse=True)


def read_rows(pool: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`pool[rows]` converted to `dtype` (exact from FP8 to bf16/fp16/fp32); one-byte float
    pools are gathered as bytes, so every device indexes them."""
    if pool.is_floating_point() and pool.element_size() == 1:
        return pool.view(torch.uint8)[rows].view(pool.dtype).to(dtype)
    return pool[rows].to(dtype)


def draft_attention_ref(
    q: torch.Tensor,
    ctx_pool: torch.Tensor,
    ctx_slots: torch.Tensor,
    ctx_valid: torch.Tensor,
    kv_block: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention core of a DSpark draft stage: each block row sees the visible context rows
    ``ctx_pool[ctx_slots]`` (cast to the block's dtype) and every block row (the block is
    bidirectional), plus a per-head sink in the denominator.

    Args:
        q: [B, Q, H, Dh] rotated block queries.
        ctx_pool: [N, Dh] the stage's context-KV pool.
        ctx_slots: [B, C] int pool slots of the context positions.
        ctx_valid: [B, C] bool, which context positions are visible.
        kv_block: [B, Q, Dh] the block's own KV rows, q's dtype.
        sinks: [H] sink logits.
        scale: logit scale (Dh ** -0.5 in the model).
        inverse_rope: optional (cos, sin) fp32 [B * Q, rd/2] at the block rows' positions: the
            output's trailing rd channels are rotated back by -angle.
    Returns:
        [B, Q, H, Dh] in q's dtype.
    """
    batch, q_len = kv_block.shape[:2]
    keys = torch.cat((ctx_pool[ctx_slots].to(kv_block.dtype), kv_block), dim=1)  # [B, C+Q, Dh]
    valid = torch.cat((ctx_valid, ctx_valid.new_ones(batch, q_len)), dim=1)
    logits = torch.einsum("bqhd,bkd->bqhk", q, keys) * scale
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    sink = sinks.to(logits.dtype).view(1, 1, -1, 1).expand(batch, q_len, -1, 1)
    logits = torch.cat((logits, sink), dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    out = torch.einsum("bqhk,bkd->bqhd", probs.to(keys.dtype), keys).to(q.dtype)
    if inverse_rope is None:
        return out
    return rope_tail_ref(out.flatten(0, 1), *inverse_rope, inverse=True).view_as(out)
