"""Reference-quality attention backend in plain torch (CPU and eager GPU)."""

from __future__ import annotations

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch
from sgl_dspark.srt.layers.attention.base import BaseAttentionBackend
from sgl_dspark.srt.layers.attention.compressor import entry_slots, visible_entries
from sgl_dspark.srt.layers.rotary import apply_rope_tail


class TorchAttentionBackend(BaseAttentionBackend):
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
        if extra_kv is not None and extra_slots is not None:
            extra_kv = extra_kv[extra_slots]
        kv_slots, valid = window_rows(batch, window)
        keys = window_kv[kv_slots]  # [T, W, Dh]
        if extra_kv is not None:
            assert extra_valid is not None
            keys = torch.cat((keys, extra_kv.to(keys.dtype)), dim=1)
            valid = torch.cat((valid, extra_valid), dim=1)
        o = sink_attention(q, keys, valid, sinks, scale)
        return o if inverse_rope is None else apply_rope_tail(o, *inverse_rope, inverse=True)


def window_rows(batch: ForwardBatch, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token slots `[T, W]` of the window positions (t - W, t] of every token, and whether each
    position exists (>= 0); missing positions point at the request's slot of position 0."""
    pos = batch.positions
    offs = torch.arange(window - 1, -1, -1, device=pos.device)
    win_pos = pos[:, None] - offs[None, :]  # [T, W]
    slot = batch.token_slots()
    return batch.req_to_token[slot[:, None], win_pos.clamp(min=0)], win_pos >= 0


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per-token MQA with a sink logit per head: q `[T, H, Dh]`, keys (= values) `[T, K, Dh]`,
    valid `[T, K]` bool, sinks `[H]` (the sink adds exp(sink) to the softmax denominator only).
    Returns `[T, H, Dh]` in q's dtype (before any inverse rope)."""
    logits = torch.einsum("thd,tkd->thk", q, keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.to(logits.dtype)[None, :, None].expand(logits.shape[0], -1, 1)
    logits = torch.cat((logits, sink), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)
