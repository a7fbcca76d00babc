"""RMSNorm of DeepSeek-V4: weighted, and weightless (per head / mHC input); the math is
`rms_norm_ref` (`kernels/norm/reference.py`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sgl_dspark.kernels.norm.reference import rms_norm_ref
from sgl_dspark.srt.core.kernel_choice import KernelChoice

# (x [..., N], weight [N] | None, eps) -> normalised x of x's shape and dtype
RmsNormFn = Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor]


def rms_norm_impl(kernels: KernelChoice) -> RmsNormFn:
    """The RMSNorm implementation of the "norm" family, bound once by the layer that uses it.

    torch: `rms_norm_ref` itself (the kernels' reference). triton: `kernels/norm/rmsnorm.py::
    rms_norm`, one launch instead of ~8 torch kernels, within a tolerance of `rms_norm_ref`
    (another fp32 summation order for the mean square; the same rounding points otherwise). Both
    take `(x [..., N], weight [N] | None, eps)`.
    """
    if kernels.of("norm") == "torch":
        return rms_norm_ref
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.norm.rmsnorm import rms_norm as rms_norm_triton

    def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return rms_norm_triton(_kernel_rows(x), weight, eps)

    return rms_norm_fused


def _kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """The norm kernels read contiguous rows or 2-D rows with any row stride (a column block of
    a fused projection output); anything else is copied first."""
    if not x.is_contiguous() and not (x.dim() == 2 and x.stride(1) == 1):
        return x.contiguous()
    return x


# One norm's arguments: (x [..., N], weight [N] | None, eps)
NormArgs = tuple[torch.Tensor, torch.Tensor | None, float]
# (a, b) -> (a normalised, b normalised)
RmsNormPairFn = Callable[[NormArgs, NormArgs], tuple[torch.Tensor, torch.Tensor]]


def rms_norm_pair_impl(kernels: KernelChoice) -> RmsNormPairFn:
    """Two RMSNorms of the "norm" family at once (DeepSeek-V4.1's q_a and kv norms, column blocks
    of one projection output). torch: `rms_norm_ref` of each. triton: `kernels/norm/rmsnorm.py::
    rms_norm_pair`, one launch for both where their tiles run on as many warps; each row the
    bits of its own `rms_norm` call."""
    if kernels.of("norm") == "torch":
        return lambda a, b: (rms_norm_ref(*a), rms_norm_ref(*b))
    from sgl_dspark.kernels.norm.rmsnorm import rms_norm_pair

    def pair(a: NormArgs, b: NormArgs) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_pair((_kernel_rows(a[0]), *a[1:]), (_kernel_rows(b[0]), *b[1:]))

    return pair


class RMSNorm(nn.Module):
    """Weighted RMSNorm whose parameter is named `weight` (HF checkpoint layout)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)
