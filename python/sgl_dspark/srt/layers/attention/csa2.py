"""DeepSeek-V4.1 compressed attention (CSA2): the compressor of a kv source, the indexer of an
index source, the two-level candidate-block restriction and the top-k selection.

Compressor (ratio m in {1, 2}, no overlap, no position bias): group g covers positions
[g*m, (g+1)*m) and is emitted by the token at its last position. m = 1: the latent of token t is
`norm(x_t @ wkv^T)`; m = 2: per channel, a softmax over the group's two gate scores weights the
two kv rows (fp32), rounded to the model dtype before the norm. The latent is returned before
RoPE: the index keys are derived from it first, then it is rotated at the group's first
position and quantised into the source's cache.

Indexer: queries `fp4(rope(qr @ wq_b^T))` per head, head weights `(x @ weights_proj^T) / sqrt(Hi)`,
keys `fp4(rope(norm(latent @ wk^T)))` (kv sources own `wk`; Reindex layers score their source's
keys); `score[t, g] = sum_h w[t, h] * relu(q[t, h] . K_g) / sqrt(Di)` over the groups visible to
t (g < (pos_t + 1) // m).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from sgl_dspark.kernels.compressor.reference import (
    PairGroups,
    csa2_pair_groups_ref,
    csa2_pair_pool_ref,
    topk_entry_rows_ref,
    topk_lower_index_first,
)
from sgl_dspark.kernels.indexer.reference import candidate_block_max_ref, v41_index_scores_ref
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.norm import RMSNorm, RmsNormFn
from sgl_dspark.srt.layers.quantized import WeightLike, module_weight
from sgl_dspark.srt.mem_cache.v41_pool import PairState


class EmittedGroups(NamedTuple):
    """Groups closed by this batch: pre-RoPE latents `[n, Dh]`, their first positions `[n]`,
    and the cache rows they go to `[n]` (the dummy row 0 for rows that close no group)."""

    latents: torch.Tensor
    start_positions: torch.Tensor
    entry_rows: torch.Tensor


# (kv, score, ring kv, ring score, positions, token slots, token prefixes, req_to_token) ->
# `PairGroups`, the ring recorded in place: `csa2_pair_pool_ref`'s arguments
PairPoolFn = Callable[..., PairGroups]


def pair_pool_impl(kernels: KernelChoice) -> PairPoolFn:
    """The ratio-2 compressor's decode / verify step (pooled groups, their pool rows, the ring
    recorded), of the "indexer" family. torch: `csa2_pair_pool_ref` (some fifty kernels).
    triton: `kernels/compressor/pair_pool.py::csa2_pair_pool`, one launch; the same addressing
    and ring, the pooled rows within a tolerance (its `exp`)."""
    if kernels.of("indexer") == "torch":
        return csa2_pair_pool_ref
    from sgl_dspark.kernels.compressor.pair_pool import csa2_pair_pool

    return csa2_pair_pool


class Csa2Compressor(nn.Module):
    """`kv_proj` (wkv), `gate_proj` (wgate, ratio > 1 only), `kv_norm` (norm)."""

    def __init__(
        self, hidden_size: int, head_dim: int, ratio: int, eps: float, kernels: KernelChoice
    ) -> None:
        super().__init__()
        assert ratio in (1, 2), ratio
        self.ratio = ratio
        self.kv_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.gate_proj = nn.Linear(hidden_size, head_dim, bias=False) if ratio > 1 else None
        self.kv_norm = RMSNorm(head_dim, eps)
        self.pair_pool = pair_pool_impl(kernels)

    def projections(self) -> list[nn.Linear]:
        """The layer-input projections this compressor reads, in `emit`'s argument order."""
        return [self.kv_proj] if self.gate_proj is None else [self.kv_proj, self.gate_proj]

    def emit(
        self,
        kv: torch.Tensor,
        score: torch.Tensor | None,
        batch: ForwardBatch,
        pairs: PairState | None,
        rms_norm: RmsNormFn,
    ) -> EmittedGroups:
        """The groups closed by this batch, then (ratio 2) this batch's raw rows recorded in the
        pending-pair ring. kv / score: `kv_proj(x)` / `gate_proj(x)` `[T, Dh]`."""
        norm = (self.kv_norm.weight, self.kv_norm.eps)
        if self.ratio == 1:
            rows = batch.out_cache_loc
            return EmittedGroups(rms_norm(kv, *norm), batch.positions, rows)
        assert score is not None and pairs is not None
        m, pos, slot = self.ratio, batch.positions, batch.token_slots()
        if batch.mode is not ForwardMode.EXTEND:
            # Decode/verify (few rows): a candidate for every row, written only where a group
            # closes (other rows write to the dummy row 0), so nothing reads the device.
            groups = self.pair_pool(
                kv,
                score,
                pairs.kv,
                pairs.score,
                pos,
                slot,
                batch.token_prefix_lens(),
                batch.req_to_token,
            )
            return EmittedGroups(
                rms_norm(groups.pooled, *norm), groups.start_positions, groups.entry_rows
            )
        # The rows that close a group (a prefill graph's list is -1 padded: those compute a
        # latent from row 0 and write it to the dummy row 0). All reads of the ring happen
        # before this batch's rows are recorded in it.
        ends = batch.block_end_rows(m)
        real = ends >= 0 if not batch.host_lens else None
        groups = csa2_pair_groups_ref(
            kv,
            score,
            pairs.kv,
            pairs.score,
            ends.clamp(min=0),
            pos,
            slot,
            batch.token_prefix_lens(),
            batch.req_to_token,
        )
        rows = groups.entry_rows
        if real is not None:
            rows = torch.where(real, rows, torch.zeros_like(rows))
        self._record(kv, score, batch, pairs)
        return EmittedGroups(rms_norm(groups.pooled, *norm), groups.start_positions, rows)

    @staticmethod
    def _record(
        kv: torch.Tensor, score: torch.Tensor, batch: ForwardBatch, pairs: PairState
    ) -> None:
        """A prefill's rows into the ring: only the last `ring` positions of each request are
        kept (no collisions). (A decode/verify request has fewer rows than the ring, sized from
        the runner's max_verify_tokens: the pair pool records every row.)"""
        pos, slot = batch.positions, batch.token_slots()
        keep = batch.last_rows(pairs.ring)
        real = keep >= 0 if not batch.host_lens else None
        keep = keep.clamp(min=0)
        pos, slot, kv, score = pos[keep], slot[keep], kv[keep], score[keep]
        if real is not None:  # padding entries write to the dummy request slot 0
            slot = torch.where(real, slot, torch.zeros_like(slot))
        idx = pos.remainder(pairs.ring)
        pairs.kv[slot, idx] = kv.float()
        pairs.score[slot, idx] = score.float()


