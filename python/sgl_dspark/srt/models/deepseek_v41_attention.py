"""Attention of a DeepSeek-V4.1 layer: MQA with sinks over the sliding window (FP8 window KV) and,
on layers with a compress ratio, over the shared compressed latents at the top-k positions.

Every layer computes its own queries and window KV. A kv source (Full) emits the latents and
index keys of the groups its rows close; an index source (Full or Reindex) selects a top-k from
its own queries and publishes it; a Reuse layer attends the top-k last published for its source.
The candidate source publishes its candidate blocks, which restrict the top-k of later index
sources. What is published lives for one forward (`Csa2Selections`); the latents, index keys and
pending pairs live in the pool (`DeepseekV41KVPool`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sgl_dspark.kernels.attention.reference import window_rows_ref
from sgl_dspark.kernels.indexer.reference import indexer_logits_of_keys_ref
from sgl_dspark.srt.configs.deepseek_v41 import LayerRole
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.forward_batch import ForwardBatch
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.distributed import Communicator, get_parallel_state
from sgl_dspark.srt.distributed.sharding import split_evenly
from sgl_dspark.srt.layers.attention.base import BaseAttentionBackend
from sgl_dspark.srt.layers.attention.compressor import entry_slots, visible_entries
from sgl_dspark.srt.layers.attention.csa2 import (
    Csa2Compressor,
    Csa2Indexer,
    expand_blocks,
    select_candidate_blocks,
    select_topk,
    topk_rows_impl,
    v41_indexer_impl,
)
from sgl_dspark.srt.layers.fused_linear import LinearGroup, grouped_linear_impl, linear_impl
from sgl_dspark.srt.layers.norm import RMSNorm, rms_norm_impl, rms_norm_pair_impl
from sgl_dspark.srt.layers.quant_store import (
    index_query_impl,
    quant_load_impl,
    quant_load_pair_impl,
    quant_store_impl,
)
from sgl_dspark.srt.layers.quantized import mark_quantizable, module_weight, split_rows_into_groups
from sgl_dspark.srt.layers.rotary import rope_q_store_kv_impl
from sgl_dspark.srt.mem_cache.v41_pool import DeepseekV41KVPool, QuantizedRows
from sgl_dspark.srt.models.deepseek_v4 import RopeTables, mark_head_shards


@dataclass
class Csa2Selections:
    """Published within one forward: per kv source, the latest top-k (cache rows `[T, k]`,
    valid `[T, k]`); per candidate source, its candidate blocks `[T, nb]`; and per kv source,
    what its attending layers mask with (the window's validity, then the top-k's), joined once
    per published top-k."""

    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)
    _attended: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def publish_topk(self, source: int, topk: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.topk[source] = topk
        for key in [k for k in self._attended if k[0] == source]:
            del self._attended[key]

    def attended_valid(self, source: int, window_valid: torch.Tensor) -> torch.Tensor:
        """`[T, W + k]`: `window_valid` `[T, W]` (the window rows' validity, one per window
        size in a forward) then the validity of `source`'s latest top-k."""
        key = (source, window_valid.shape[1])
        joined = self._attended.get(key)
        if joined is None:
            joined = torch.cat((window_valid, self.topk[source][1]), dim=1)
            self._attended[key] = joined
        return joined


