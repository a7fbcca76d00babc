"""KV compressors of CSA/HCA layers and the lightning indexer, with their decode state.

Both compress blocks of m consecutive tokens into one entry by a per-channel softmax over the
block's gate scores. CSA ("overlap") entries mix the previous block's first-half channels (Ca)
with this block's second-half channels (Cb), 2m slots in all. Entries are emitted when the token
that completes a block is processed; rows of earlier forwards come from the request's state ring.

The "indexer" kernel family chooses, once per layer, the indexer scoring and the pooling steps
(decode/verify and prefill): torch (this module's code) or the Triton kernels. Neither path reads
the device: prefill selects its block-end and ring rows from host-known lengths, or in a prefill
graph from device-built lists padded with -1 (`ForwardBatch.block_end_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from sgl_dspark.kernels.compressor.reference import entry_pool_rows_ref
from sgl_dspark.kernels.indexer.reference import indexer_logits_ref
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.norm import RMSNorm
from sgl_dspark.srt.mem_cache.kv_pool import CompressorState


class CompressRope(Protocol):
    """The "compress" rope of one forward. `cache_key` names positions that are a function of
    the batch alone, so the caller may reuse their cos/sin table across layers."""

    def rotate_compress(
        self, x: torch.Tensor, positions: torch.Tensor, cache_key: object = None
    ) -> torch.Tensor:
        """Rotate x [N, ...] at positions [N]."""

    def compress_table(
        self, positions: torch.Tensor, cache_key: object = None, shift: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin fp32 [N, rd/2] of positions - shift ([N])."""


# (kv, score, state_kv, state_score, position_bias, norm_weight, positions, token_slot,
#  token_prefix, req_to_token, ratio, overlap, eps, cos, sin, entries) -> None (in place)
DecodeStepFn = Callable[..., None]
# (qi [T, Hi, Di], weights [T, Hi] (fp32 or qi's dtype), index_keys, positions, token_slot,
#  req_to_token, ratio, n_max, *, weight_scale) -> scores [T, n_max] fp32, -inf beyond each
#  token's visible entries; the head weights are used as fp32(weights) * weight_scale
IndexerScoresFn = Callable[..., torch.Tensor]


# (... as DecodeStepFn ..., entries, block_end_rows, ring_rows) -> None (in place)
ExtendStepFn = Callable[..., None]


def extend_step_impl(kernels: KernelChoice) -> ExtendStepFn | None:
    """The prefill (extend) step of the "indexer" family: None (torch: the compressor's own
    code) or `kernels/compressor/extend.py::compressor_extend` (two launches over row lists)."""
    if kernels.of("indexer") == "torch":
        return None
    from sgl_dspark.kernels.compressor.extend import compressor_extend

    return compressor_extend


def decode_step_impl(kernels: KernelChoice) -> DecodeStepFn | None:
    """The decode/verify step of the "indexer" family, bound once per compressor.

    torch: None (the compressor's own torch code, shared with prefill). triton: the one-launch
    `kernels/compressor/decode.py::compressor_decode`: block pooling (X2: same rounding points,
    fp32 sums in another order), RoPE at the block start, the entry store and the state-ring
    store; prefill keeps the torch code either way.
    """
    if kernels.of("indexer") == "torch":
        return None
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.compressor.decode import compressor_decode

    return compressor_decode


def indexer_scores_impl(kernels: KernelChoice) -> IndexerScoresFn:
    """The indexer scoring of the "indexer" family: `indexer_logits_ref`, or the Triton
    variable-context kernel `kernels/indexer/logits.py::indexer_logits` (within a tolerance:
    fp32 sums reordered)."""
    if kernels.of("indexer") == "torch":
        return indexer_logits_ref
    from sgl_dspark.kernels.indexer.logits import indexer_logits

    return indexer_logits


# (scores [T, N] fp32, visible [T] int64, k, *, entry_rows=(req_to_token, token_slot [T],
#  ratio)) -> (the selected entries' pool rows [T, k] int64, valid [T, k] bool)
TopkFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def index_topk_impl(kernels: KernelChoice) -> TopkFn:
    """The indexer's top-k selection of the "indexer" family: `index_topk_torch`, or the
    one-launch Triton select `kernels/indexer/topk.py::index_topk` (the same set up to ties at the
    threshold, which it breaks toward the lower index; ids in ascending order rather than by
    score, so the attention's entry sums run in another order). Both return the
    selected entries' pool rows (`entry_rows`), the kernel from inside its launch."""
    if kernels.of("indexer") == "torch":
        return index_topk_torch
    from sgl_dspark.kernels.indexer.topk import index_topk

    return index_topk


