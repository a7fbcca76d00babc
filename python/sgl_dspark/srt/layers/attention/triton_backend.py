"""Attention backend on the Triton window + sparse-entry kernel (`sgl_dspark.kernels`)."""

from __future__ import annotations

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch
from sgl_dspark.srt.layers.attention.base import BaseAttentionBackend


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
        from sgl_dspark.kernels import window_sparse_attention

        self._attention = window_sparse_attention
        self._num_splits = 1 if batch_invariant else None
        # `attend_gathered`'s index tensors, which depend on the batch's shape alone: built by
        # the first layer of a forward, shared by the others, dropped when the next forward
        # starts (`init_forward_metadata`). Never kept across forwards: a tensor made inside a
        # graph's capture is written only by that graph's replays, so no other forward may read it.
        self._rows: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self._placeholders: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._rows.clear()
        self._placeholders.clear()

    def _gathered_indices(
        self, tokens: int, k: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token t's rows t * K + j of the flattened keys `[T, K]`, then placeholders for the
        positions and token slots `[T]` and the page table `[1, 1]`: with no window the kernel
        reads none of them."""
        rows = self._rows.get((tokens, k, device))
        if rows is None:
            rows = torch.arange(tokens * k, device=device).view(tokens, k)
            self._rows[(tokens, k, device)] = rows
        placeholders = self._placeholders.get((tokens, device))
        if placeholders is None:
            zeros = torch.zeros(tokens, dtype=torch.int64, device=device)
            placeholders = (zeros, zeros.view(tokens, 1)[:1])
            self._placeholders[(tokens, device)] = placeholders
        return rows, *placeholders

    def attend_gathered(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        valid: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The window + sparse kernel with no window and the gathered keys as its extra keys
        (token t's rows t * K + j of the flattened keys); the inverse rope in its epilogue."""
        tokens, k, head_dim = keys.shape
        pool = keys.reshape(tokens * k, head_dim)
        rows, zeros, table = self._gathered_indices(tokens, k, q.device)
        return self._attention(
            q.contiguous(),
            pool,
            zeros,
            zeros,
            table,
            0,
            sinks,
            scale,
            pool,
            valid.contiguous(),
            extra_slots=rows,
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
