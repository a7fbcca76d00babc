"""DeepSeek-V4.1 causal LM for serving: a flat token batch of many requests over paged KV state
(`DeepseekV41KVPool`), one forward for prefill, chunked prefill, decode and verify.

Over V4: single-pass mHC (each sublayer's input is collapsed with the previous site's `pre`,
the first with stream 0, the final norm's with the last FFN's; no hyper head); no per-head q
norm; CSA2 attention with shared latents, reused top-k and candidate blocks
(`deepseek_v41_attention.py`); Engram before its layers; MoE routed with a temperature, no hash
layers, each route's weight applied before the down projection; the QAT quantisers on the window
KV, latents and indexer q/k. Parameter names follow V4's module layout (`model.layers.{i}.
self_attn...`); `model_loader/name_mapping.py` maps the released / HF names onto them.

Hidden-state taps (`tap_layers`) are the streams entering a layer's attention (after its
Engram), V4.1's DSpark feature convention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.forward_batch import ForwardBatch
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.distributed import get_parallel_state
from sgl_dspark.srt.layers.attention import BaseAttentionBackend
from sgl_dspark.srt.layers.engram import Engram, ngram_history
from sgl_dspark.srt.layers.fused_linear import linear_impl
from sgl_dspark.srt.layers.mhc import HyperConnection, hc_boundary_impl, run_single_pass_layers
from sgl_dspark.srt.layers.moe import SparseMoE
from sgl_dspark.srt.layers.norm import RMSNorm, rms_norm_impl
from sgl_dspark.srt.layers.rotary import RopeTable, rope_impl, rope_inv_freq
from sgl_dspark.srt.layers.vocab_parallel import LogitsReader, vocab_parallel_head
from sgl_dspark.srt.mem_cache.v41_pool import DeepseekV41KVPool
from sgl_dspark.srt.models.base import BaseCausalLM
from sgl_dspark.srt.models.deepseek_v4 import (
    ModelOutput,
    RopeTables,
    add_moe_and_mixers,
    vocab_embedding,
)
from sgl_dspark.srt.models.deepseek_v41_attention import Csa2Attention, Csa2Selections


def check_runtime(cfg: ModelConfig, kernels: KernelChoice, attention_backend: str) -> None:
    """Refuse, at startup, implementations that do not compute V4.1 (ValueError naming the
    argument to change). Every kernel family has V4.1's math on both backends; the attention
    reads the quantised caches itself and hands the gathered keys to the backend's
    `attend_gathered` (torch or triton)."""
    del cfg, kernels
    if attention_backend not in ("torch", "triton"):
        raise ValueError(
            f"--attention-backend {attention_backend!r}: DeepSeek-V4.1 runs on the torch or "
            "the triton attention"
        )


class DecoderLayer(nn.Module):
    # set by add_moe_and_mixers (declared for type checkers)
    mlp: SparseMoE
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    attn_hc: HyperConnection
    ffn_hc: HyperConnection

    def __init__(self, cfg: ModelConfig, layer_id: int, kernels: KernelChoice) -> None:
        super().__init__()
        v41 = cfg.v41
        assert v41 is not None
        self.engram: Engram | None = None
        if v41.engram is not None and layer_id in v41.engram.layer_ids:
            index = v41.engram.layer_ids.index(layer_id)
            self.engram = Engram(
                v41.engram, index, cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps, kernels
            )
        self.self_attn = Csa2Attention(cfg, layer_id, kernels)
        add_moe_and_mixers(self, cfg, False, kernels)


class DeepseekV41Model(nn.Module):
    inv_freq_main: torch.Tensor
    inv_freq_compress: torch.Tensor
    engram_token_map: torch.Tensor

    def __init__(self, cfg: ModelConfig, kernels: KernelChoice) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, kernels) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        rd = cfg.qk_rope_head_dim
        self.register_buffer("inv_freq_main", rope_inv_freq(cfg.rope_main, rd), persistent=False)
        self.register_buffer(
            "inv_freq_compress", rope_inv_freq(cfg.rope_compress, rd), persistent=False
        )
        if cfg.v41 is not None and cfg.v41.engram is not None:
            # Compressed id of every token id (`tokenizer/engram_map.py`), loaded with the
            # weights from the model's tokenizer.
            token_map = torch.zeros(cfg.vocab_size, dtype=torch.int64)
            self.register_buffer("engram_token_map", token_map)


class DeepseekV41ForCausalLM(BaseCausalLM):
    model: DeepseekV41Model

    def __init__(self, cfg: ModelConfig, kernels: KernelChoice | None = None) -> None:
        super().__init__()
        assert cfg.v41 is not None, "DeepseekV41ForCausalLM needs a DeepSeek-V4.1 config"
        self.cfg = cfg
        self.kernels = kernels or KernelChoice()
        self.model = DeepseekV41Model(cfg, self.kernels)
        ps = get_parallel_state()
        # Vocabulary-parallel head under tensor parallelism (as V4's): a forward returns this
        # rank's logits columns, read whole or as greedy picks through the reader.
        self.lm_head = vocab_parallel_head(cfg.vocab_size, cfg.hidden_size, ps.tp)
        self.logits_reader = LogitsReader(cfg.vocab_size, ps.tp, self.kernels)
        self.compress_rope = rope_impl(self.kernels)
        self.hc_boundary = hc_boundary_impl(self.kernels)
        self.rms_norm = rms_norm_impl(self.kernels)
        self.linear = linear_impl(self.kernels)
        self._rope_tables: tuple[RopeTable, RopeTable] | None = None

    def rope_tables(self, context_len: int) -> tuple[RopeTable, RopeTable]:
        tables = self._rope_tables
        device = self.lm_head.weight.device
        if tables is None or tables[0].length < context_len or tables[0].table.device != device:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("rope tables must be built before CUDA-graph capture")
            m = self.model
            tables = (
                RopeTable(m.inv_freq_main, context_len),
                RopeTable(m.inv_freq_compress, context_len),
            )
            self._rope_tables = tables
        return tables

    def forward(
        self,
        batch: ForwardBatch,
        pool: DeepseekV41KVPool,
        backend: BaseAttentionBackend,
        tap_layers: tuple[int, ...] = (),
        on_taps: Callable[[dict[int, torch.Tensor]], None] | None = None,
    ) -> ModelOutput:
        """The attention reads the quantised caches itself and `backend` attends the gathered
        keys. `on_taps` runs once the last of `tap_layers` is collected."""
        m, n = self.model, self.cfg.hc_mult
        batch.memo.clear()  # per-forward derived tensors (see ForwardBatch.memo)
        backend.init_forward_metadata(batch)
        streams = m.embed_tokens(batch.input_ids).unsqueeze(1).expand(-1, n, -1).contiguous()
        rope = RopeTables(
            batch.positions, *self.rope_tables(batch.req_to_token.shape[1]), self.compress_rope
        )
        history = self._engram_history(batch, pool)
        shared = Csa2Selections()
        layers = cast("Sequence[DecoderLayer]", m.layers)
        taps: dict[int, torch.Tensor] = {}

        def before_layer(i: int, streams: torch.Tensor) -> torch.Tensor:
            engram = layers[i].engram
            if engram is not None:
                assert history is not None
                streams = engram(streams, history)
            if i in tap_layers:
                taps[i] = streams
                if on_taps is not None and len(taps) == len(set(tap_layers)):
                    on_taps(taps)
            return streams

        _, h = run_single_pass_layers(
            streams,
            layers,
            lambda i, x: layers[i].self_attn(x, batch, pool, rope, shared, backend),
            lambda i, x: layers[i].mlp(x, batch.input_ids),
            self.hc_boundary,
            (m.norm, self.rms_norm),
            before_layer,
            rewrites={i for i, layer in enumerate(layers) if layer.engram is not None},
            rows=batch.logits_indices,
        )
        return ModelOutput(self.compute_shard_logits(h), taps, self.logits_reader)

    def _engram_history(self, batch: ForwardBatch, pool: DeepseekV41KVPool) -> torch.Tensor | None:
        """`[T, N]` compressed ids of every row's n-gram history, after recording this batch's
        ids at their token slots (rows of a rejected verify are rewritten when real tokens
        reach their positions, before anything later reads them)."""
        engram = self.cfg.v41.engram if self.cfg.v41 is not None else None
        if engram is None:
            return None
        assert pool.token_ids is not None
        pool.token_ids[batch.out_cache_loc] = batch.input_ids
        raw = ngram_history(batch, pool.token_ids, engram.max_ngram_size, engram.pad_id)
        return self.model.engram_token_map[raw]

    def compute_shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[..., V / tp]` of hidden rows `[..., D]` over this rank's vocab shard."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        logits = self.linear(rows, self.lm_head.weight).float()
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[..., V]` of hidden rows `[..., D]` (gathered under tensor
        parallelism)."""
        return self.logits_reader.full(self.compute_shard_logits(hidden))


__all__ = ["DeepseekV41ForCausalLM", "check_runtime"]
