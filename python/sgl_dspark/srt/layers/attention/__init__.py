"""Attention backends behind one registry; the server arg `--attention-backend` picks one."""

from __future__ import annotations

from sgl_dspark.srt.layers.attention.base import BaseAttentionBackend
from sgl_dspark.srt.layers.attention.torch_backend import TorchAttentionBackend
from sgl_dspark.srt.layers.attention.triton_backend import TritonAttentionBackend

ATTENTION_BACKENDS: dict[str, type[BaseAttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "triton": TritonAttentionBackend,
}


def create_attention_backend(name: str, batch_invariant: bool = False) -> BaseAttentionBackend:
    """`batch_invariant`: `--enable-deterministic-inference` (the torch backend has no
    batch-invariant form; the server arguments refuse that combination)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; supported: {sorted(ATTENTION_BACKENDS)}"
        )
    if name == "triton":
        return TritonAttentionBackend(batch_invariant)
    return ATTENTION_BACKENDS[name]()


__all__ = ["ATTENTION_BACKENDS", "BaseAttentionBackend", "create_attention_backend"]
