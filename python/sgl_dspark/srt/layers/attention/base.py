"""Attention backend interface: MQA over one shared KV head (K = V) with per-head sinks, reading
the sliding window from the paged window KV and, for CSA/HCA layers, compressed entries
(`forward`), or over keys a model has already gathered per token (`attend_gathered`: DeepSeek-V4.1,
whose caches are quantised and dequantised by its own loads)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch


class BaseAttentionBackend(ABC):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Called by the model when a forward of `batch` starts, before its first layer: a
        backend drops what it derived for the previous forward (inside a CUDA-graph capture it
        then derives it again within the graph, whose replays recompute it)."""
        del batch  # nothing derived per forward by default

    @abstractmethod
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
        """Attention output for every token of the batch.

        Args:
            q: `[T, H, Dh]` rotated queries.
            window_kv: `[num_slots, Dh]` layer's window KV; this batch's rows already written.
            sinks: `[H]` sink logits (fp32).
            window: query at position t sees window positions (t - window, t].
            extra_kv: `[rows, Dh]` the layer's pool of compressed entries, or None.
            extra_valid, extra_slots: `[T, N]` bool / int (CSA layers): token t sees the
                entries `extra_kv[extra_slots[t, n]]` where `extra_valid[t, n]`.
            extra_entries: optional `(N, ratio)` (HCA layers): every token sees its request's
                entries n < N whose block is complete (n < (position + 1) // ratio), at their
                pool rows (`entry_slots`); extra_valid and extra_slots are then None.
            inverse_rope: optional `(cos, sin)` fp32 `[T, rd/2]`: rotate the output's trailing
                rd channels back by -angle (`apply_rope_tail(o, cos, sin, inverse=True)`, the
                V rope carried into o); a backend may do it in its output's epilogue.
        Returns:
            `[T, H, Dh]` in q's dtype.
        """

    @abstractmethod
    def attend_gathered(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        valid: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention over keys gathered per token: q `[T, H, Dh]`, keys `[T, K, Dh]` of q's
        dtype (keys are values), valid `[T, K]` bool, sinks `[H]`, scale -> `[T, H, Dh]`
        (`sink_attention_ref` is the spec); `inverse_rope` as in `forward`."""
