"""Route-reduce epilogue of SGLang's Triton MoE runner: `moe_reduce` for ``moe_combine_topk``
(sum of the per-slot expert outputs, times the routed scaling factor, into the output rows).

SGLang's runner has already multiplied every slot by its router weight, so the kernel runs with
every slot local and the routed scaling factor as each slot's weight: out = round(sum_k scale *
y[t, k]), the sum in slot order in fp32, rounded once. SGLang's Triton sum (its path where the
GPU has programmatic launch, the H200 among them) computes round(scale * sum_k y[t, k]) in fp32:
equal after rounding to bf16 except where the two fp32 values straddle a rounding boundary (at
most one bf16 ulp). Its torch.compile path (other GPUs) rounds the sum before scaling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sgl_dspark_plugin.contract import Target
from sgl_dspark_plugin.hooks._common import decline, kernels_run_on

NAME = "moe_route_reduce"
OURS = ("sgl_dspark.kernels:moe_reduce",)
TARGET = Target(
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.moe_combine_topk",
    (
        "intermediate_cache3",
        "out_hidden_states",
        "routed_scaling_factor",
        "no_combine",
        "use_fused_moe_sum_all_reduce",
        "out_slice",
        "_use_intermediate",
    ),
)


class _ScaleRoutes:
    """Weights all equal to the scale, expert-0 ids and a one-expert local mask, kept for the
    process's life.

    Buffers are never freed or replaced: a CUDA graph captured with one keeps its address."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[torch.device, int, float], tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[torch.device, torch.Tensor] = {}
        self._kept: list[torch.Tensor] = []

    def get(self, device: torch.device, rows: int, topk: int, scale: float):
        key = (device, topk, scale)
        weights, ids = self._by_key.get(key, (None, None))
        if weights is None or weights.shape[0] < rows:
            capacity = max(rows, 2 * (0 if weights is None else weights.shape[0]), 256)
            weights = torch.full((capacity, topk), scale, dtype=torch.float32, device=device)
            ids = torch.zeros(capacity, topk, dtype=torch.int32, device=device)
            self._by_key[key] = (weights, ids)
            self._kept += [weights, ids]
        mask = self._masks.get(device)
        if mask is None:
            mask = self._masks[device] = torch.ones(1, dtype=torch.int32, device=device)
        assert ids is not None
        return weights[:rows], ids[:rows], mask


_SCALE_ROUTES = _ScaleRoutes()


def around(
    original: Callable[..., torch.Tensor],
    intermediate_cache3: torch.Tensor,
    out_hidden_states: torch.Tensor,
    routed_scaling_factor: float | None,
    no_combine: bool = False,
    use_fused_moe_sum_all_reduce: bool = False,
    out_slice: torch.Tensor | None = None,
    _use_intermediate: bool = True,
) -> torch.Tensor:
    from sgl_dspark.kernels import moe_reduce

    def sglang() -> torch.Tensor:
        return original(
            intermediate_cache3,
            out_hidden_states,
            routed_scaling_factor,
            no_combine,
            use_fused_moe_sum_all_reduce,
            out_slice,
            _use_intermediate,
        )

    scale = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)
    y = intermediate_cache3
    if no_combine or use_fused_moe_sum_all_reduce:
        decline(NAME, "no combine, or the sum is fused into the all-reduce")
        return sglang()
    if not _use_intermediate:
        decline(NAME, "the expert GEMM wrote the output rows directly")
        return sglang()
    if y.dim() != 3 or y.dtype not in (torch.bfloat16, torch.float32) or not y.is_contiguous():
        decline(NAME, "expert outputs are not a contiguous bf16/fp32 [tokens, topk, hidden]")
        return sglang()
    out = out_hidden_states
    if out.shape != (y.shape[0], y.shape[2]) or out.dtype != y.dtype or not out.is_contiguous():
        decline(NAME, "output rows are not a contiguous [tokens, hidden] of the same dtype")
        return sglang()
    if not kernels_run_on(y, out):
        decline(NAME, f"tensors on {y.device.type}")
        return sglang()
    weights, ids, mask = _SCALE_ROUTES.get(y.device, y.shape[0], y.shape[1], scale)
    moe_reduce(y, weights, ids, mask, routed_scale=1.0, out=out)
    return out
