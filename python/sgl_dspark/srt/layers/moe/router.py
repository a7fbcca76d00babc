"""MoE routers (spec §6.1–§6.2): learned top-k with correction bias, and hash routing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def score_fn(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


class Router(nn.Module):
    """`mlp.gate`: `weight [E, D]`, plus `e_score_correction_bias [E]` (top-k routers) or
    `tid2eid [V, k]` (hash routers). Returns (weights [T, k] fp32-ish, expert ids [T, k] int64)."""

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, vocab_size: int,
                 is_hash: bool, scoring_func: str, routed_scaling_factor: float,
                 norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.is_hash = is_hash
        self.scoring_func = scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.int64))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = score_fn(F.linear(x, self.weight), self.scoring_func)
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()
        else:
            biased = scores + self.e_score_correction_bias
            ids = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.routed_scaling_factor, ids