def index_topk_torch(
    scores: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    *,
    entry_rows: tuple[torch.Tensor, torch.Tensor, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk over rows whose entries >= visible are -inf, then the picks' pool rows
    (`entry_pool_rows_ref`); invalid picks become row 0."""
    top = scores.topk(k, dim=-1).indices
    valid = top < visible[:, None]
    rows = entry_pool_rows_ref(top, *entry_rows)
    return torch.where(valid, rows, torch.zeros_like(rows)), valid


class BlockCompressor(nn.Module):
    """Parameters `kv_proj`, `gate_proj`, `position_bias`, `kv_norm` (HF names)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        ratio: int,
        overlap: bool,
        eps: float,
        *,
        kernels: KernelChoice,
    ) -> None:
        super().__init__()
        self._decode_step = decode_step_impl(kernels)
        self._extend_step = extend_step_impl(kernels)
        width = 2 * head_dim if overlap else head_dim
        self.head_dim = head_dim
        self.ratio = ratio
        self.overlap = overlap
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(head_dim, eps)

    def compress(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        batch: ForwardBatch,
        state: CompressorState,
        entries: torch.Tensor,
        rope: CompressRope,
    ) -> None:
        """Emit the entries of every block completed by this batch into `entries`, then record
        this batch's raw rows in the state ring. kv / score: `kv_proj(x)` / `gate_proj(x)` (the
        layer computes them in its fused x projection)."""
        slot_tok = batch.token_slots()
        extend = batch.mode is ForwardMode.EXTEND
        step = self._extend_step if extend else self._decode_step
        if step is not None:
            # Decode/verify: one launch, a candidate entry per row (stored where the row ends a
            # block) and every row's raw kv/score into the ring. Prefill: the block-end rows,
            # then the ring rows (compressor_extend). No host synchronisation either way.
            m = self.ratio
            cos, sin = rope.compress_table(batch.positions, ("block_start", m), shift=m - 1)
            rows = (batch.block_end_rows(m), batch.last_rows(state.ring)) if extend else ()
            step(
                kv,
                score,
                state.kv,
                state.score,
                self.position_bias,
                self.kv_norm.weight,
                batch.positions,
                slot_tok,
                batch.token_prefix_lens(),
                batch.req_to_token,
                m,
                self.overlap,
                self.kv_norm.eps,
                cos,
                sin,
                entries,
                *rows,
                counters=state.entry_counters,
            )
            return
        self._emit_entries_torch(kv, score, batch, state, entries, rope, slot_tok)
        # Only the last `ring` positions of each request are kept, so no two rows of one
        # request collide in this write.
        pos, ring = batch.positions, state.ring
        if extend:
            keep = batch.last_rows(ring)
            kept = keep >= 0 if not batch.host_lens else None  # a prefill graph's: -1 padded
            keep = keep.clamp(min=0) if kept is not None else keep
            pos, slot_tok, kv, score = pos[keep], slot_tok[keep], kv[keep], score[keep]
            if kept is not None:  # padding entries write to the dummy request slot 0
                slot_tok = torch.where(kept, slot_tok, torch.zeros_like(slot_tok))
        # else: a decode/verify request has fewer new rows than the ring (asserted by the runner's
        # max_verify_tokens), so every row is kept and no boolean mask (a host sync) is needed.
        ridx = pos.remainder(ring)
        state.kv[slot_tok, ridx] = kv.to(state.kv.dtype)
        state.score[slot_tok, ridx] = score.to(state.score.dtype)

    def _emit_entries_torch(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        batch: ForwardBatch,
        state: CompressorState,
        entries: torch.Tensor,
        rope: CompressRope,
        slot_tok: torch.Tensor,
    ) -> None:
        m, d, ring = self.ratio, self.head_dim, state.ring
        pos = batch.positions
        write_mask = None
        if batch.mode is ForwardMode.EXTEND:
            # Prefill: only the completed blocks. A prefill graph's list is padded with -1: those
            # rows compute an entry at row 0 and write it to the dummy entry 0.
            ends = batch.block_end_rows(m)
            if not batch.host_lens:
                write_mask = ends >= 0
                ends = ends.clamp(min=0)
        else:
            # Decode/verify (few rows): a candidate entry for every row, written only where a block
            # ends (other rows write to the reserved dummy entry 0): no host synchronisation.
            ends = torch.arange(pos.shape[0], device=pos.device)
            write_mask = (pos + 1) % m == 0
        if ends.numel() > 0:
            span = 2 * m if self.overlap else m
            rel = torch.arange(span, device=pos.device) - (span - 1)
            q = pos[ends, None] + rel[None, :]  # absolute row positions
            prefix = batch.prefix_lens[batch.token_req[ends]]
            fresh = (q >= prefix[:, None]).unsqueeze(-1)
            flat = (ends[:, None] + rel[None, :]).clamp(min=0)
            slot = slot_tok[ends][:, None]
            ring_idx = q.remainder(ring)
            kv_rows = torch.where(fresh, kv[flat], state.kv[slot, ring_idx])
            sc_rows = torch.where(fresh, score[flat], state.score[slot, ring_idx])
            sc_rows = sc_rows + self.position_bias[q.remainder(m)].to(sc_rows.dtype)
            if self.overlap:
                kv_rows = torch.cat((kv_rows[:, :m, :d], kv_rows[:, m:, d:]), dim=1)
                sc_rows = torch.cat((sc_rows[:, :m, :d], sc_rows[:, m:, d:]), dim=1)
                # Block 0 has no previous block: its Ca slots get weight 0.
                absent = (q < 0).unsqueeze(-1)
                kv_rows = kv_rows.masked_fill(absent, 0.0)
                sc_rows = sc_rows.masked_fill(absent, float("-inf"))
            weights = torch.softmax(sc_rows, dim=1, dtype=torch.float32).to(kv_rows.dtype)
            entry = self.kv_norm((kv_rows * weights).sum(dim=1))
            start = pos[ends] - (m - 1)
            entry = rope.rotate_compress(entry, start)
            entry_slot = batch.req_to_token[slot_tok[ends], start.clamp(min=0)] // m
            if write_mask is not None:
                entry_slot = torch.where(write_mask, entry_slot, torch.zeros_like(entry_slot))
            entries[entry_slot] = entry.to(entries.dtype)


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)


