"""What the model runner and DSpark use from a target model, whichever architecture it is."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from sgl_dspark.srt.configs.model_config import ModelConfig
    from sgl_dspark.srt.layers.rotary import RopeTable
    from sgl_dspark.srt.layers.vocab_parallel import LogitsReader


class Backbone(Protocol):
    """The decoder stack under `model.model`: DSpark embeds draft inputs with its table."""

    embed_tokens: nn.Embedding


class BaseCausalLM(nn.Module, ABC):
    """A causal LM over the paged KV state of its own pool type (`models/registry.py`).

    `forward(batch, pool, backend, tap_layers=(), on_taps=None) -> ModelOutput` runs one flat
    batch (prefill chunks, decode, verify); `tap_streams` of the output carry the hidden-state
    features DSpark reads, in the convention the architecture defines.
    """

    cfg: ModelConfig
    model: Backbone
    lm_head: nn.Linear
    # How a forward's logits rows are read (whole rows or greedy picks; vocab shards under
    # tensor parallelism).
    logits_reader: LogitsReader

    @abstractmethod
    def rope_tables(self, context_len: int) -> tuple[RopeTable, RopeTable]:
        """The ("main", "compress") cos/sin tables of positions 0..context_len-1, built once and
        before any CUDA-graph capture."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[..., V]` of hidden rows `[..., D]`, whole rows on every rank."""

    @abstractmethod
    def compute_shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[..., V / tp]` of hidden rows `[..., D]` over this rank's vocabulary
        shard (`logits_reader.vocab_start` on); no collective. Whole rows on one rank."""