class Csa2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, kernels: KernelChoice) -> None:
        super().__init__()
        v41 = cfg.v41
        assert v41 is not None
        self.layer_id = layer_id
        self.ratio = v41.compress_ratios[layer_id]
        self.role = v41.role(layer_id)
        self.source = v41.source_of(layer_id)
        self.candidate_of = v41.candidates_of(layer_id)
        self.publishes_candidates = v41.is_candidate_source(layer_id)
        self.candidate_blocks = (v41.candidate_topk_blocks, v41.candidate_block_size)
        self.rope_kind = "main" if self.ratio == 0 else "compress"
        # Tensor parallelism as in V4 (`deepseek_v4.Attention`): this rank runs its slice of
        # the heads and their output groups (q_b and o_a row slices, the sinks sliced, o_b a
        # slice of its input channels whose partial outputs are summed); the down projections,
        # the window KV, the compressor, the indexer and the caches are replicated.
        ps = get_parallel_state()
        tp, tp_rank = ps.tp_size, ps.tp_rank
        self.tp: Communicator | None = ps.tp if tp > 1 else None
        self.n_heads = split_evenly(cfg.num_attention_heads, tp, "num_attention_heads", "--tp-size")
        self.head_dim = cfg.head_dim
        self.window, self.o_rank = cfg.sliding_window, cfg.o_lora_rank
        self.groups = split_evenly(cfg.o_groups, tp, "o_groups", "--tp-size")
        self.q_head_norm, self.eps = cfg.q_head_norm, cfg.rms_norm_eps
        d, hd = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, hd // tp, bias=False)
        self.kv_proj = nn.Linear(d, cfg.head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = nn.Linear(hd // cfg.o_groups, self.groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(self.groups * cfg.o_lora_rank, d, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads))
        mark_head_shards(self.q_b_proj, self.o_a_proj, self.o_b_proj, self.sinks, tp_rank, tp)
        # Stored FP8 as released: kept so with --weight-format native (not fused with others).
        mark_quantizable(self.o_a_proj, "weight")
        mark_quantizable(self.o_b_proj, "weight")
        self.compressor: Csa2Compressor | None = None
        self.indexer: Csa2Indexer | None = None
        x_members, qr_members = [self.q_a_proj, self.kv_proj], [self.q_b_proj]
        if self.role is LayerRole.FULL:
            self.compressor = Csa2Compressor(d, cfg.head_dim, self.ratio, cfg.rms_norm_eps, kernels)
            x_members += self.compressor.projections()
        if self.role in (LayerRole.FULL, LayerRole.REINDEX):
            self.indexer = Csa2Indexer(
                d,
                cfg.q_lora_rank,
                cfg.head_dim,
                cfg.index_n_heads,
                cfg.index_head_dim,
                cfg.index_topk,
                owns_keys=self.role is LayerRole.FULL,
                eps=cfg.rms_norm_eps,
            )
            x_members.append(self.indexer.weights_proj)
            qr_members.append(self.indexer.q_b_proj)
        # One GEMM per input once fused: x -> q_a, kv, compressor kv (+ gate), indexer head
        # weights; qr -> q_b, indexer q_b.
        self.x_proj = LinearGroup(x_members, kernels)
        self.qr_proj = LinearGroup(qr_members, kernels)
        self.rms_norm = rms_norm_impl(kernels)
        self.rms_norm_pair = rms_norm_pair_impl(kernels)
        self.rope_q_store_kv = rope_q_store_kv_impl(kernels)
        self.store_rows = quant_store_impl(kernels)
        self.load_rows = quant_load_impl(kernels)
        self.load_row_pair = quant_load_pair_impl(kernels)
        self.index_queries = index_query_impl(kernels)
        self.index_scores, self.block_max = v41_indexer_impl(kernels)
        self.topk_rows = topk_rows_impl(kernels)
        self.linear = linear_impl(kernels)
        self.grouped_linear = grouped_linear_impl(kernels)

    def linear_groups(self) -> list[LinearGroup]:
        return [self.x_proj, self.qr_proj]

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        pool: DeepseekV41KVPool,
        rope: RopeTables,
        shared: Csa2Selections,
        backend: BaseAttentionBackend,
    ) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = rope.tables[self.rope_kind]
        q_a, kv, *x_rest = self.x_proj(x)
        qr, kv = self.rms_norm_pair(
            (q_a, self.q_a_norm.weight, self.q_a_norm.eps),
            (kv, self.kv_norm.weight, self.kv_norm.eps),
        )
        q, *index_q = self.qr_proj(qr)
        q_norm = (None, self.eps) if self.q_head_norm else None
        window = pool.window[self.layer_id]
        # The KV row rotated and FP8-quantised on store: what every reader (this row included)
        # sees; with the queries' rotation.
        q = self.rope_q_store_kv(
            q.view(T, self.n_heads, self.head_dim),
            cos,
            sin,
            q_norm,
            kv,
            window,
            batch.out_cache_loc,
        )
        # The same window rows for every layer of this window size: computed once a forward.
        slots, valid = batch.cached(
            ("window_rows", self.window),
            lambda: window_rows_ref(
                batch.positions, batch.token_slots(), batch.req_to_token, self.window
            ),
        )
        if self.ratio > 0:
            # The window's keys and the attended latents decoded side by side into one tensor
            # in one launch (no concatenation copy); their validity joined once per published
            # top-k.
            latents, rows = self._compressed(x_rest, index_q, batch, pool, rope, shared)
            w = slots.shape[1]
            keys = torch.empty(
                T, w + rows.shape[1], self.head_dim, dtype=window.dtype, device=x.device
            )
            self.load_row_pair(window, slots, keys[:, :w], latents, rows, keys[:, w:])
            assert self.source is not None  # every compressed layer has one
            valid = shared.attended_valid(self.source, valid)
        else:
            keys = self.load_rows(window, slots)  # [T, W, Dh]
        # The V rope carried into o is undone in the attention's epilogue.
        o = backend.attend_gathered(
            q, keys, valid, self.sinks, self.head_dim**-0.5, inverse_rope=(cos, sin)
        )
        wa = split_rows_into_groups(module_weight(self.o_a_proj), self.groups)
        z = self.grouped_linear(o.reshape(T, self.groups, -1), wa).reshape(T, -1)
        out = self.linear(z, module_weight(self.o_b_proj))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _compressed(
        self,
        x_rest: list[torch.Tensor],
        index_q: list[torch.Tensor],
        batch: ForwardBatch,
        pool: DeepseekV41KVPool,
        rope: RopeTables,
        shared: Csa2Selections,
    ) -> tuple[QuantizedRows, torch.Tensor]:
        """The latent cache of this layer's source and the rows of it this layer attends
        `[T, k]` (their validity is the source's published top-k). x_rest: the x projections
        after q_a and kv (compressor kv (+ gate), then indexer head weights)."""
        assert self.source is not None
        src = pool.sources[self.source]
        if self.compressor is not None:
            n_comp = len(self.compressor.projections())
            comp_in, x_rest = x_rest[:n_comp], x_rest[n_comp:]
            gate = comp_in[1] if n_comp > 1 else None
            groups = self.compressor.emit(comp_in[0], gate, batch, src.pairs, self.rms_norm)
            # Index keys come from the latent before its rotation; both are rotated at the
            # group's first position and quantised on store.
            assert self.indexer is not None
            cos_g, sin_g = rope.compress_table(groups.start_positions.clamp(min=0))
            keys = self.indexer.keys(groups.latents, self.rms_norm, self.linear)
            self.store_rows(keys, cos_g, sin_g, src.index_keys, groups.entry_rows)
            self.store_rows(groups.latents, cos_g, sin_g, src.latents, groups.entry_rows)
        if self.indexer is not None:
            shared.publish_topk(
                self.source, self._select(index_q[0], x_rest[0], batch, pool, rope, shared)
            )
        rows, _ = shared.topk[self.source]
        return src.latents, rows

    def _select(
        self,
        qi: torch.Tensor,
        head_w: torch.Tensor,
        batch: ForwardBatch,
        pool: DeepseekV41KVPool,
        rope: RopeTables,
        shared: Csa2Selections,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This index source's top-k (cache rows, valid), from its queries `qi` `[T, Hi * Di]`
        and head weights `head_w` `[T, Hi]`."""
        assert self.indexer is not None and self.source is not None
        m, T = self.ratio, qi.shape[0]
        n_max = batch.max_seq_len // m
        k = min(self.indexer.topk, n_max)
        if k == 0 or T == 0:
            z = torch.zeros(T, 0, dtype=torch.int64, device=qi.device)
            return z, z.bool()
        # Rotated at the token's position and FP4-quantised as the index keys are.
        cos_q, sin_q = rope.compress_table(batch.positions, "positions")
        qi = self.index_queries(
            qi.view(T, self.indexer.n_heads, self.indexer.index_dim), cos_q, sin_q
        )
        blocks, size = self.candidate_blocks
        keep = shared.candidates[self.candidate_of] if self.candidate_of is not None else None
        visible = visible_entries(batch, m)
        rows = entry_slots(batch, n_max, m)
        cache = pool.sources[self.source].index_keys
        weight_scale = self.indexer.n_heads**-0.5
        if cache.packed:
            assert cache.scales is not None
            scores = self.index_scores(
                qi,
                head_w,
                cache.data,
                cache.scales,
                rows,
                visible,
                weight_scale=weight_scale,
                keep_blocks=keep,
                block=size,
            )
        else:  # index keys its quantiser leaves as they are
            scores = indexer_logits_of_keys_ref(
                qi,
                head_w,
                self.load_rows(cache, rows),
                batch.positions,
                m,
                weight_scale=weight_scale,
            )
            if keep is not None:
                hidden = ~expand_blocks(keep, size, scores.shape[1])
                scores = scores.masked_fill(hidden, float("-inf"))
        if self.publishes_candidates:
            shared.candidates[self.layer_id] = select_candidate_blocks(
                scores, visible, blocks, size, self.block_max
            )
        return select_topk(scores, k, batch, m, self.topk_rows)
