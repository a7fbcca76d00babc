"""Attention backend interface: MQA over one shared KV head (K = V) with per-head sinks, reading
the sliding window from the paged window KV and, for CSA/HCA layers, compressed entries
(`forward`), or over keys a token reads from quantised caches by the rows it attends
(`attend_packed`: DeepSeek-V4.1's FP8 window and FP4 latents, decoded as the pool reads them)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch
from sgl_dspark.srt.mem_cache.v41_pool import QuantizedRows


class AttendedRows(NamedTuple):
    """Keys a token attends in one cache: its rows `[T, N]` of `cache` and which of them it
    sees (`valid` `[T, N]` bool; a row is read only where valid)."""

    cache: QuantizedRows
    rows: torch.Tensor
    valid: torch.Tensor


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
    def attend_packed(
        self,
        q: torch.Tensor,
        sources: Sequence[AttendedRows],
        sinks: torch.Tensor,
        scale: float,
        inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention of q `[T, H, Dh]` over the keys (keys are values) of one or two caches
        of q's dtype, attended in order (`sources`), with sinks `[H]` and scale: the spec is
        `sink_attention_ref` over the keys `QuantizedRows.load` decodes and the joined
        validity; `inverse_rope` as in `forward`. -> `[T, H, Dh]`."""
