"""DeepSeek-V4 attention in one or two launches: the sliding window through the page table, the
compressed entries of CSA/HCA layers read in place from their pool, and sinks
(`window_sparse_attention_ref` is the spec).

The extra keys come from the entry pool in the two ways the layers use: the entries an indexer
selected (CSA: pool rows and a mask per token) or every complete entry of the request (HCA: the
kernel derives each entry's pool row and visibility from the page table and the position, so no
row table or mask is built per forward).

Two launch shapes of one kernel (``SPLIT`` constexpr): single pass, one program per (token, head
block) walking every key; or split-K (flash-decoding) for small batches, where the key range
(window tiles, then extra-key tiles) is cut into ``num_splits`` chunks on grid axis 2, each chunk
writes its partial (running max m, sum l, unnormalised acc) to fp32 scratch and
`_merge_attention_splits_kernel` combines the partials with the sink.

Exactness: within a tolerance of the reference. The kernel runs an online softmax in fp32 (exp2
with the log2(e) factor folded into the scale), so the sum is reordered relative to the
reference's one-shot softmax; 16-bit inputs additionally keep the logits and probabilities in
fp32 where the reference rounds them to the input dtype. The optional inverse rope of the output
is `rope_tail`'s rotation bit for bit, applied to the kernel's own rounded output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_index_vector,
    check_unit_stride,
    require,
)
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    programmatic_launch,
    round_to_dtype,
    sm_count,
    wait_for_producers,
)
from sgl_dspark.kernels.attention.online_softmax import online_softmax_step
from sgl_dspark.kernels.compressor.entry_rows import load_entry_rows
from sgl_dspark.kernels.rope.epilogue import epilogue_tables, rotate_rounded_tail

_LOG2E = 1.4426950408889634
# Window caches stored in another dtype than q's (`--kv-cache-dtype`), converted on load.
WINDOW_STORAGE_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)
# Register budget of one program: BLOCK_H x Dh fp32 accumulator and BLOCK_N x Dh key tile.
_TILE_ELEMS = 8192
# Split-K choice (see `_auto_num_splits`): aim for ~2 programs per SM, never fewer than two key
# tiles per split (a split must amortise its q load and its partial write), at most 32 splits.
_WAVES = 2
_MIN_TILES_PER_SPLIT = 2
_MAX_SPLITS = 32


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
    extra_slots_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    cos_ptr,
    sin_ptr,
    cs_stride,
    num_heads,
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
    extra_stride,
    valid_stride_t,
    slots_stride_t,
    out_stride_t,
    out_stride_h,
    HEAD_DIM: tl.constexpr,
    D_POW2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    DENSE_ENTRIES: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROUND_P: tl.constexpr,
    SPLIT: tl.constexpr,
    ROPE: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Key tiles are numbered window tiles first (cdiv(window, BLOCK_N) of them), then extra-key
    # tiles; program (token, head block, split) covers tiles [split, split + 1) * tiles_per_split.
    # SPLIT=False: one split covering everything, normalised output written directly.
    # SPLIT=True: out_ptr is the fp32 partial acc [T, S, H, Dh], part_m/part_l are [T, S, H].
    # Extra keys: pool rows extra_ptr[row], the rows either listed per token (extra_slots, with
    # extra_valid) or, with DENSE_ENTRIES, the request's entries n < num_extra.
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
    kv_dtype = q_ptr.dtype.element_ty  # keys of a storage dtype (FP8) are converted on load
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
        ).to(kv_dtype)
        m_i, l_i, acc = online_softmax_step(
            q, keys, valid, m_i, l_i, acc, qk_scale, DOT_FP32, ROUND_P
        )

    if HAS_EXTRA:
        # Negative when this split ends inside the window: the loop is then empty.
        extra_start = tl.maximum(tile_lo - window_tiles, 0) * BLOCK_N
        extra_stop = tl.minimum((tile_hi - window_tiles) * BLOCK_N, num_extra)
        for n0 in range(extra_start, extra_stop, BLOCK_N):
            idx = n0 + offs
            in_range = idx < num_extra
            if DENSE_ENTRIES:  # the request's entries: complete blocks, rows from the table
                valid = in_range & (idx < (position + 1) // entry_ratio)
                rows = load_entry_rows(table_row, idx, entry_ratio, table_width, valid)
            else:  # the token's selected entries
                valid_row = extra_valid_ptr + token * valid_stride_t
                valid = tl.load(valid_row + idx, mask=in_range, other=0) != 0
                slots_row = extra_slots_ptr + token * slots_stride_t
                rows = tl.load(slots_row + idx, mask=valid, other=0).to(tl.int64)
            keys = tl.load(
                extra_ptr + rows[:, None] * extra_stride + dims[None, :],
                mask=valid[:, None] & dim_ok[None, :],
                other=0.0,
            ).to(kv_dtype)
            m_i, l_i, acc = online_softmax_step(
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
        out = round_to_dtype(acc / denom[:, None], KIND, ON_BITS)
        if ROPE:  # the inverse rotation of the output's rope channels (`rope_tail`'s bits)
            out = rotate_rounded_tail(
                out,
                token + heads * 0,
                head_ok,
                cos_ptr,
                sin_ptr,
                cs_stride,
                0,
                HEAD_DIM,
                rope_dim,
                BLOCK_H,
                D_POW2,
                True,
                KIND,
                ON_BITS,
            )
        tl.store(
            out_ptr
            + token * out_stride_t
            + heads[:, None].to(tl.int64) * out_stride_h
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None] & dim_ok[None, :],
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
    KIND: tl.constexpr,
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
    out = round_to_dtype(tl.sum(acc * weight[:, None], axis=0) / denom, KIND, ON_BITS)
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
                KIND,
                ON_BITS,
            ),
            [BLOCK_D],
        )
    tl.store(
        out_ptr + token * out_stride_t + head * out_stride_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def _attention_meta(heads: int, d_pow2: int) -> tuple[int, int, int]:
    """(heads a program, keys a tile, warps) for `heads` query heads of d_pow2 padded channels:
    the one place probes override (`benchmark/kernels/probe_attention_shape.py`). A program's
    accumulator and key tile stay within `_TILE_ELEMS` each. Four warps: at DeepSeek-V4's 512
    channels (16 heads, 16 keys) a program then takes 190 registers a thread on sm90 and two
    share an SM, where eight warps held one; on an H100 that ran V4.1's decode attention over
    640 keys 1.45x / 1.35x faster at 8 / 32 tokens and alike at one
    (`benchmark/results/sweeps/2026-12-07_h100_row_blocks_attention_shape_fb35d8a.md`)."""
    block_h = max(16, min(triton.next_power_of_2(heads), _TILE_ELEMS // d_pow2))
    block_n = max(16, min(64, _TILE_ELEMS // d_pow2))
    return block_h, block_n, 4


def _auto_num_splits(programs: int, total_tiles: int, sm_count: int) -> int:
    """Splits per (token, head block): 1 when the single pass already has a program per SM,
    else enough to give ~`_WAVES` programs per SM, capped so each split keeps
    `_MIN_TILES_PER_SPLIT` key tiles and at most `_MAX_SPLITS` partials are merged."""
    if programs >= sm_count:
        return 1
    want = triton.cdiv(_WAVES * sm_count, programs)
    return max(1, min(want, triton.cdiv(total_tiles, _MIN_TILES_PER_SPLIT), _MAX_SPLITS))


def _check_extra_keys(
    tokens: int,
    head_dim: int,
    extra_kv: torch.Tensor | None,
    extra_valid: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_entries: tuple[int, int] | None,
) -> int:
    """Validates the extra keys (the module doc's two ways); returns their count per token."""
    if extra_kv is None:
        require(
            extra_valid is None and extra_slots is None and extra_entries is None,
            "extra_valid, extra_slots and extra_entries need extra_kv (the entry pool)",
        )
        return 0
    require(
        extra_kv.dim() == 2 and extra_kv.shape[1] == head_dim and extra_kv.dtype in FLOAT_DTYPES,
        f"extra_kv must be a pool [rows, {head_dim}] bf16/fp16/fp32, got "
        f"{extra_kv.dtype} {tuple(extra_kv.shape)}",
    )
    check_unit_stride("extra_kv", extra_kv)
    if extra_entries is not None:
        require(
            extra_valid is None and extra_slots is None,
            "extra_entries takes neither extra_valid nor extra_slots",
        )
        num_entries, ratio = extra_entries
        require(
            num_entries >= 0 and ratio >= 1,
            f"extra_entries must be (N >= 0, ratio >= 1), got {extra_entries}",
        )
        return num_entries
    require(
        extra_slots is not None and extra_valid is not None,
        "extra_kv needs extra_slots and extra_valid, or extra_entries",
    )
    assert extra_slots is not None and extra_valid is not None
    require(
        extra_slots.dim() == 2
        and extra_slots.shape[0] == tokens
        and extra_slots.dtype in INDEX_DTYPES,
        f"extra_slots must be int32/int64 [{tokens}, N], got {extra_slots.dtype} "
        f"{tuple(extra_slots.shape)}",
    )
    require(
        extra_valid.shape == extra_slots.shape and extra_valid.dtype == torch.bool,
        f"extra_valid must be bool {tuple(extra_slots.shape)}, got {extra_valid.dtype} "
        f"{tuple(extra_valid.shape)}",
    )
    check_unit_stride("extra_slots", extra_slots)
    check_unit_stride("extra_valid", extra_valid)
    return extra_slots.shape[1]


def window_sparse_attention(
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
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`window_sparse_attention_ref` in one launch (two for split-K), no host sync (CUDA-graph
    safe).

    Args:
        q, window_kv: as the reference, bf16/fp16/fp32, unit stride along Dh; window_kv of q's
            dtype or a storage dtype (FP8 E4M3, bf16) converted to q's on load.
        positions, token_slot: int32/int64 [T], contiguous.
        req_to_token: int32/int64 [slots, max_ctx], unit stride along max_ctx.
        window, sinks (finite), scale: as the reference.
        extra_kv: the entry pool [rows, Dh] (any float dtype, cast to q's on load, unit
            stride along Dh), or None.
        extra_valid, extra_slots: selected entries, bool / int32/int64 [T, N] with unit stride
            along N and one row stride; rows are read only where valid.
        extra_entries: (N, ratio): dense entries, the same bits as passing
            `dense_entries_ref`'s rows and mask as extra_slots and extra_valid.
        inverse_rope: optional (cos, sin) fp32 [T, rd/2] (one row stride, unit stride along
            rd/2): the output's trailing rd channels are rotated back in the epilogue, the same
            bits as `rope_tail(out, cos, sin, inverse=True)` after this kernel.
        out: optional [T, H, Dh] buffer of q's dtype, unit stride along Dh.
        num_splits: key-range chunks per (token, head block). 1 = single pass, one launch;
            S > 1 = split-K, S programs per (token, head block) writing fp32 partials
            (T*S*H*(Dh+2) floats, allocated here) and a merge launch. None picks it from the
            shapes (`_auto_num_splits`: split only when tokens x head blocks leaves SMs idle),
            so rounding may differ between batch sizes. Splits past the last key tile are
            allowed (they contribute nothing).
    Returns:
        [T, H, Dh] in q's dtype (`out` when given).
    Raises:
        ValueError on a bad shape, dtype or layout (the message names the argument).
    Both kernels run with FMA contraction off (the rotation rounds each product as `rope_tail`
    does; the attention itself is within a tolerance either way).
    """
    require(
        q.dim() == 3 and q.dtype in FLOAT_DTYPES,
        f"q must be [T, H, Dh] bf16/fp16/fp32, got {q.dtype} {tuple(q.shape)}",
    )
    tokens, heads, head_dim = q.shape
    require(
        window_kv.dim() == 2
        and window_kv.shape[1] == head_dim
        and window_kv.dtype in (q.dtype, *WINDOW_STORAGE_DTYPES),
        f"window_kv must be [slots, {head_dim}] {q.dtype} (or a storage dtype "
        f"{WINDOW_STORAGE_DTYPES}), got {window_kv.dtype} {tuple(window_kv.shape)}",
    )
    check_index_vector("positions", positions, tokens)
    check_index_vector("token_slot", token_slot, tokens)
    require(
        req_to_token.dim() == 2 and req_to_token.dtype in INDEX_DTYPES,
        f"req_to_token must be int32/int64 [slots, max_ctx], got "
        f"{req_to_token.dtype} {tuple(req_to_token.shape)}",
    )
    # window 0: the extra keys only (attention over keys gathered per token, `extra_slots`).
    require(window >= 0, f"window must be >= 0, got {window}")
    require(
        num_splits is None or num_splits >= 1,
        f"num_splits must be >= 1 (or None), got {num_splits}",
    )
    require(
        sinks.dim() == 1 and sinks.shape[0] == heads,
        f"sinks must be [{heads}], got {tuple(sinks.shape)}",
    )
    num_extra = _check_extra_keys(
        tokens, head_dim, extra_kv, extra_valid, extra_slots, extra_entries
    )
    if out is None:
        out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    require(
        out.shape == q.shape and out.dtype == q.dtype,
        f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}",
    )
    tables = epilogue_tables(inverse_rope, tokens, head_dim, sinks)
    if tokens == 0 or heads == 0:
        return out
    for name, t in (
        ("q", q),
        ("window_kv", window_kv),
        ("out", out),
        ("req_to_token", req_to_token),
    ):
        check_unit_stride(name, t)
    require(
        sinks.stride(0) == 1 or heads == 1, f"sinks must be contiguous, got stride {sinks.stride()}"
    )
    has_extra = num_extra > 0
    dense = extra_entries is not None
    # Placeholders where the kernel reads nothing (HAS_EXTRA off, or the dense entries' lists).
    pool, pool_stride, ratio = q, 0, 1
    slots_arg, valid_arg, slots_stride, valid_stride = positions, positions, 0, 0
    if has_extra and extra_kv is not None:
        pool, pool_stride = extra_kv, extra_kv.stride(0)
    if extra_entries is not None:
        ratio = extra_entries[1]
    elif has_extra and extra_slots is not None and extra_valid is not None:
        slots_arg, slots_stride = extra_slots, extra_slots.stride(0)
        valid_arg, valid_stride = extra_valid.view(torch.uint8), extra_valid.stride(0)
    d_pow2 = max(16, triton.next_power_of_2(head_dim))
    block_h, block_n, num_warps = _attention_meta(heads, d_pow2)
    head_blocks = triton.cdiv(heads, block_h)
    total_tiles = triton.cdiv(window, block_n) + triton.cdiv(num_extra, block_n)
    if num_splits is None:
        num_splits = _auto_num_splits(tokens * head_blocks, total_tiles, sm_count(q.device))
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
        pool,
        valid_arg,
        slots_arg,
        first_out,
        part_m,
        part_l,
        tables.cos,
        tables.sin,
        tables.stride,
        heads,
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
        ratio,
        pool_stride,
        valid_stride,
        slots_stride,
        first_strides[0],
        first_strides[1],
        HEAD_DIM=head_dim,
        D_POW2=d_pow2,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        HAS_EXTRA=has_extra,
        DENSE_ENTRIES=dense and has_extra,
        # fp32 must not go through tf32; the CPU interpreter's 16-bit tl.dot returns garbage
        # (triton 3.6), so there the exact 16-bit products are formed in fp32 instead.
        DOT_FP32=q.dtype == torch.float32 or interpreted(_window_sparse_attention_kernel),
        ROUND_P=q.dtype != torch.float32,
        SPLIT=split,
        ROPE=inverse_rope is not None,
        KIND=DTYPE_KIND[q.dtype],
        ON_BITS=interpreted(_window_sparse_attention_kernel),
        num_warps=num_warps,
        enable_fp_fusion=False,
        **programmatic_launch(_window_sparse_attention_kernel, q.device),
    )
    if split:
        s_pow2 = triton.next_power_of_2(num_splits)
        block_d = max(16, min(d_pow2, _TILE_ELEMS // s_pow2))
        _merge_attention_splits_kernel[(tokens, heads, triton.cdiv(head_dim, block_d))](
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
            KIND=DTYPE_KIND[q.dtype],
            ON_BITS=interpreted(_merge_attention_splits_kernel),
            num_warps=4,
            enable_fp_fusion=False,
            **programmatic_launch(_merge_attention_splits_kernel, q.device),
        )
    return out
