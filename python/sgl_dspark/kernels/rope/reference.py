"""Interleaved RoPE on the trailing channels of each head, in torch: the reference of the "rope"
kernel family (`tail.py`, `q_kv.py`, `epilogue.py`).

DeepSeek-V4 layout: a head of D channels is ``[nope (D - rd) | rope (rd)]``; inside the rope tail
the pairs are interleaved, pair i = channels (D - rd + 2i, D - rd + 2i + 1):
    x'[2i]   = a * cos_i - b * sin_i
    x'[2i+1] = a * sin_i + b * cos_i          (a = x[2i], b = x[2i+1], fp32 maths)
The inverse rotation (attention output) uses -sin. The nope channels are copied bit for bit; the
rotated tail is rounded once to the input dtype (round-to-nearest-even). An optional pre-norm
RMS-normalises each (token, head) row of D channels first (`rms_norm_ref`).
"""

from __future__ import annotations

import torch

from sgl_dspark.kernels.norm.reference import rms_norm_ref


def rope_tail_ref(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    out_heads: int | None = None,
    norm_eps: float | None = None,
    norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the trailing ``rd = 2 * cos.shape[1]`` channels of every head (module doc).

    Args:
        x: [M, ..., D] bf16/fp16/fp32 (usually [M, H, D], heads of D channels; [M, D] is one
            head per row).
        cos, sin: fp32 [M, rd/2], row m at token m's position (broadcast over the heads).
        inverse: rotate by -angle.
        out_heads: heads of the result, x [M, H, D] only: heads past H are zeros, heads past
            it are dropped.
        norm_eps: first apply `rms_norm_ref(x, norm_weight, norm_eps)` to every (token, head)
            row of D channels (norm_weight [D] or None for the weightless norm), i.e. the
            composition RMSNorm -> rope. Not with ``inverse``.
    Returns:
        x's shape (H replaced by out_heads) in x's dtype.
    """
    if norm_eps is not None:
        if inverse:
            raise ValueError("norm_eps (pre-norm) is not supported with inverse=True")
        x = rms_norm_ref(x, norm_weight, norm_eps)
    elif norm_weight is not None:
        raise ValueError("norm_weight needs norm_eps")
    num_tokens, head_dim = x.shape[0], x.shape[-1]
    rope_dim = 2 * cos.shape[1]
    a = x[..., head_dim - rope_dim :: 2].float()
    b = x[..., head_dim - rope_dim + 1 :: 2].float()
    per_row = (num_tokens,) + (1,) * (x.dim() - 2) + (cos.shape[1],)  # broadcast over heads
    c, s = cos.reshape(per_row), sin.reshape(per_row)
    if inverse:
        s = -s
    rotated = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    y = torch.cat([x[..., : head_dim - rope_dim], rotated.to(x.dtype)], dim=-1)
    if out_heads is None:
        return y
    if x.dim() != 3:
        raise ValueError(f"out_heads needs x [M, H, D], got {tuple(x.shape)}")
    if out_heads == x.shape[1]:
        return y
    out = torch.zeros((num_tokens, out_heads, head_dim), dtype=x.dtype, device=x.device)
    kept = min(x.shape[1], out_heads)
    out[:, :kept] = y[:, :kept]
    return out


def rope_q_kv_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    q_out_heads: int | None = None,
    q_norm_eps: float | None = None,
    kv_norm_eps: float | None = None,
    kv_norm_weight: torch.Tensor | None = None,
    kv_out: torch.Tensor | None = None,
    kv_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain `rope_q_kv` fuses: q [M, H, D] -> `rope_tail_ref` (weightless norm with
    `q_norm_eps`, heads padded/cut to `q_out_heads`); kv [M, Dkv] -> `rope_tail_ref` with its
    norm, then (with `kv_out`) the index_put `kv_out[kv_rows] = rows` (or a copy into `kv_out`
    [M, Dkv]). Returns (q rows, kv_out or the new kv rows)."""
    q_rows = rope_tail_ref(q, cos, sin, out_heads=q_out_heads, norm_eps=q_norm_eps)
    rows = rope_tail_ref(kv[:, None], cos, sin, norm_eps=kv_norm_eps, norm_weight=kv_norm_weight)[
        :, 0
    ]
    if kv_out is None:
        return q_rows, rows
    if kv_rows is None:
        if kv_out.shape != rows.shape:
            raise ValueError(f"kv_out must be {tuple(rows.shape)}, got {tuple(kv_out.shape)}")
        kv_out.copy_(rows)
    else:
        kv_out[kv_rows] = rows
    return q_rows, kv_out
