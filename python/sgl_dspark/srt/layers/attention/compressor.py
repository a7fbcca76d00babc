"""KV compressors of CSA/HCA layers and the lightning indexer (spec §5.3–§5.5, §5.9).

Both compress blocks of m consecutive tokens into one entry by a per-channel softmax over the
block's gate scores. CSA ("overlap") entries mix the previous block's first-half channels (Ca)
with this block's second-half channels (Cb), 2m slots in all. Entries are emitted when the token
that completes a block is processed; rows of earlier forwards come from the request's state ring.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sgl_dspark.srt.layers.norm import RMSNorm
from sgl_dspark.srt.mem_cache.kv_pool import CompressorState
from sgl_dspark.srt.model_executor.forward_batch import ForwardBatch, ForwardMode

RopeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [N, d], positions [N]) -> x


class BlockCompressor(nn.Module):
    """Parameters `kv_proj`, `gate_proj`, `position_bias`, `kv_norm` (HF names)."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, overlap: bool,
                 eps: float) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim = head_dim
        self.ratio = ratio
        self.overlap = overlap
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(head_dim, eps)

    def compress(self, x: torch.Tensor, batch: ForwardBatch, state: CompressorState,
                 entries: torch.Tensor, rope: RopeFn) -> None:
        """Emit the entries of every block completed by this batch into `entries`, then record
        this batch's raw rows in the state ring."""
        kv = self.kv_proj(x)
        score = self.gate_proj(x)
        m, d, ring = self.ratio, self.head_dim, state.ring
        pos = batch.positions
        is_end = (pos + 1) % m == 0
        write_mask = None
        if batch.mode is ForwardMode.EXTEND:
            # Prefill: compute only the completed blocks (a host read is fine outside decode).
            ends = torch.nonzero(is_end).squeeze(1)
        else:
            # Decode/verify (few rows): a candidate entry for every row, written only where a block
            # ends (other rows write to the reserved dummy entry 0): no host synchronisation.
            ends = torch.arange(pos.shape[0], device=pos.device)
            write_mask = is_end
        slot_tok = batch.req_pool_indices[batch.token_req]
        if ends.numel() > 0:
            span = 2 * m if self.overlap else m
            rel = torch.arange(span, device=pos.device) - (span - 1)
            q = pos[ends, None] + rel[None, :]                       # absolute row positions
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
            entry = rope(entry, start)
            entry_slot = batch.req_to_token[slot_tok[ends], start.clamp(min=0)] // m
            if write_mask is not None:
                entry_slot = torch.where(write_mask, entry_slot, torch.zeros_like(entry_slot))
            entries[entry_slot] = entry.to(entries.dtype)
        # Only the last `ring` positions of each request are kept, so no two rows of one
        # request collide in this write.
        if batch.mode is ForwardMode.EXTEND:
            keep = pos >= batch.seq_lens[batch.token_req] - ring
            pos, slot_tok, kv, score = pos[keep], slot_tok[keep], kv[keep], score[keep]
        # else: a decode/verify request has fewer new rows than the ring (asserted by the runner's
        # max_verify_tokens), so every row is kept and no boolean mask (a host sync) is needed.
        ridx = pos.remainder(ring)
        state.kv[slot_tok, ridx] = kv.to(state.kv.dtype)
        state.score[slot_tok, ridx] = score.to(state.score.dtype)


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)


class Indexer(BlockCompressor):
    """Lightning indexer: its own overlapping compressor over index keys, plus query scoring."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int,
                 topk: int, ratio: int, eps: float) -> None:
        super().__init__(hidden_size, head_dim, ratio, overlap=True, eps=eps)
        self.n_heads = n_heads
        self.topk = topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden_size, n_heads)

    def select(self, x: torch.Tensor, qr: torch.Tensor, batch: ForwardBatch,
               index_keys: torch.Tensor, rope: RopeFn) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k visible compressed entries per token.

        Returns (entry_ids [T, k] int64, valid [T, k] bool); ids of invalid picks are 0.
        """
        T = x.shape[0]
        m = self.ratio
        n_max = batch.max_seq_len // m
        k = min(self.topk, n_max)
        if k == 0 or T == 0:
            z = torch.zeros(T, 0, dtype=torch.int64, device=x.device)
            return z, z.bool()
        qi = self.q_b_proj(qr).view(T, self.n_heads, self.head_dim)
        qi = rope(qi, batch.positions)
        w = self.scorer.weights_proj(x).float() * self.n_heads**-0.5        # [T, Hi]
        keys = gather_entries(index_keys, batch, n_max, m)                    # [T, N, Di]
        scores = torch.einsum("thd,tnd->thn", qi.float(), keys.float())
        scores = torch.relu(scores) * self.head_dim**-0.5
        scores = (scores * w.unsqueeze(-1)).sum(dim=1)                         # [T, N]
        visible = (batch.positions + 1) // m
        entry_ids = torch.arange(n_max, device=x.device)
        scores = scores.masked_fill(entry_ids[None, :] >= visible[:, None], float("-inf"))
        top = scores.topk(k, dim=-1).indices
        valid = top < visible[:, None]
        return torch.where(valid, top, torch.zeros_like(top)), valid


def entry_slots(batch: ForwardBatch, n_entries: int, ratio: int) -> torch.Tensor:
    """Pool rows `[T, n_entries]` of entries 0..n_entries-1 of each token's request (rows of
    entries beyond the request's length point at garbage and must be masked by the caller)."""
    w = torch.arange(n_entries, device=batch.positions.device) * ratio
    slot = batch.req_pool_indices[batch.token_req]
    w = w.clamp(max=batch.req_to_token.shape[1] - 1)
    return batch.req_to_token[slot[:, None], w[None, :]] // ratio


def gather_entries(entries: torch.Tensor, batch: ForwardBatch, n_entries: int,
                   ratio: int) -> torch.Tensor:
    return entries[entry_slots(batch, n_entries, ratio)]
