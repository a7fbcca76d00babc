"""Decode/verify step of a CSA/HCA compressor in one launch: pooling, RoPE, the entry store and
the ring store fused (the FUSED variant of `pool.py`'s kernel; `compressor_decode_ref` is the
spec). `extend.py` launches the same kernel over row lists for prefill chunks.
"""

from __future__ import annotations

import torch

from sgl_dspark.kernels.compressor.args import check_fused_args
from sgl_dspark.kernels.compressor.pool import launch_fused


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
    Exactness: the entry as `compressor_pool` (within a tolerance) followed by the rope
    rotation (bit for bit); the ring rows are copies.
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
