"""MoE routers: learned top-k with correction bias, and hash routing.

The "moe" kernel family picks the implementation once, at construction: "torch" runs
the module's own torch code; "triton" runs `kernels/moe/router.py::router_topk` (the gate
GEMV, the temperature, scores, biased top-k or the hash table, renormalisation and the routed
scale in one launch, int32 ids / fp32 weights, no host sync).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from sgl_dspark.srt.core.kernel_choice import KernelChoice


def score_fn(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


# Rows of the persistent router workspace (covers every decode/verify graph bucket up to
# bs 32 x width 8).
_PERSISTENT_WORKSPACE_ROWS = 256


class Router(nn.Module):
    """`mlp.gate`: `weight [E, D]`, plus `e_score_correction_bias [E]` (top-k routers) or
    `tid2eid [V, k]` (hash routers). Returns (weights [T, k], expert ids [T, k]): torch backend
    x's dtype / int64, triton backend fp32 / int32; weights include the routed scaling factor."""

    tid2eid: torch.Tensor
    e_score_correction_bias: torch.Tensor

    def __init__(
        self,
        hidden_size: int,
        n_experts: int,
        top_k: int,
        vocab_size: int,
        is_hash: bool,
        scoring_func: str,
        routed_scaling_factor: float,
        norm_topk_prob: bool,
        kernels: KernelChoice | None = None,
        gate_temp: float | None = None,
    ) -> None:
        """`gate_temp` (DeepSeek-V4.1): the router logits are computed in fp32 and divided by
        it; None keeps V4's logits in the activation dtype."""
        super().__init__()
        self.top_k = top_k
        self.gate_temp = gate_temp
        self.is_hash = is_hash
        self.scoring_func = scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.int64))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts))
        self._route = self._route_torch
        if (kernels or KernelChoice()).of("moe") == "triton":
            # Imported only when chosen: the torch path never loads Triton.
            from sgl_dspark.kernels.moe.router import (
                RouterConfig,
                RouterWorkspace,
                make_router_workspace,
                router_topk,
            )

            self._router_topk = router_topk
            self._make_workspace = make_router_workspace
            self._workspace: RouterWorkspace | None = None
            self._config = RouterConfig(
                top_k,
                scoring_func,
                renormalize=norm_topk_prob,
                routed_scaling_factor=routed_scaling_factor,
                # the kernel's logits are fp32 either way (V4's torch path rounds them to the
                # activation dtype: within the family's tolerance)
                gate_temp=1.0 if gate_temp is None else gate_temp,
            )
            # The shared expert as one more route (id E, weight 1), for experts that fold it
            # into their stacks.
            self._config_shared = dataclasses.replace(self._config, num_shared=1)
            self._route = self._route_triton

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, with_shared: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) `[T, k]`, or `[T, k + 1]` with_shared (triton only): the last column
        is the shared expert as expert E with weight 1 (rows past the graph's valid count get
        the fill id and weight 0 in every column)."""
        return self._route(x, input_ids, with_shared)

    def _route_torch(
        self, x: torch.Tensor, input_ids: torch.Tensor, with_shared: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if with_shared:
            raise ValueError("with_shared needs the triton moe backend")
        if self.gate_temp is None:
            logits = F.linear(x, self.weight)
        else:
            logits = F.linear(x.float(), self.weight.float()) / self.gate_temp
        scores = score_fn(logits, self.scoring_func)
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()
        else:
            biased = scores + self.e_score_correction_bias
            ids = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.routed_scaling_factor, ids

    def _route_triton(
        self, x: torch.Tensor, input_ids: torch.Tensor, with_shared: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        config = self._config_shared if with_shared else self._config
        x = x.contiguous()
        ws = None
        if x.shape[0] <= _PERSISTENT_WORKSPACE_ROWS:
            # Decode/verify-sized calls share one workspace that lives as long as the router
            # (the kernel leaves its counters zero) instead of zeroing a fresh one per call: one
            # memset kernel less per layer and step. It is never reallocated, because captured
            # graphs keep its address; larger (prefill) calls allocate their own.
            if self._workspace is None or self._workspace.partials.device != x.device:
                self._workspace = self._make_workspace(
                    _PERSISTENT_WORKSPACE_ROWS, self.weight.shape[0], x.shape[1], x.device
                )
            ws = self._workspace
        if self.is_hash:
            out = self._router_topk(
                config,
                x=x,
                gate_weight=self.weight,
                input_ids=input_ids,
                tid2eid=self.tid2eid,
                workspace=ws,
            )
        else:
            # The bias is an fp32 buffer (cast_model leaves buffers alone); .float() is a no-op.
            out = self._router_topk(
                config,
                x=x,
                gate_weight=self.weight,
                correction_bias=self.e_score_correction_bias.float(),
                workspace=ws,
            )
        return out.weights, out.ids