class Csa2Indexer(nn.Module):
    """`q_b_proj` (wq_b), `weights_proj`; with `owns_keys` (a kv source) also `k_proj` (wk) and
    `k_norm`."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        head_dim: int,
        n_heads: int,
        index_dim: int,
        topk: int,
        owns_keys: bool,
        eps: float,
    ) -> None:
        super().__init__()
        self.n_heads, self.index_dim, self.topk = n_heads, index_dim, topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * index_dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)
        self.k_proj = nn.Linear(head_dim, index_dim, bias=False) if owns_keys else None
        self.k_norm = RMSNorm(index_dim, eps) if owns_keys else None

    def keys(
        self,
        latents: torch.Tensor,
        rms_norm: RmsNormFn,
        linear: Callable[[torch.Tensor, WeightLike], torch.Tensor],
    ) -> torch.Tensor:
        """Index keys `[n, Di]` of pre-RoPE latents, normalised, before their rotation (at the
        group's first position) and quantisation, which the store applies. `linear`: the
        "linear" family's (`fused_linear.linear_impl`)."""
        assert self.k_proj is not None and self.k_norm is not None
        k = linear(latents, module_weight(self.k_proj))
        return rms_norm(k, self.k_norm.weight, self.k_norm.eps)


# (scores [T, N], visible [T], block) -> block scores [T, ceil(N / block)], newest pinned
BlockMaxFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
# (qi, head weights, key data, key scales, entry rows, visible, *, weight_scale, keep_blocks,
# block) -> scores [T, N]: `v41_index_scores_ref`'s arguments
IndexScoresFn = Callable[..., torch.Tensor]


# (scores [T, N], k, req_to_token, token slots [T], ratio) -> (pool rows [T, k], 0 where
# dropped; valid [T, k]): `topk_entry_rows_ref`'s arguments
TopkRowsFn = Callable[
    [torch.Tensor, int, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]
]


def topk_rows_impl(kernels: KernelChoice) -> TopkRowsFn:
    """An index source's top-k selection as pool rows and validity, of the "indexer" family.
    torch: `topk_entry_rows_ref` (a stable sort, then the addressing: some ten kernels).
    triton: `kernels/compressor/entry_rows.py::topk_entry_rows`, the sort and the addressing in
    one launch for rows of up to `TOPK_SORT_MAX` entries (longer ones: the sort, then one
    launch); the same integers."""
    if kernels.of("indexer") == "torch":
        return topk_entry_rows_ref
    from sgl_dspark.kernels.compressor.entry_rows import topk_entry_rows

    return topk_entry_rows


def v41_indexer_impl(kernels: KernelChoice) -> tuple[IndexScoresFn, BlockMaxFn]:
    """The "indexer" family of DeepSeek-V4.1: the scores of a kv source's packed FP4 index keys
    (masks applied) and the candidate source's block scores. torch: `v41_index_scores_ref`,
    `candidate_block_max_ref`. triton: `kernels/indexer/v41_logits.py`, one launch each (scores
    within a tolerance, block scores bit-exact)."""
    if kernels.of("indexer") == "torch":
        return v41_index_scores_ref, candidate_block_max_ref
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.indexer.v41_logits import candidate_block_max, v41_index_scores

    return v41_index_scores, candidate_block_max


def select_candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int, block_max: BlockMaxFn
) -> torch.Tensor:
    """`[T, ceil(N / block)]` bool: each row's candidate blocks of `block` compressed positions.

    Blocks are scored by their best visible score; the block holding the newest visible position
    (`visible - 1`) is always kept (`block_max` pins it); then the best `topk_blocks` blocks
    with a finite score (ties to the lower block). scores `[T, N]` fp32 (-inf where not
    visible), visible `[T]`.
    """
    rows, width = scores.shape
    if width == 0:
        return torch.zeros(rows, 0, dtype=torch.bool, device=scores.device)
    ranked = block_max(scores, visible, block)
    values, indices = topk_lower_index_first(ranked, min(topk_blocks, ranked.shape[1]))
    keep = torch.zeros_like(ranked, dtype=torch.bool)
    return keep.scatter_(1, indices, values > float("-inf"))


def expand_blocks(keep: torch.Tensor, block: int, width: int) -> torch.Tensor:
    """Block mask `[T, nb]` -> position mask `[T, width]`."""
    return keep.repeat_interleave(block, dim=1)[:, :width]


def select_topk(
    scores: torch.Tensor, k: int, batch: ForwardBatch, ratio: int, topk_rows: TopkRowsFn
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` best entries of every row (ties to the lower entry), dropping picks scored -inf:
    (their cache rows `[T, k]`, 0 where dropped; valid `[T, k]`)."""
    return topk_rows(scores, k, batch.req_to_token, batch.token_slots(), ratio)


__all__ = [
    "Csa2Compressor",
    "Csa2Indexer",
    "EmittedGroups",
    "expand_blocks",
    "topk_rows_impl",
    "select_candidate_blocks",
    "select_topk",
    "topk_lower_index_first",
    "v41_indexer_impl",
]
