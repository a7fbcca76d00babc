"""Manifold-constrained hyper-connections (spec §4): coefficients, collapse, stream update, head."""

from __future__ import annotations

import torch
from torch import nn

from sgl_dspark.srt.layers.norm import rms_norm


class HyperConnection(nn.Module):
    """One mHC mixer (`attn_hc` / `ffn_hc`): parameters `fn`, `base`, `scale` (HF names, fp32)."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float,
                 rms_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.hc_mult = n
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.rms_eps = rms_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def coeffs(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams `[T, n, D]` -> pre `[T, n]`, post `[T, n]`, comb `[T, n, n]` (all fp32)."""
        n = self.hc_mult
        u = rms_norm(streams.flatten(1).float(), None, self.rms_eps)
        mix = u @ self.fn.float().t()
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        scale = self.scale.float()
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """`sum_j pre[j] * Rs[j]` -> `[T, D]` in streams' dtype (fp32 product and sum)."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
    """`Rs'[k] = post[k] * y + sum_j comb[j, k] * Rs[j]` (HF casts post/comb to the act dtype)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class HyperHead(nn.Module):
    """Final stream collapse (`model.hc_head`: `hc_fn`, `hc_base`, `hc_scale`)."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, rms_eps: float) -> None:
        super().__init__()
        self.hc_eps = hc_eps
        self.rms_eps = rms_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        u = rms_norm(streams.flatten(1).float(), None, self.rms_eps)
        pre = torch.sigmoid((u @ self.hc_fn.float().t()) * self.hc_scale.float() + self.hc_base.float())
        return hc_collapse(streams, pre + self.hc_eps)
