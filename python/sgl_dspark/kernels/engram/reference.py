"""Engram's embedding gather in torch: the reference of `gather.py` and the torch path."""

from __future__ import annotations

import torch


def engram_gather_ref(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table `[V, E]`, ids `[T, K]` int (any strides) -> `[T, K * E]` in the table's dtype:
    row t holds the K table rows of ids[t] side by side (the input of the Engram's `wkv`)."""
    return table[ids].flatten(1)


__all__ = ["engram_gather_ref"]
