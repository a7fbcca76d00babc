"""RMSNorm in torch: the reference of `rmsnorm.py` and the "norm" family's torch backend.

Two variants, as in DeepSeek-V4, with different rounding points:
    weighted:   y = dtype( w_f32 * (x_f32 * rstd) )      rstd = 1 / sqrt(mean(x_f32^2) + eps)
    weightless: y = dtype( x_f32 * dtype(rstd) )         (HF's UnweightedRMSNorm: rstd is cast
                                                           to x's dtype before the multiply)
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x, math in fp32.

    Args:
        x: [..., N] fp32/bf16/fp16.
        weight: [N] (any float dtype), or None for the weightless variant.
        eps: added to the mean square.
    Returns:
        A tensor of x's shape and dtype.
    """
    if weight is None:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return x * rstd.to(x.dtype)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)
