"""Bias-free projections that read the same input, run as one GEMM.

At batch size 1 a decode step is bound by kernel launches, not bytes: a V4 CSA layer projects its
input seven times (q_a, kv, the compressor's kv and gate, the indexer's kv, gate and head
weights). `LinearGroup` keeps the member `nn.Linear`s (their parameters keep the checkpoint names)
and, once `fuse()` has run, stores their weights as row blocks of one tensor, so one `F.linear`
computes every output; the members' weights become views of it (no extra memory).

`fuse()` must run after the model is on its final device and dtype: `Module.to()` would replace
the member parameters with copies and silently untie them (the group then keeps computing with
the old tensor; `ModelRunner` fuses after placement).

Exactness: each output column is the same dot product, but the GEMM sees a wider N and the BLAS
may pick another kernel (tile or split-K order), so outputs can differ from the separate GEMMs in
the last bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sgl_dspark.srt.core.kernel_choice import KernelChoice

_SMALL_M_MAX_K = 4096
# (x [..., K], weight [N, K]) -> x @ weight^T [..., N]
LinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def linear_impl(kernels: KernelChoice | None) -> LinearFn:
    """The bias-free linear of the "linear" family. torch: `F.linear`. triton: decode-sized
    inputs (2-D, at most `MAX_M` rows, K <= 4096, unit stride along K) go through the small-M kernel
    `kernels/linear/small_m.py` (narrow column blocks over many programs; another summation
    order than the BLAS), larger ones through `F.linear`."""
    if kernels is None or kernels.of("linear") == "torch":
        return F.linear
    from sgl_dspark.kernels.linear.small_m import MAX_M, small_m_linear

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # K <= 4096: the kernel matches or beats the BLAS up to K = 1024 and loses to it at
        # K = 8192 (DSV4-Flash o_b; benchmark/results/kernels.md).
        if (
            x.dim() == 2
            and 0 < x.shape[0] <= MAX_M
            and x.shape[1] <= _SMALL_M_MAX_K
            and (x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype)
        ):
            return small_m_linear(x, weight)
        return F.linear(x, weight)

    return linear


# (x [M, G, K], weight [G, N, K]) -> [M, G, N]: group g's columns of x times its own weight
GroupedLinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _grouped_linear_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.einsum("mgk,gnk->mgn", x, weight)


def grouped_linear_impl(kernels: KernelChoice | None) -> GroupedLinearFn:
    """The grouped bias-free linear of the "linear" family (V4's grouped output projection
    `o_a`). torch: one batched einsum (the BLAS). triton: decode-sized inputs (at most `MAX_M`
    rows, K <= 4096, unit stride along K) as G small-M products in one launch
    (`kernels/linear/small_m.py::small_m_grouped_linear`; not bitwise against the BLAS), larger ones
    through the einsum."""
    if kernels is None or kernels.of("linear") == "torch":
        return _grouped_linear_torch
    from sgl_dspark.kernels.linear.small_m import MAX_M, small_m_grouped_linear

    def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if (
            0 < x.shape[0] <= MAX_M
            and x.shape[2] <= _SMALL_M_MAX_K
            and (x.stride(2) == 1 and weight.stride(2) == 1 and x.dtype == weight.dtype)
        ):
            return small_m_grouped_linear(x, weight)
        return _grouped_linear_torch(x, weight)

    return grouped_linear


class LinearGroup:
    """Members' outputs `[..., out_i]` for one input, in member order (column views of one GEMM
    output once fused)."""

    def __init__(
        self,
        linears: Sequence[nn.Linear],
        kernels: KernelChoice | None = None,
    ) -> None:
        if not linears:
            raise ValueError("LinearGroup needs at least one nn.Linear")
        for lin in linears:
            if lin.bias is not None:
                raise ValueError("LinearGroup members must be bias-free")
        if len({lin.in_features for lin in linears}) != 1:
            raise ValueError(
                f"LinearGroup members must share in_features, got "
                f"{[lin.in_features for lin in linears]}"
            )
        self.linears = list(linears)
        self.sizes = [lin.out_features for lin in linears]
        self.weight: torch.Tensor | None = None
        self.linear = linear_impl(kernels)

    def fuse(self) -> None:
        """Concatenate the weights into one tensor and make each member's weight a view of it."""
        ws = [lin.weight.data for lin in self.linears]
        if len({(w.dtype, w.device) for w in ws}) != 1:
            raise ValueError("LinearGroup members must share dtype and device to fuse")
        fused = torch.cat(ws, dim=0)
        for lin, part in zip(self.linears, fused.split(self.sizes, dim=0)):
            lin.weight.data = part
        self.weight = fused

    @property
    def fused(self) -> bool:
        w = self.weight
        # Untied by a later Module.to(): fall back to the members (never compute with stale weights).
        return w is not None and self.linears[0].weight.data_ptr() == w.data_ptr()

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """All outputs side by side `[..., sum(out_i)]` (contiguous): the GEMM's own output once
        fused, else the members' outputs concatenated."""
        if self.fused:
            assert self.weight is not None
            return self.linear(x, self.weight)
        return torch.cat([self.linear(x, lin.weight) for lin in self.linears], dim=-1)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if len(self.linears) > 1 and self.fused:
            assert self.weight is not None
            return list(self.linear(x, self.weight).split(self.sizes, dim=-1))
        return [self.linear(x, lin.weight) for lin in self.linears]


def fuse_linear_groups(model: nn.Module) -> int:
    """Fuse every `LinearGroup` that a module of `model` lists in its `linear_groups()`; returns
    how many were fused."""
    n = 0
    for mod in model.modules():
        groups = getattr(mod, "linear_groups", None)
        if callable(groups):
            for g in groups():
                if len(g.linears) > 1:
                    g.fuse()
                    n += 1
    return n


def fuse_after_placement(model: nn.Module) -> None:
    """The weight layouts that must be built once the model is on its final device and dtype
    (a later `Module.to()` unties them, and their owners then fall back to the separate
    weights): every `LinearGroup`, then each module's own `fuse_weights()` (the MoE's shared
    expert folded into the routed experts' stacks, `moe/experts.py`)."""
    fuse_linear_groups(model)
    for mod in model.modules():
        fuse = getattr(mod, "fuse_weights", None)
        if callable(fuse):
            fuse()
