"""Bias-free linear layers in torch with fp32 accumulation: the reference of the small-M kernels
(`small_m.py`). The "linear" family's torch backend is the BLAS (`F.linear`), which sums in
another order, not this function."""

from __future__ import annotations

import torch


def small_m_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight^T` accumulated in fp32, rounded once to x's dtype.

    x [M, K] (bf16/fp16/fp32), weight [N, K] of x's dtype. Returns [M, N]."""
    return (x.float() @ weight.float().t()).to(x.dtype)


def small_m_grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`y[:, g] = x[:, g] @ weight[g]^T` accumulated in fp32, rounded once to x's dtype.
    x [M, G, K], weight [G, N, K] of x's dtype. Returns [M, G, N]."""
    return torch.einsum("mgk,gnk->mgn", x.float(), weight.float()).to(x.dtype)
