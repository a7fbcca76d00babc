"""Prefill (extend) step of a KV compressor in two launches and no host synchronisation.

A prefill chunk completes many blocks and writes more rows than the state ring holds, so the
decode step's single launch (`compressor_decode`: an entry candidate and a ring write per row)
does not fit it: most rows end no block, and rows of one request would race for ring rows that
other programs' spans still read. Here the caller lists the rows instead (`ForwardBatch.
block_end_rows` / `last_rows`: from host-known lengths, or in a prefill graph built on the
device and padded with -1 to a static size, entries this kernel skips): the block-end rows
pool, rotate and store their entries (first launch, reading the ring of earlier chunks), then
the rows each request keeps go to its ring (second launch, after every read). Both launches are
the FUSED kernel of `pool.py` with a row list (`compressor_extend_ref` is the spec).
"""

from __future__ import annotations

import torch

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels.compressor.args import check_fused_args
from sgl_dspark.kernels.compressor.pool import launch_fused


def compressor_extend(
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
    *,
    counters: torch.Tensor | None = None,
) -> None:
    """`compressor_extend_ref` in two launches (pool + rope + entry store over the block-end rows,
    then the ring store over the ring rows). Layouts as `compressor_decode`; the row lists are
    contiguous int64 `[n]` on kv's device, block-end rows must end a block ((pos + 1) % m == 0;
    others are skipped), -1 entries are skipped; `counters` as `compressor_decode`'s. Exactness:
    entries within a tolerance of the reference (as `compressor_decode`), ring rows copied."""
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
    for name, rows in (("block_end_rows", block_end_rows), ("ring_rows", ring_rows)):
        require(
            rows.dim() == 1
            and rows.dtype == torch.int64
            and rows.is_contiguous()
            and rows.device == kv.device,
            f"{name} must be contiguous int64 [n] on {kv.device}, got "
            f"{rows.dtype} {tuple(rows.shape)} on {rows.device}",
        )
    args = (
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
    )
    launch_fused(*args, rows=block_end_rows, ring_store=False, pool=True, counters=counters)
    launch_fused(*args, rows=ring_rows, ring_store=True, pool=False, counters=None)
