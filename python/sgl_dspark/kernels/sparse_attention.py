"""DeepSeek-V4 decode/verify attention: sliding window through the page table + extra keys + sinks.

Math (deepseek_v4_model.md §5.2, §5.6, §5.8; the spec is `TorchAttentionBackend.forward`): one
shared KV head is both key and value. Token t at position p sees
  * the window keys at positions j in (p - window, p], j >= 0, read as
    ``window_kv[req_to_token[token_slot[t], j]]``;
  * the per-token extra keys ``extra_kv[t, n]`` where ``extra_valid[t, n]`` (compressed entries:
    all visible ones for HCA layers, the indexer's selection for CSA layers). With
    ``extra_slots`` the extra keys are read in place from a pool, ``extra_kv[extra_slots[t, n]]``,
    so the caller never gathers them into a ``[T, N, Dh]`` copy (one launch less per layer).
    With ``extra_entries = (N, m)`` (HCA layers) the extra keys are the request's compressed
    entries n < N themselves, visible while n < (p + 1) // m and read at their pool rows
    ``req_to_token[token_slot[t], min(n * m, W - 1)] // m`` (`dense_entries_ref`): no slot
    table and no mask are built per forward.
Per head h: ``o = sum_j softmax([scale * q.k_j ; sinks[h]])_j * k_j``, i.e. the sink adds
``exp(sinks[h])`` to the denominator only (its value is zero).

Two launch shapes of one kernel (``SPLIT`` constexpr): single pass, one program per (token, head
block) walking every key; or split-K (flash-decoding) for small batches, where the key range
(window tiles, then extra-key tiles) is cut into ``num_splits`` chunks on grid axis 2, each chunk
writes its partial (running max m, sum l, unnormalised acc) to fp32 scratch and
`_merge_attention_splits_kernel` combines the partials with the sink.

Exactness: X2 (tolerance). The kernel runs an online softmax in fp32 (exp2 with the log2(e)
factor folded into the scale), so the sum is reordered relative to the reference's one-shot
softmax; bf16 inputs additionally keep the logits and probabilities in fp32 where the reference
rounds them to bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import interpreted, programmatic_launch, wait_for_producers
from sgl_dspark.kernels.entry_rows import entry_pool_rows_ref, load_entry_rows
from sgl_dspark.kernels.rope import (
    X_KIND,
    epilogue_tables,
    rotate_rounded_tail,
    round_to_x,
)

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LOG2E = 1.4426950408889634
# Register budget of one program: BLOCK_H x Dh fp32 accumulator and BLOCK_N x Dh key tile.
_TILE_ELEMS = 8192
# Split-K choice (see `_auto_num_splits`): aim for ~2 programs per SM, never fewer than two key
# tiles per split (a split must amortise its q load and its partial write), at most 32 splits.
_WAVES = 2
_MIN_TILES_PER_SPLIT = 2
_MAX_SPLITS = 32
# SM count assumed where no CUDA device can be asked (the CPU interpreter): the H200's.
_DEFAULT_SM_COUNT = 132


def window_sparse_attention_ref(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    req_to_token: torch.Tensor,
    window: int,
    sinks: torch.Tensor,
    scale: float,
    extra_kv: torch.Tensor | None,
    extra_valid: torch.Tensor | None,
) -> torch.Tensor:
    """Reference (plain torch, same math and dtypes as `TorchAttentionBackend.forward`).

    Args:
        q: [T, H, Dh] queries (already rotated).
        window_kv: [num_slots, Dh] window KV of the layer, same dtype as q.
        positions: [T] int position of each token.
        token_slot: [T] int request slot (row of req_to_token) of each token.
        req_to_token: [slots, max_ctx] int token slot of (request slot, position).
        window: token at position p sees window positions (p - window, p].
        sinks: [H] fp32 sink logits.
        scale: logit scale (Dh ** -0.5 in the model).
        extra_kv: [T, N, Dh] per-token extra keys, or None.
        extra_valid: [T, N] bool, which extra keys token t sees (required with extra_kv).
    Returns:
        [T, H, Dh] in q's dtype.
    """
    offsets = torch.arange(window - 1, -1, -1, device=positions.device)
    win_pos = positions[:, None] - offsets[None, :]  # [T, W]
    valid = win_pos >= 0
    kv_slots = req_to_token[token_slot[:, None], win_pos.clamp(min=0)]
    keys = window_kv[kv_slots]  # [T, W, Dh]
    if extra_kv is not None:
        assert extra_valid is not None, "extra_kv needs extra_valid"
        keys = torch.cat((keys, extra_kv.to(keys.dtype)), dim=1)
        valid = torch.cat((valid, extra_valid), dim=1)
    logits = torch.einsum("thd,tkd->thk", q, keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_column = sinks.to(logits.dtype)[None, :, None].expand(logits.shape[0], -1, 1)
    logits = torch.cat((logits, sink_column), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)  # drop the sink column
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)


def dense_entries_ref(
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    req_to_token: torch.Tensor,
    num_entries: int,
    ratio: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool rows [T, N] int64, valid [T, N] bool) of ``extra_entries = (N, ratio)``: every
    compressed entry n < N of the token's request, visible once its block is complete."""
    entry = torch.arange(num_entries, device=positions.device)[None, :]
    rows = entry_pool_rows_ref(entry, req_to_token, token_slot, ratio)
    return rows, entry < ((positions + 1) // ratio)[:, None]


@triton.jit
def _online_softmax_step(
    q, keys, valid, m_i, l_i, acc, qk_scale, DOT_FP32: tl.constexpr, ROUND_P: tl.constexpr
):
    # One tile of keys [BLOCK_N, D] for the head block q [BLOCK_H, D]; logits in the log2 domain.
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(keys))
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    # m_i starts at the (finite) sink, so m_new is finite and masked keys give exp2(-inf) = 0.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if ROUND_P:  # 16-bit keys: probabilities enter the PV product in the key dtype
        p = p.to(keys.dtype)
    if DOT_FP32:
        pv = tl.dot(p.to(tl.float32), keys.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, keys)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _window_sparse_attention_kernel(
    q_ptr,
    kv_ptr,
    pos_ptr,
    slot_ptr,
    table_ptr,
    sinks_ptr,
    extra_ptr,
    extra_valid_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    extra_slots_ptr,
    slots_stride_t,
    cos_ptr,
    sin_ptr,
    cs_stride,
    num_heads,
    out_heads,
    window,
    num_extra,
    qk_scale,
    tiles_per_split,
    rope_dim,
    q_stride_t,
    q_stride_h,
    kv_stride,
    table_stride,
    table_width,
    entry_ratio,
    extra_stride_t,
    extra_stride_n,
    valid_stride_t,
    out_stride_t,
    out_stride_h,
    HEAD_DIM: tl.constexpr,
    D_POW2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    EXTRA_IN_POOL: tl.constexpr,
    DENSE_ENTRIES: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROUND_P: tl.constexpr,
    SPLIT: tl.constexpr,
    ROPE: tl.constexpr,
    X_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Key tiles are numbered window tiles first (cdiv(window, BLOCK_N) of them), then extra-key
    # tiles; program (token, head block, split) covers tiles [split, split + 1) * tiles_per_split.
    # SPLIT=False: one split covering everything, normalised output written directly.
    # SPLIT=True: out_ptr is the fp32 partial acc [T, S, H, Dh], part_m/part_l are [T, S, H].
    # q, the KV cache, the page table and the positions come from earlier kernels. The sinks are
    # parameters but sit off the critical path (the q and key loads issue alongside), so nothing
    # is loaded before the wait.
    wait_for_producers(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = heads < num_heads
    dims = tl.arange(0, D_POW2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token * q_stride_t + heads[:, None].to(tl.int64) * q_stride_h + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    kv_dtype = kv_ptr.dtype.element_ty
    q = q.to(kv_dtype)
    sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    # The running max starts at the (finite) sink, so it stays finite and masked keys give
    # exp2(-inf) = 0; a split that sees no valid key keeps (m, l, acc) = (sink, 0, 0).
    m_i = sink
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_POW2], dtype=tl.float32)

    tile_lo = split * tiles_per_split
    tile_hi = tile_lo + tiles_per_split
    window_tiles = tl.cdiv(window, BLOCK_N)
    position = tl.load(pos_ptr + token).to(tl.int64)
    table_row = table_ptr + tl.load(slot_ptr + token).to(tl.int64) * table_stride
    first = position - window + 1  # position of window offset 0 (may be negative)
    # Skip whole tiles that lie before position 0 (windows longer than the sequence so far).
    start = tl.maximum(tl.maximum(-first, 0) // BLOCK_N, tile_lo) * BLOCK_N
    stop = tl.minimum(tile_hi, window_tiles) * BLOCK_N
    offs = tl.arange(0, BLOCK_N)
    for j0 in range(start, stop, BLOCK_N):
        key_pos = first + j0 + offs
        valid = (key_pos >= 0) & (j0 + offs < window)
        kv_slot = tl.load(table_row + key_pos, mask=valid, other=0).to(tl.int64)
        keys = tl.load(
            kv_ptr + kv_slot[:, None] * kv_stride + dims[None, :],
            mask=valid[:, None] & dim_ok[None, :],
            other=0.0,
        )
        m_i, l_i, acc = _online_softmax_step(
            q, keys, valid, m_i, l_i, acc, qk_scale, DOT_FP32, ROUND_P
        )

    if HAS_EXTRA:
        extra_row = extra_ptr + token * extra_stride_t
        # Negative when this split ends inside the window: the loop is then empty.
        extra_start = tl.maximum(tile_lo - window_tiles, 0) * BLOCK_N
        extra_stop = tl.minimum((tile_hi - window_tiles) * BLOCK_N, num_extra)
        for n0 in range(extra_start, extra_stop, BLOCK_N):
            idx = n0 + offs
            in_range = idx < num_extra
            if DENSE_ENTRIES:  # the request's entries: complete blocks, rows from the table
                valid = in_range & (idx < (position + 1) // entry_ratio)
                rows = load_entry_rows(table_row, idx, entry_ratio, table_width, valid)
            else:
                valid = (
                    tl.load(extra_valid_ptr + token * valid_stride_t + idx, mask=in_range, other=0)
                    != 0
                )
                if EXTRA_IN_POOL:  # pool rows at this token's slots
                    rows = tl.load(
                        extra_slots_ptr + token * slots_stride_t + idx, mask=valid, other=0
                    ).to(tl.int64)
            if DENSE_ENTRIES or EXTRA_IN_POOL:  # extra_stride_n: pool rows
                key_ptrs = extra_ptr + rows[:, None] * extra_stride_n + dims[None, :]
            else:
                key_ptrs = extra_row + idx[:, None].to(tl.int64) * extra_stride_n + dims[None, :]
            keys = tl.load(key_ptrs, mask=valid[:, None] & dim_ok[None, :], other=0.0).to(kv_dtype)
            m_i, l_i, acc = _online_softmax_step(
                q, keys, valid, m_i, l_i, acc, qk_scale, DOT_FP32, ROUND_P
            )

    if SPLIT:
        # Partials of (token, split): rows of [T, S, H(, Dh)], contiguous over heads and dims.
        row = (token * tl.num_programs(2) + split) * num_heads + heads
        tl.store(part_m_ptr + row, m_i, mask=head_ok)
        tl.store(part_l_ptr + row, l_i, mask=head_ok)
        tl.store(
            out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=head_ok[:, None] & dim_ok[None, :],
        )
    else:
        denom = l_i + tl.exp2(sink - m_i)  # the sink's share of the normaliser (its value is zero)
        out = round_to_x(acc / denom[:, None], X_KIND, ON_BITS)
        if ROPE:  # the inverse rotation of the output's rope channels (`rope_tail`'s bits)
            out = rotate_rounded_tail(
                out,
                token + heads * 0,
                heads < out_heads,
                cos_ptr,
                sin_ptr,
                cs_stride,
                0,
                HEAD_DIM,
                rope_dim,
                BLOCK_H,
                D_POW2,
                True,
                X_KIND,
                ON_BITS,
            )
        tl.store(
            out_ptr
            + token * out_stride_t
            + heads[:, None].to(tl.int64) * out_stride_h
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=(heads < out_heads)[:, None] & dim_ok[None, :],
        )


@triton.jit
def _merge_attention_splits_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    sinks_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    cs_stride,
    num_heads,
    num_splits,
    out_stride_t,
    out_stride_h,
    rope_dim,
    HEAD_DIM: tl.constexpr,
    S_POW2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr,
    X_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, head, dim block): o = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s
    # + 2^(sink - M)) with M = max(sink, max_s m_s), which is finite, so a partial with
    # m_s = -inf (or a split slot past num_splits) has weight exactly 0 and never makes a NaN.
    wait_for_producers(PDL)  # the partials come from the split launch just before
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    splits = tl.arange(0, S_POW2)
    split_ok = splits < num_splits
    row = (token * num_splits + splits) * num_heads + head  # [S_POW2]
    m = tl.load(part_m_ptr + row, mask=split_ok, other=float("-inf"))
    l_part = tl.load(part_l_ptr + row, mask=split_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    m_max = tl.maximum(tl.max(m, axis=0), sink)
    weight = tl.exp2(m - m_max)
    denom = tl.sum(l_part * weight, axis=0) + tl.exp2(sink - m_max)
    out = round_to_x(tl.sum(acc * weight[:, None], axis=0) / denom, X_KIND, ON_BITS)
    if ROPE:  # the inverse rotation of the output's rope channels (`rope_tail`'s bits)
        out = tl.reshape(
            rotate_rounded_tail(
                out[None, :],
                token + tl.zeros([1], tl.int64),
                tl.full([1], True, tl.int1),
                cos_ptr,
                sin_ptr,
                cs_stride,
                tl.program_id(2) * BLOCK_D,
                HEAD_DIM,
                rope_dim,
                1,
                BLOCK_D,
                True,
                X_KIND,
                ON_BITS,
            ),
            [BLOCK_D],
        )
    tl.store(
        out_ptr + token * out_stride_t + head * out_stride_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def _auto_num_splits(programs: int, total_tiles: int, sm_count: int) -> int:
    """Splits per (token, head block): 1 when the single pass already has a program per SM,
    else enough to give ~`_WAVES` programs per SM, capped so each split keeps
    `_MIN_TILES_PER_SPLIT` key tiles and at most `_MAX_SPLITS` partials are merged."""
    if programs >= sm_count:
        return 1
    want = triton.cdiv(_WAVES * sm_count, programs)
    return max(1, min(want, triton.cdiv(total_tiles, _MIN_TILES_PER_SPLIT), _MAX_SPLITS))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SM_COUNT


def _check_int_vector(name: str, t: torch.Tensor, length: int) -> None:
    if t.dim() != 1 or t.shape[0] != length or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32/int64 [{length}], got {t.dtype} {tuple(t.shape)}")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")


def window_sparse_attention(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    req_to_token: torch.Tensor,
    window: int,
    sinks: torch.Tensor,
    scale: float,
    extra_kv: torch.Tensor | None,
    extra_valid: torch.Tensor | None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    extra_slots: torch.Tensor | None = None,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_heads: int | None = None,
    extra_entries: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Window + extra-key attention with sinks, no host sync (CUDA-graph safe).

    Arguments as `window_sparse_attention_ref` (q and window_kv bf16/fp16/fp32 of one dtype, unit
    stride along Dh; extra_kv any of those dtypes, cast to window_kv's on load; sinks must be
    finite). Each program runs an online softmax in fp32 over its share of the keys: window keys
    (slot ids loaded from the page table, then the K rows), then extra keys.
    `out`: optional [T, H, Dh] buffer of q's dtype (unit stride along Dh). Returns [T, H, Dh].
    `num_splits`: key-range chunks per (token, head block). 1 = single pass, one launch; S > 1 =
    split-K, S programs per (token, head block) writing fp32 partials (T*S*H*(Dh+2) floats,
    allocated here) and a merge launch. None picks it from the shapes (`_auto_num_splits`: split
    only when tokens x head blocks leaves SMs idle), so rounding may differ between batch sizes.
    Splits past the last key tile are allowed (they contribute nothing).
    `extra_slots`: optional int32/int64 [T, N]; extra_kv is then a pool [rows, Dh] and token t's
    extra key n is `extra_kv[extra_slots[t, n]]` (read only where extra_valid; the same values,
    so the same bits, as passing the gathered `extra_kv[extra_slots]`).
    `extra_entries`: optional (N, ratio): extra_kv is then a pool [rows, Dh] of compressed
    entries and token t sees its request's entries n < N with n < (position + 1) // ratio, at
    their pool rows (module doc); extra_valid and extra_slots must be None. The same bits as
    passing `dense_entries_ref`'s rows and mask as extra_slots and extra_valid.
    `inverse_rope`: optional (cos, sin) fp32 [T, rd/2] (one row stride, unit stride along rd/2):
    the output's trailing rd channels are rotated back by -angle in the output's epilogue, the
    same bits as `rope_tail(out, cos, sin, inverse=True)` after this kernel (K13's inverse
    tail; one launch less per layer). `out_heads`: keep the first H_out <= H heads only
    (un-padding the head dim of q); `out` is then [T, H_out, Dh].
    Both kernels run with FMA contraction off (the rotation rounds each product as
    `rope_tail` does; the attention itself is X2 either way).
    """
    if q.dim() != 3 or q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q must be [T, H, Dh] bf16/fp16/fp32, got {q.dtype} {tuple(q.shape)}")
    tokens, heads, head_dim = q.shape
    if window_kv.dim() != 2 or window_kv.shape[1] != head_dim or window_kv.dtype != q.dtype:
        raise ValueError(
            f"window_kv must be [slots, {head_dim}] {q.dtype}, got "
            f"{window_kv.dtype} {tuple(window_kv.shape)}"
        )
    _check_int_vector("positions", positions, tokens)
    _check_int_vector("token_slot", token_slot, tokens)
    if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"req_to_token must be int32/int64 [slots, max_ctx], got "
            f"{req_to_token.dtype} {tuple(req_to_token.shape)}"
        )
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (or None), got {num_splits}")
    if sinks.dim() != 1 or sinks.shape[0] != heads:
        raise ValueError(f"sinks must be [{heads}], got {tuple(sinks.shape)}")
    has_extra = extra_kv is not None
    num_extra = 0
    in_pool = extra_slots is not None
    dense, entry_ratio = extra_entries is not None, 1
    if extra_entries is not None:
        num_extra, entry_ratio = extra_entries
        if extra_kv is None or extra_valid is not None or extra_slots is not None:
            raise ValueError(
                "extra_entries needs extra_kv (the entry pool) and neither "
                "extra_valid nor extra_slots"
            )
        if num_extra < 0 or entry_ratio < 1:
            raise ValueError(f"extra_entries must be (N >= 0, ratio >= 1), got {extra_entries}")
        if (
            extra_kv.dim() != 2
            or extra_kv.shape[1] != head_dim
            or extra_kv.dtype not in _SUPPORTED_DTYPES
        ):
            raise ValueError(
                f"extra_kv must be a pool [rows, {head_dim}] float with "
                f"extra_entries, got {extra_kv.dtype} {tuple(extra_kv.shape)}"
            )
    elif extra_slots is not None:
        if extra_kv is None or extra_valid is None:
            raise ValueError("extra_slots needs extra_kv (the pool) and extra_valid")
        if (
            extra_slots.dim() != 2
            or extra_slots.shape[0] != tokens
            or extra_slots.dtype not in (torch.int32, torch.int64)
            or extra_slots.stride(-1) != 1
        ):
            raise ValueError(
                f"extra_slots must be int32/int64 [{tokens}, N] with unit stride "
                f"along N, got {extra_slots.dtype} {tuple(extra_slots.shape)}"
            )
        if (
            extra_kv.dim() != 2
            or extra_kv.shape[1] != head_dim
            or extra_kv.dtype not in _SUPPORTED_DTYPES
        ):
            raise ValueError(
                f"extra_kv must be a pool [rows, {head_dim}] float with "
                f"extra_slots, got {extra_kv.dtype} {tuple(extra_kv.shape)}"
            )
        num_extra = extra_slots.shape[1]
        if extra_valid.shape != extra_slots.shape or extra_valid.dtype != torch.bool:
            raise ValueError(
                f"extra_valid must be bool [{tokens}, {num_extra}], got "
                f"{extra_valid.dtype} {tuple(extra_valid.shape)}"
            )
    elif extra_kv is not None:
        if extra_valid is None:
            raise ValueError("extra_valid is required with extra_kv")
        if (
            extra_kv.dim() != 3
            or extra_kv.shape[0] != tokens
            or extra_kv.shape[2] != head_dim
            or extra_kv.dtype not in _SUPPORTED_DTYPES
        ):
            raise ValueError(
                f"extra_kv must be [{tokens}, N, {head_dim}] float, got "
                f"{extra_kv.dtype} {tuple(extra_kv.shape)}"
            )
        num_extra = extra_kv.shape[1]
        if extra_valid.shape != extra_kv.shape[:2] or extra_valid.dtype != torch.bool:
            raise ValueError(
                f"extra_valid must be bool [{tokens}, {num_extra}], got "
                f"{extra_valid.dtype} {tuple(extra_valid.shape)}"
            )
    out_heads = heads if out_heads is None else out_heads
    if not 0 <= out_heads <= heads:
        raise ValueError(f"out_heads must be in [0, {heads}], got {out_heads}")
    out_shape = (tokens, out_heads, head_dim)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != out_shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {q.dtype} {out_shape}, got {out.dtype} {tuple(out.shape)}")
    tables = epilogue_tables(inverse_rope, tokens, head_dim, sinks)
    if tokens == 0 or out_heads == 0:
        return out
    to_check = [("q", q), ("window_kv", window_kv), ("out", out), ("req_to_token", req_to_token)]
    if extra_kv is not None and extra_valid is not None and num_extra > 0:
        to_check += [("extra_kv", extra_kv), ("extra_valid", extra_valid)]
    if dense and extra_kv is not None:
        to_check.append(("extra_kv", extra_kv))
    for name, t in to_check:
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got {t.stride()}")
    if sinks.stride(0) != 1 and heads > 1:
        raise ValueError(f"sinks must be contiguous, got stride {sinks.stride()}")
    if extra_kv is None or num_extra == 0 or (extra_valid is None and not dense):
        has_extra = False
        extra_arg, valid_arg = q, positions  # never read (HAS_EXTRA=False)
        extra_strides, valid_stride = (0, 0), 0
    elif dense:
        extra_arg, valid_arg = extra_kv, positions  # no mask: visibility from the positions
        extra_strides, valid_stride = (0, extra_kv.stride(0)), 0
    elif in_pool:
        assert extra_valid is not None
        extra_arg, valid_arg = extra_kv, extra_valid.view(torch.uint8)
        extra_strides, valid_stride = (0, extra_kv.stride(0)), extra_valid.stride(0)
    else:
        assert extra_valid is not None
        extra_arg, valid_arg = extra_kv, extra_valid.view(torch.uint8)
        extra_strides, valid_stride = (
            (extra_kv.stride(0), extra_kv.stride(1)),
            extra_valid.stride(0),
        )
    slots_arg = extra_slots if in_pool and has_extra else positions  # read with EXTRA_IN_POOL only
    slots_stride = extra_slots.stride(0) if in_pool and extra_slots is not None else 0
    d_pow2 = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, min(triton.next_power_of_2(heads), _TILE_ELEMS // d_pow2))
    block_n = max(16, min(64, _TILE_ELEMS // d_pow2))
    head_blocks = triton.cdiv(heads, block_h)
    total_tiles = triton.cdiv(window, block_n) + triton.cdiv(num_extra if has_extra else 0, block_n)
    if num_splits is None:
        num_splits = _auto_num_splits(tokens * head_blocks, total_tiles, _sm_count(q.device))
    tiles_per_split = triton.cdiv(total_tiles, num_splits)
    split = num_splits > 1
    if split:
        # Partials, fully overwritten by the first launch (every split writes, empty ones too).
        part_acc = torch.empty(
            (tokens, num_splits, heads, head_dim), dtype=torch.float32, device=q.device
        )
        part_m = torch.empty((tokens, num_splits, heads), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        first_out, first_strides = part_acc, (0, 0)  # partial strides are implied by the shape
    else:
        first_out, first_strides = out, (out.stride(0), out.stride(1))
        part_m = part_l = out  # never touched (SPLIT=False)
    _window_sparse_attention_kernel[(tokens, head_blocks, num_splits)](
        q,
        window_kv,
        positions,
        token_slot,
        req_to_token,
        sinks,
        extra_arg,
        valid_arg,
        first_out,
        part_m,
        part_l,
        slots_arg,
        slots_stride,
        tables.cos,
        tables.sin,
        tables.stride,
        heads,
        heads if split else out_heads,
        window,
        num_extra,
        scale * _LOG2E,
        tiles_per_split,
        tables.rope_dim,
        q.stride(0),
        q.stride(1),
        window_kv.stride(0),
        req_to_token.stride(0),
        req_to_token.shape[1],
        entry_ratio,
        extra_strides[0],
        extra_strides[1],
        valid_stride,
        first_strides[0],
        first_strides[1],
        HEAD_DIM=head_dim,
        D_POW2=d_pow2,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        HAS_EXTRA=has_extra,
        EXTRA_IN_POOL=in_pool and has_extra,
        DENSE_ENTRIES=dense and has_extra,
        # fp32 must not go through tf32; the CPU interpreter's 16-bit tl.dot returns garbage
        # (triton 3.6), so there the exact 16-bit products are formed in fp32 instead.
        DOT_FP32=q.dtype == torch.float32 or q.device.type == "cpu",
        ROUND_P=q.dtype != torch.float32,
        SPLIT=split,
        ROPE=inverse_rope is not None,
        X_KIND=X_KIND[q.dtype],
        ON_BITS=interpreted(_window_sparse_attention_kernel),
        num_warps=8 if d_pow2 >= 256 else 4,
        enable_fp_fusion=False,
        **programmatic_launch(_window_sparse_attention_kernel, q.device),
    )
    if split:
        s_pow2 = triton.next_power_of_2(num_splits)
        block_d = max(16, min(d_pow2, _TILE_ELEMS // s_pow2))
        _merge_attention_splits_kernel[(tokens, out_heads, triton.cdiv(head_dim, block_d))](
            part_acc,
            part_m,
            part_l,
            sinks,
            out,
            tables.cos,
            tables.sin,
            tables.stride,
            heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            tables.rope_dim,
            HEAD_DIM=head_dim,
            S_POW2=s_pow2,
            BLOCK_D=block_d,
            ROPE=inverse_rope is not None,
            X_KIND=X_KIND[q.dtype],
            ON_BITS=interpreted(_merge_attention_splits_kernel),
            num_warps=4,
            enable_fp_fusion=False,
            **programmatic_launch(_merge_attention_splits_kernel, q.device),
        )
    return out
