"""Engram in torch: the references of `gather.py` and `gate.py`, and the torch path."""

from __future__ import annotations

import torch

from sgl_dspark.kernels.linear.reference import QuantizedWeight, dequantize_weight_ref

GATE_FLOOR = 1e-6  # |dot| floor inside the signed square root (a zero dot gates at sigmoid(1e-3))


def engram_gather_ref(
    table: torch.Tensor | QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """table `[V, E]`, ids `[T, K]` int (any strides) -> `[T, K * E]`: row t holds the K table
    rows of ids[t] side by side (the input of the Engram's `wkv`). A plain table's rows keep its
    dtype; an FP8 table kept as released (`QuantizedWeight`, one scale row per row) has only
    the selected rows dequantised, to `dtype` (default bf16): the same values as dequantising
    the whole table first, since dequantisation is elementwise."""
    if not isinstance(table, QuantizedWeight):
        return table[ids].flatten(1)
    rows = table._replace(data=table.data[ids], scale=table.scale[ids])
    return dequantize_weight_ref(rows, dtype or torch.bfloat16).flatten(1)


def engram_gate_ref(
    streams: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The Engram's gated add, all in fp32 (DeepSeek-V4.1's order of operations).

    Args:
        streams: `[T, n, D]` mHC streams.
        kv: `[T, (n + 1) * D]` the `wkv` output: one key per stream, then the shared value.
        q_weight, k_weight: `[n, D]`.
        eps: added to each mean square (stream and key normalised on their own).
    Returns:
        `[T, n, D]` in streams' dtype: stream j plus `sigmoid(signed_sqrt(dot_j)) * value`, where
        dot_j is the sum over D of `s_j * (q_j * k_j) * key_j`, times both rstds and `D ** -0.5`.
    """
    t, n, d = streams.shape
    kv = kv.float()
    key, value = kv[:, : n * d].view(t, n, d), kv[:, n * d :]
    s = streams.float()
    rstd = torch.rsqrt(s.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps)
    wqk = (q_weight.float() * k_weight.float())[None]
    dot = (s * wqk * key).sum(-1) * rstd * d**-0.5  # [T, n]
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=GATE_FLOOR).sqrt(), dot))
    return (s + gate[:, :, None] * value[:, None, :]).to(streams.dtype)


__all__ = ["GATE_FLOOR", "engram_gate_ref", "engram_gather_ref"]