class Indexer(BlockCompressor):
    """Lightning indexer: its own overlapping compressor over index keys, plus query scoring."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        topk: int,
        ratio: int,
        eps: float,
        *,
        kernels: KernelChoice,
    ) -> None:
        super().__init__(hidden_size, head_dim, ratio, overlap=True, eps=eps, kernels=kernels)
        self._scores = indexer_scores_impl(kernels)
        self._topk = index_topk_impl(kernels)
        self.n_heads = n_heads
        self.topk = topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden_size, n_heads)

    def select(
        self,
        qi: torch.Tensor,
        head_w: torch.Tensor,
        batch: ForwardBatch,
        index_keys: torch.Tensor,
        rope: CompressRope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k visible compressed entries per token, from the index queries
        `qi = q_b_proj(qr)` `[T, Hi * Di]` and head weights `head_w = scorer.weights_proj(x)`
        `[T, Hi]` (computed in the layer's fused projections).

        Returns (the picked entries' pool rows [T, k] int64, valid [T, k] bool); rows of
        invalid picks are 0.
        """
        T = qi.shape[0]
        m = self.ratio
        n_max = batch.max_seq_len // m
        k = min(self.topk, n_max)
        if k == 0 or T == 0:
            z = torch.zeros(T, 0, dtype=torch.int64, device=qi.device)
            return z, z.bool()
        qi = rope.rotate_compress(
            qi.view(T, self.n_heads, self.head_dim), batch.positions, "positions"
        )
        token_slot = batch.token_slots()
        # The head weights' fp32 cast and Hi**-0.5 scale happen inside the scoring.
        scores = self._scores(
            qi,
            head_w,
            index_keys,
            batch.positions,
            token_slot,
            batch.req_to_token,
            m,
            n_max,
            weight_scale=self.n_heads**-0.5,
        )  # [T, N]
        return self._topk(
            scores, visible_entries(batch, m), k, entry_rows=(batch.req_to_token, token_slot, m)
        )


def visible_entries(batch: ForwardBatch, ratio: int) -> torch.Tensor:
    """[T] number of compressed entries token t sees (blocks completed at or before it)."""
    return batch.cached(("visible", ratio), lambda: (batch.positions + 1) // ratio)


def entry_slots(batch: ForwardBatch, n_entries: int, ratio: int) -> torch.Tensor:
    """`entry_pool_rows_ref` of entries 0..n_entries-1 of each token's request `[T, n_entries]`."""

    def compute() -> torch.Tensor:
        ids = torch.arange(n_entries, device=batch.positions.device)[None, :]
        return entry_pool_rows_ref(ids, batch.req_to_token, batch.token_slots(), ratio)

    return batch.cached(("entry_slots", n_entries, ratio), compute)
