"""DeepSeek-V4 causal LM for serving: a flat token batch of many requests over paged KV state.

Module and parameter names equal HF transformers' `DeepseekV4ForCausalLM`, so a `save_pretrained`
state dict loads by name. One forward serves prefill, chunked prefill, decode and verify
(see `ForwardBatch` for the batch layout and `DeepseekV4KVPool` for the state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from sgl_dspark.srt.configs.model_config import CSA, HASH_MOE, HCA, SLIDING, ModelConfig
from sgl_dspark.srt.core.forward_batch import ForwardBatch
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.distributed import Communicator, get_parallel_state
from sgl_dspark.srt.distributed.sharding import mark_shard, split_evenly
from sgl_dspark.srt.layers.attention import BaseAttentionBackend
from sgl_dspark.srt.layers.attention.compressor import BlockCompressor, Indexer
from sgl_dspark.srt.layers.fused_linear import LinearGroup, grouped_linear_impl, linear_impl
from sgl_dspark.srt.layers.mhc import (
    HyperConnection,
    HyperHead,
    hc_boundary_impl,
    hc_collapse,
    hc_expand,
    run_fused_hc_layers,
)
from sgl_dspark.srt.layers.moe import RoutedExperts, Router, SharedExpert, SparseMoE
from sgl_dspark.srt.layers.norm import RMSNorm, rms_norm_impl
from sgl_dspark.srt.layers.quantized import mark_quantizable, module_weight, split_rows_into_groups
from sgl_dspark.srt.layers.rotary import (
    RopeTable,
    RopeTailFn,
    rope_impl,
    rope_inv_freq,
    rope_q_kv_impl,
)
from sgl_dspark.srt.layers.vocab_parallel import (
    GreedyPick,
    LogitsReader,
    VocabParallelEmbedding,
    vocab_parallel_head,
)
from sgl_dspark.srt.mem_cache.kv_pool import DeepseekV4KVPool, LayerKV, store_kv_rows
from sgl_dspark.srt.models.base import BaseCausalLM


class RopeTables:
    """cos/sin of both rope types for one batch, plus lookups at other positions."""

    def __init__(
        self, positions: torch.Tensor, main: RopeTable, compress: RopeTable, rope: RopeTailFn
    ) -> None:
        self.compress = compress
        self.tables = {"main": main.lookup(positions), "compress": compress.lookup(positions)}
        self.rope = rope
        self._cache: dict[object, tuple[torch.Tensor, torch.Tensor]] = {
            "positions": self.tables["compress"]
        }

    def rotate_compress(
        self, x: torch.Tensor, positions: torch.Tensor, cache_key: object = None
    ) -> torch.Tensor:
        """Compressor / indexer entries and index queries at their own positions. Callers whose
        positions are a function of the batch alone name them by `cache_key` ("positions" = the
        batch's own), so every layer of one forward shares one lookup."""
        return self.rope(x, *self.compress_table(positions, cache_key))

    def compress_table(
        self, positions: torch.Tensor, cache_key: object = None, shift: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the "compress" rope at `positions - shift` (cached under `cache_key`, see
        above)."""
        table = self._cache.get(cache_key) if cache_key is not None else None
        if table is None:
            table = self.compress.lookup(positions, shift)
            if cache_key is not None:
                self._cache[cache_key] = table
        return table


def mark_head_shards(
    q_b: nn.Linear, o_a: nn.Linear, o_b: nn.Linear, sinks: torch.Tensor, tp_rank: int, tp: int
) -> None:
    """Mark a V4 / V4.1 attention's tensor-parallel slices: q_b and o_a rows (this rank's heads
    and output groups), o_b's input channels, the sinks."""
    mark_shard(q_b.weight, 0, tp_rank, tp)
    mark_shard(o_a.weight, 0, tp_rank, tp)
    mark_shard(o_b.weight, 1, tp_rank, tp)
    mark_shard(sinks, 0, tp_rank, tp)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, kernels: KernelChoice) -> None:
        super().__init__()
        self.kernels = kernels
        self.rope_q_kv = rope_q_kv_impl(kernels)
        self.rms_norm = rms_norm_impl(kernels)
        self.layer_type = cfg.layer_types[layer_id]
        self.rope_kind = "main" if self.layer_type == SLIDING else "compress"
        # Tensor parallelism: this rank runs heads [r * n / tp, (r + 1) * n / tp) and their
        # output groups (q_b and o_a column slices, the sinks sliced, o_b a row slice whose
        # partial outputs are summed); the down projections, KV, compressor and indexer are
        # replicated (one MQA KV head).
        ps = get_parallel_state()
        tp, tp_rank = ps.tp_size, ps.tp_rank
        self.tp: Communicator | None = ps.tp if tp > 1 else None
        self.n_heads = split_evenly(cfg.num_attention_heads, tp, "num_attention_heads", "--tp-size")
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.groups = split_evenly(cfg.o_groups, tp, "o_groups", "--tp-size")
        self.o_rank = cfg.o_lora_rank
        self.q_head_norm = cfg.q_head_norm
        self.eps = cfg.rms_norm_eps
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
        self.compressor: BlockCompressor | None = None
        if self.layer_type in (CSA, HCA):
            m = cfg.compress_ratio(layer_id)
            self.compressor = BlockCompressor(
                d, cfg.head_dim, m, self.layer_type == CSA, cfg.rms_norm_eps, kernels=kernels
            )
            if self.layer_type == CSA:
                self.compressor.indexer = Indexer(
                    d,
                    cfg.q_lora_rank,
                    cfg.index_n_heads,
                    cfg.index_head_dim,
                    cfg.index_topk,
                    m,
                    cfg.rms_norm_eps,
                    kernels=kernels,
                )
        # The projections of the layer input and of the q_a rank, each run as one GEMM once
        # fused (see LinearGroup): x -> q_a, kv, compressor kv/gate, indexer kv/gate/weights;
        # qr -> q_b, indexer q_b.
        comp = self.compressor
        idx: Indexer | None = getattr(comp, "indexer", None)
        x_members = [self.q_a_proj, self.kv_proj]
        qr_members = [self.q_b_proj]
        if comp is not None:
            x_members += [comp.kv_proj, comp.gate_proj]
        if idx is not None:
            x_members += [idx.kv_proj, idx.gate_proj, idx.scorer.weights_proj]
            qr_members.append(idx.q_b_proj)
        self.x_proj = LinearGroup(x_members, kernels)
        self.qr_proj = LinearGroup(qr_members, kernels)
        mark_quantizable(self.o_a_proj, "weight")
        mark_quantizable(self.o_b_proj, "weight")
        self.linear = linear_impl(kernels)
        self.grouped_linear = grouped_linear_impl(kernels)

    def linear_groups(self) -> list[LinearGroup]:
        return [self.x_proj, self.qr_proj]

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_state: LayerKV,
        rope: RopeTables,
        backend: BaseAttentionBackend,
    ) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = rope.tables[self.rope_kind]
        q_a, kv, *comp_in = self.x_proj(x)
        qr = self.rms_norm(q_a, self.q_a_norm.weight, self.q_a_norm.eps)
        q, *index_q = self.qr_proj(qr)
        q = q.view(T, self.n_heads, self.head_dim)
        # One launch rotates q and stores the KV row, both norms inside it (rope_q_kv_impl);
        # a window cache in another dtype (--kv-cache-dtype) stores the rotated rows converted.
        window = kv_state.window
        same_dtype = window.dtype == kv.dtype
        q, rows = self.rope_q_kv(
            q,
            kv,
            cos,
            sin,
            q_norm=(None, self.eps) if self.q_head_norm else None,
            kv_norm=(self.kv_norm.weight, self.kv_norm.eps),
            pool=window if same_dtype else None,
            slots=batch.out_cache_loc if same_dtype else None,
        )
        if rows is not None:
            store_kv_rows(window, batch.out_cache_loc, rows)
        slots, valid, entries = self._compressed_keys(comp_in, index_q, batch, kv_state, rope)
        # Compressed entries are read in place at their pool rows (no [T, N, Dh] gather); the
        # output's rope channels are rotated back inside the backend (the V rope carried into o).
        o = backend.forward(
            q,
            kv_state.window,
            batch,
            self.sinks,
            self.window,
            self.head_dim**-0.5,
            kv_state.compressed,
            valid,
            slots,
            inverse_rope=(cos, sin),
            extra_entries=entries,
        )
        og = o.reshape(T, self.groups, -1)
        wa = split_rows_into_groups(module_weight(self.o_a_proj), self.groups)
        z = self.grouped_linear(og, wa).reshape(T, -1)
        out = self.linear(z, module_weight(self.o_b_proj))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _compressed_keys(
        self,
        comp_in: list[torch.Tensor],
        index_q: list[torch.Tensor],
        batch: ForwardBatch,
        kv_state: LayerKV,
        rope: RopeTables,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[int, int] | None]:
        """The compressed entries each token attends to, as the backend's (extra_slots,
        extra_valid, extra_entries): on CSA layers the indexer's picks (pool rows [T, k], their
        validity [T, k], None), on HCA layers every complete entry (None, None, (N, ratio)),
        on sliding layers nothing. comp_in: this layer's x projections after q_a and kv
        (compressor kv, gate, then the indexer's kv, gate, weights); index_q: [indexer
        q_b(qr)] on CSA layers."""
        comp = self.compressor
        if comp is None:
            return None, None, None
        assert kv_state.compressed is not None and kv_state.comp_state is not None
        m = comp.ratio
        comp.compress(comp_in[0], comp_in[1], batch, kv_state.comp_state, kv_state.compressed, rope)
        if self.layer_type == HCA:
            return None, None, (batch.max_seq_len // m, m)
        indexer: Indexer = comp.indexer  # type: ignore[assignment]
        assert kv_state.index_keys is not None and kv_state.index_state is not None
        indexer.compress(
            comp_in[2], comp_in[3], batch, kv_state.index_state, kv_state.index_keys, rope
        )
        return *indexer.select(index_q[0], comp_in[4], batch, kv_state.index_keys, rope), None


def add_moe_and_mixers(
    layer: nn.Module, cfg: ModelConfig, is_hash: bool, kernels: KernelChoice
) -> None:
    """The parts a V4 block (target layer or DSpark draft stage) has besides attention, under
    their HF names: `mlp` (router + routed + shared experts), the two RMSNorms and the two mHC
    mixers. With a DeepSeek-V4.1 config (`cfg.v41`) the router divides its fp32 logits by the
    gate temperature, a single route keeps its raw score, and each route's weight scales its
    activation before the down projection."""
    d, k, v41 = cfg.hidden_size, cfg.num_experts_per_tok, cfg.v41
    router = Router(
        d,
        cfg.n_routed_experts,
        k,
        cfg.vocab_size,
        is_hash,
        cfg.scoring_func,
        cfg.routed_scaling_factor,
        cfg.norm_topk_prob and (v41 is None or k > 1),
        kernels,
        gate_temp=None if v41 is None else v41.gate_temp,
    )
    layer.mlp = SparseMoE(
        router,
        RoutedExperts(
            cfg.n_routed_experts,
            d,
            cfg.moe_intermediate_size,
            cfg.swiglu_limit,
            kernels,
            weight_before_down=v41 is not None,
        ),
        SharedExpert(d, cfg.moe_intermediate_size, cfg.swiglu_limit, kernels),
        kernels,
    )
    layer.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
    layer.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
    hc = (cfg.hc_mult, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    layer.attn_hc = HyperConnection(*hc)
    layer.ffn_hc = HyperConnection(*hc)


class DecoderLayer(nn.Module):
    # set by add_moe_and_mixers (declared for type checkers)
    mlp: SparseMoE
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    attn_hc: HyperConnection
    ffn_hc: HyperConnection

    def __init__(self, cfg: ModelConfig, layer_id: int, kernels: KernelChoice) -> None:
        super().__init__()
        self.kernels = kernels
        self.self_attn = Attention(cfg, layer_id, kernels)
        add_moe_and_mixers(self, cfg, cfg.mlp_layer_types[layer_id] == HASH_MOE, kernels)

    def forward(
        self,
        streams: torch.Tensor,
        batch: ForwardBatch,
        kv_state: LayerKV,
        rope: RopeTables,
        backend: BaseAttentionBackend,
    ) -> torch.Tensor:
        pre, post, comb = self.attn_hc.coeffs(streams)
        a = self.self_attn(
            self.input_layernorm(hc_collapse(streams, pre)), batch, kv_state, rope, backend
        )
        streams = hc_expand(streams, a, post, comb)
        pre, post, comb = self.ffn_hc.coeffs(streams)
        f = self.mlp(self.post_attention_layernorm(hc_collapse(streams, pre)), batch.input_ids)
        return hc_expand(streams, f, post, comb)


class DeepseekV4Model(nn.Module):
    inv_freq_main: torch.Tensor
    inv_freq_compress: torch.Tensor

    def __init__(self, cfg: ModelConfig, kernels: KernelChoice) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, kernels) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        rd = cfg.qk_rope_head_dim
        self.register_buffer("inv_freq_main", rope_inv_freq(cfg.rope_main, rd), persistent=False)
        self.register_buffer(
            "inv_freq_compress", rope_inv_freq(cfg.rope_compress, rd), persistent=False
        )


def vocab_embedding(vocab: int, dim: int) -> nn.Embedding:
    """The token embedding: whole on one rank, vocabulary-parallel under tensor parallelism."""
    ps = get_parallel_state()
    if ps.tp_size == 1:
        return nn.Embedding(vocab, dim)
    return VocabParallelEmbedding(vocab, dim, ps.tp)


def stream_means(streams: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The hidden-state feature of mHC streams: their mean over `dim` (the stream axis),
    accumulated in fp32 and rounded to the streams' dtype."""
    return streams.float().mean(dim=dim).to(streams.dtype)


@dataclass
class ModelOutput:
    """One forward's logits rows (rows = batch.logits_indices) and tap streams.

    The rows are this rank's: the whole vocabulary on one rank, its vocab shard under tensor
    parallelism. `logits` reads whole rows and `greedy()` greedy picks, both through `reader`
    (`layers/vocab_parallel.py`); a step reads the one its requests need."""

    shard_logits: torch.Tensor  # [N, V / tp] fp32
    # layer id -> [T, n, D]: the mHC streams after the layer, as the layer left them (their
    # mean is only computed where it is read: `hidden_taps`, or DSpark's tap hook)
    tap_streams: dict[int, torch.Tensor]
    reader: LogitsReader
    # Decode graphs also return the greedy choice of every logits row (ids [N] int64 and their
    # log_softmax [N] fp32, `reader.greedy`), so an all-greedy step needs no host sampling.
    greedy_ids: torch.Tensor | None = None
    greedy_logprobs: torch.Tensor | None = None
    _full_logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def logits(self) -> torch.Tensor:
        """Whole rows [N, V] fp32: `shard_logits` itself on one rank; under tensor parallelism
        the ranks' shards, gathered on the first read (a collective: every rank reads it at
        the same point of a step, which the replicated schedule guarantees)."""
        if self._full_logits is None:
            self._full_logits = self.reader.full(self.shard_logits)
        return self._full_logits

    def greedy(self) -> GreedyPick:
        """The greedy id and its logprob of every row, without gathering the rows under
        tensor parallelism (a decode graph's own picks when it returned them)."""
        if self.greedy_ids is not None and self.greedy_logprobs is not None:
            return GreedyPick(self.greedy_ids, self.greedy_logprobs, None)
        return self.reader.greedy(self.shard_logits)

    @property
    def hidden_taps(self) -> dict[int, torch.Tensor]:
        """layer id -> [T, D] mean over the streams after the layer."""
        return {k: stream_means(v) for k, v in self.tap_streams.items()}


class DeepseekV4ForCausalLM(BaseCausalLM):
    """Capabilities used by DSpark: `forward(..., tap_layers=...)` returns per-layer features."""

    model: DeepseekV4Model

    def __init__(self, cfg: ModelConfig, kernels: KernelChoice | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels or KernelChoice()
        self.model = DeepseekV4Model(cfg, self.kernels)
        ps = get_parallel_state()
        # Vocabulary-parallel head under tensor parallelism: a forward returns this rank's
        # logits columns, read whole or as greedy picks through the reader.
        self.lm_head = vocab_parallel_head(cfg.vocab_size, cfg.hidden_size, ps.tp)
        self.logits_reader = LogitsReader(cfg.vocab_size, ps.tp, self.kernels)
        # Bound once here: the compressor/indexer rope and the mHC boundaries.
        self.compress_rope = rope_impl(self.kernels)
        self.hc_boundary = hc_boundary_impl(self.kernels)
        self.rms_norm = rms_norm_impl(self.kernels)
        self.linear = linear_impl(self.kernels)
        self._rope_tables: tuple[RopeTable, RopeTable] | None = None

    def rope_tables(self, context_len: int) -> tuple[RopeTable, RopeTable]:
        """The ("main", "compress") cos/sin tables of positions 0..context_len-1 (every position
        a request of a `context_len`-wide token table can hold), built on first use. The model
        runner builds them before any graph is captured; a capture never builds one."""
        tables = self._rope_tables
        if (
            tables is None
            or tables[0].length < context_len
            or (tables[0].table.device != self.lm_head.weight.device)
        ):
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "rope tables must be built before CUDA-graph capture "
                    "(call rope_tables(context_len) first)"
                )
            m = self.model
            block_starts = tuple(sorted({r - 1 for r in self.cfg.compress_ratios if r > 1}))
            tables = (
                RopeTable(m.inv_freq_main, context_len),
                RopeTable(m.inv_freq_compress, context_len, block_starts),
            )
            self._rope_tables = tables
        return tables

    def forward(
        self,
        batch: ForwardBatch,
        pool: DeepseekV4KVPool,
        backend: BaseAttentionBackend,
        tap_layers: tuple[int, ...] = (),
        on_taps: Callable[[dict[int, torch.Tensor]], None] | None = None,
    ) -> ModelOutput:
        """`on_taps`: called with the tap streams (`ModelOutput.tap_streams`) once the last of
        `tap_layers` has run, before the hyper head and the logits (a consumer of the taps can
        start while those run; nothing is computed for them on the way)."""
        m = self.model
        batch.memo.clear()  # per-forward derived tensors (see ForwardBatch.memo)
        backend.init_forward_metadata(batch)
        x = m.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        rope = RopeTables(
            batch.positions, *self.rope_tables(batch.req_to_token.shape[1]), self.compress_rope
        )
        taps: dict[int, torch.Tensor] = {}

        def tap(i: int, streams: torch.Tensor) -> None:
            if i in tap_layers:
                taps[i] = streams
                if on_taps is not None and len(taps) == len(set(tap_layers)):
                    on_taps(taps)

        if self.hc_boundary is None:
            for i, layer in enumerate(m.layers):
                streams = layer(streams, batch, pool.layers[i], rope, backend)
                tap(i, streams)
            h = self.rms_norm(m.hc_head(streams[batch.logits_indices]), m.norm.weight, m.norm.eps)
        else:
            # The last boundary applies the hyper head and the final norm to every row (one
            # kernel); the logits rows are picked from its output.
            layers = cast("Sequence[DecoderLayer]", m.layers)
            _, head_out = run_fused_hc_layers(
                streams,
                layers,
                lambda i, x: layers[i].self_attn(x, batch, pool.layers[i], rope, backend),
                lambda i, x: layers[i].mlp(x, batch.input_ids),
                self.hc_boundary,
                tap,
                head=(m.hc_head, m.norm),
            )
            assert head_out is not None
            h = head_out[1][batch.logits_indices]
        return ModelOutput(self.compute_shard_logits(h), taps, self.logits_reader)

    def compute_shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[..., V / tp]` of hidden rows `[..., D]` over this rank's vocab shard."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        logits = self.linear(rows, self.lm_head.weight).float()
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[..., V]` of hidden rows `[..., D]` (gathered under tensor
        parallelism)."""
        return self.logits_reader.full(self.compute_shard_logits(hidden))
