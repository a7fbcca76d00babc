"""RMSNorm variants of DeepSeek-V4 (spec §0): weighted, and weightless (per head / mHC input)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`w * x * rsqrt(mean(x^2) + eps)` in fp32, cast back to x's dtype once at the end.

    With `weight=None` this is HF's `UnweightedRMSNorm`, which casts the fp32 rsqrt to x's dtype
    before multiplying (identical in fp32; matches HF's rounding in bf16).
    """
    if weight is None:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return x * rstd.to(x.dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm whose parameter is named `weight` (HF checkpoint layout)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
