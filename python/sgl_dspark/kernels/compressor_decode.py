"""Decode/verify step of a CSA/HCA compressor in one launch: pooling, RoPE, the entry store and
the ring store fused (the FUSED variant of `compressor_pool.py`'s kernel), with its reference.
`compressor_extend.py` launches the same kernel over row lists for prefill chunks.
"""

from __future__ import annotations

import torch

from sgl_dspark.kernels._checks import check_compressor_args
from sgl_dspark.kernels.compressor_pool import launch_fused


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
    """Reference of the whole decode/verify step of a compressor, in place: the entries of the
    blocks these rows end (`compressor_pool_ref`, then rope at the block start with the given
    cos/sin rows `[T, rd/2]`) are written into the entry pool `entries` `[slots, Dh]`; then every
    row's raw kv/score goes to its state ring row `pos mod R`."""
    # Reference-only imports: the runtime's path through this module never loads them.
    from sgl_dspark.kernels.compressor_pool import compressor_pool_ref
    from sgl_dspark.kernels.rope import rope_tail_ref

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


def compressor_decode(
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
    counters: torch.Tensor | None = None,
) -> None:
    """`compressor_decode_ref` in one launch (pooling, RoPE, entry store and ring store fused).

    Arguments as `compressor_pool`, plus cos / sin fp32 `[T, rd/2]` (unit stride along rd/2, one
    row stride) at each row's block start, and the entry pool `entries` `[slots, Dh]` of kv's
    dtype with unit channel stride. The state rings must hold R >= span + (rows of one request
    in this forward) rows (the pool's sizing), so that no ring row written here is read by
    another row's span. `counters`: int32 `[>= slots]`, zeroed once and then left zero by every
    launch: the entries' arrival counters when a row's channels are split over programs (a span
    x Dh beyond one program's tile, e.g. HCA); zeroed per call (a memset) when omitted.
    Exactness: the entry as `compressor_pool` (X2) followed by
    `kernels/rope.py` (bit for bit); the ring rows are copies.
    """
    check_fused_args(
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
        cos,
        sin,
        entries,
    )
    launch_fused(
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
        cos,
        sin,
        entries,
        rows=None,
        ring_store=True,
        pool=True,
        counters=counters,
    )


def check_fused_args(
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
    cos: torch.Tensor,
    sin: torch.Tensor,
    entries: torch.Tensor,
) -> None:
    """`check_compressor_args` plus the entry pool and the rope tables of the fused launchers
    (decode, `compressor_extend.py`)."""
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
    if (
        entries.dim() != 2
        or entries.shape[1] != head_dim
        or entries.dtype != kv.dtype
        or entries.stride(1) != 1
    ):
        raise ValueError(
            f"entries must be [slots, {head_dim}] {kv.dtype} with unit channel "
            f"stride, got {entries.dtype} {tuple(entries.shape)}"
        )
    if (
        cos.shape != sin.shape
        or cos.dim() != 2
        or cos.shape[0] != tokens
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or not 1 <= 2 * cos.shape[1] <= head_dim
        or head_dim % 2
        or cos.stride(1) != 1
        or sin.stride(1) != 1
        or cos.stride(0) != sin.stride(0)
    ):
        raise ValueError(
            f"cos/sin must be fp32 [{tokens}, rd/2] with 2 <= rd <= Dh={head_dim} "
            f"(Dh even), unit stride along rd/2 and one row stride; got "
            f"{cos.dtype} {tuple(cos.shape)} / {sin.dtype} {tuple(sin.shape)}"
        )
    span = 2 * ratio if overlap else ratio
    if state_kv.shape[1] < span + 1:
        raise ValueError(f"state ring of {state_kv.shape[1]} rows is too short for span {span}")
