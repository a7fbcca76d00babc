"""What a model's weights can come from, as the model runner's materialiser reads them
(`model_executor/weights.py`): plain tensors, lazy tensors read or generated straight onto a
device (`LazyTensor`: checkpoint tensors, random tensors), or a factory of lazy tensors for the
built model (`WeightFactory`: random weights of its shapes)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from sgl_dspark.kernels.linear.reference import QuantizedWeight


class LazyTensor(Protocol):
    """A weight read on demand (`loader.CheckpointTensor`, `dummy.DummyTensor`)."""

    shape: tuple[int, ...]
    fmt: str | None  # the stored quantised format ("fp8" / "fp4"), None when plain
    nbytes: int

    def dense(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor on `device` in `dtype` (dequantised when stored quantised)."""
        ...

    def quantized(self, device: torch.device | str) -> QuantizedWeight:
        """The tensor kept as stored, in the runtime layout (`kernels/linear/reference.py`)."""
        ...


WeightSource = torch.Tensor | LazyTensor


class WeightFactory(ABC):
    """Weights that depend on the built model (random weights of its shapes)."""

    @abstractmethod
    def for_model(self, model: nn.Module) -> Iterable[tuple[str, WeightSource]]: ...


__all__ = ["LazyTensor", "WeightFactory", "WeightSource"]
