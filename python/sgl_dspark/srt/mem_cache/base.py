"""What the model runner and DSpark use from a model's KV pool."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sgl_dspark.srt.configs.model_config import ModelConfig


class BaseKVPool(ABC):
    """Device state of every layer, addressed by token slot (`ReqToTokenPool`) and request
    slot; `num_slots` token slots in all."""

    num_slots: int

    @staticmethod
    @abstractmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> float:
        """Device bytes per token slot, for sizing the pool."""
