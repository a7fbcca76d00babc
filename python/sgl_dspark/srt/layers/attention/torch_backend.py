"""Attention backend in plain torch (CPU and eager GPU): `window_sparse_attention_ref`, with the
HCA entries' rows and visibility built once per forward."""

from __future__ import annotations

import torch

from sgl_dspark.kernels.attention.reference import sink_attention_ref, window_sparse_attention_ref
from sgl_dspark.kernels.rope.reference import rope_tail_ref
from sgl_dspark.srt.core.forward_batch import ForwardBatch
from sgl_dspark.srt.layers.attention.base import BaseAttentionBackend
from sgl_dspark.srt.layers.attention.compressor import entry_slots, visible_entries


class TorchAttentionBackend(BaseAttentionBackend):
    def attend_gathered(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        valid: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        out = sink_attention_ref(q, keys, valid, sinks, scale)
        if inverse_rope is None:
            return out
        return rope_tail_ref(out, *inverse_rope, inverse=True)

    def forward(
        self,
        q: torch.Tensor,
        window_kv: torch.Tensor,
        batch: ForwardBatch,
        sinks: torch.Tensor,
        window: int,
        scale: float,
        extra_kv: torch.Tensor | None,
        extra_valid: torch.Tensor | None,
        extra_slots: torch.Tensor | None = None,
        inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        extra_entries: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        if extra_entries is not None:
            n, ratio = extra_entries
            extra_slots = entry_slots(batch, n, ratio)
            extra_valid = batch.cached(
                ("entry_valid", n, ratio),
                lambda: (
                    torch.arange(n, device=q.device)[None, :]
                    < visible_entries(batch, ratio)[:, None]
                ),
            )
        return window_sparse_attention_ref(
            q,
            window_kv,
            batch.positions,
            batch.token_slots(),
            batch.req_to_token,
            window,
            sinks,
            scale,
            extra_kv,
            extra_valid,
            extra_slots=extra_slots,
            inverse_rope=inverse_rope,
        )
