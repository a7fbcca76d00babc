"""Routed experts (stacked `gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`) and the shared
expert, both SwiGLU with the DeepSeek-V4 clamp (spec §6.3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): the gate is clamped from above only."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class RoutedExperts(nn.Module):
    def __init__(self, n_experts: int, hidden_size: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.intermediate = intermediate
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.zeros(n_experts, 2 * intermediate, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(n_experts, hidden_size, intermediate))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[T, D]`, ids/weights `[T, k]` -> `[T, D]`; duplicate ids in a row are summed."""
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.n_experts).tolist()
        token_of = order // ids.shape[1]
        w_sorted = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            gu = F.linear(x[tok], self.gate_up_proj[e])
            h = swiglu_clamp(gu[:, :self.intermediate], gu[:, self.intermediate:], self.limit)
            y = F.linear(h, self.down_proj[e]) * w_sorted[start:start + n, None].to(x.dtype)
            out.index_add_(0, tok, y.to(out.dtype))
            start += n
        return out


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_clamp(self.gate_proj(x), self.up_proj(x), self.limit))


class SparseMoE(nn.Module):
    """`mlp`: gate (router) + experts + shared_experts; output = routed + shared."""

    def __init__(self, router: nn.Module, experts: RoutedExperts, shared: SharedExpert) -> None:
        super().__init__()
        self.gate = router
        self.experts = experts
        self.shared_experts = shared

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return self.experts(x, ids, weights) + self.shared_experts(x)
