"""Attention backend on the Triton window + sparse-entry kernel and the packed-key kernel
(`sgl_dspark.kernels`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch
from sgl_dspark.srt.layers.attention.base import AttendedRows, BaseAttentionBackend


class TritonAttentionBackend(BaseAttentionBackend):
    """Same math as `TorchAttentionBackend` in one kernel launch (two for small batches, whose
    key range is split across programs and merged); no host sync, so it can run inside a captured
    CUDA graph. Numerics: not bitwise against the torch backend (fp32 online softmax, reordered
    sums); the inverse rope runs in the output's epilogue, `apply_rope_tail`'s bits on the
    kernel's output.
    """

    def __init__(self, batch_invariant: bool = False) -> None:
        """`batch_invariant` (`--enable-deterministic-inference`): one pass over every token's
        keys (no split of the key range chosen from the batch's size), so a token's bits never
        depend on the batch: masked key tiles are exact no-ops of the online softmax."""
        # Imported here, as the other layers do, so that importing the registry (every process,
        # `--help`) does not import triton and define kernels.
        from sgl_dspark.kernels.attention.packed_keys import KeySource, packed_key_attention
        from sgl_dspark.kernels.attention.window_sparse import window_sparse_attention

        self._attention = window_sparse_attention
        self._packed_attention = packed_key_attention
        self._key_source = KeySource
        self._num_splits = 1 if batch_invariant else None

    def attend_packed(
        self,
        q: torch.Tensor,
        sources: Sequence[AttendedRows],
        sinks: torch.Tensor,
        scale: float,
        inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One kernel reads each source's stored bytes at its rows and decodes them in its
        loads (plain rows where the cache keeps them unquantised): no decoded keys in memory."""
        key_sources = [
            self._key_source(
                s.cache.data,
                s.cache.scales,
                s.cache.fmt if s.cache.packed else "plain",
                s.rows,
                s.valid,
            )
            for s in sources
        ]
        return self._packed_attention(
            q.contiguous(),
            key_sources,
            sinks,
            scale,
            inverse_rope=inverse_rope,
            num_splits=self._num_splits,
        )

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
        token_slot = batch.token_slots()
        return self._attention(
            q,
            window_kv,
            batch.positions,
            token_slot,
            batch.req_to_token,
            window,
            sinks,
            scale,
            extra_kv,
            extra_valid,
            extra_slots=extra_slots,
            inverse_rope=inverse_rope,
            extra_entries=extra_entries,
            num_splits=self._num_splits,
        )
