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

from sgl_dspark.kernels.linear.reference import QuantizedWeight, dequantize_weight_ref
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.fp8_linear import fp8_linear_impl
from sgl_dspark.srt.layers.quantized import (
    WeightLike,
    cat_weights,
    mark_quantizable,
    module_weight,
    replace_weight,
    split_rows,
    weight_kind,
    weight_ptr,
)

_SMALL_M_MAX_K = 4096
# Rows up to which a quantised weight's GEMM stays in the dequantising kernel
# (`kernels/linear/quantized.py`) above decode sizes: it runs 16-row blocks, two a program, each
# program reading the stored weight, so 64 rows read it twice.
# Beyond, the weight is dequantised once per call
# (`kernels/linear/dequantize.py`: the stored bytes read once, the bf16 weight written once) and
# the BLAS reads the bf16 weight: 5 times an FP8 weight's bytes, 9 times an MXFP4 weight's. A DSpark
# verify (requests x width rows) and decode at 32 in flight stay in the kernel.
_QUANTIZED_KERNEL_MAX_M = 64
# (x [..., K], weight [N, K] plain or quantised) -> x @ weight^T [..., N]
LinearFn = Callable[[torch.Tensor, WeightLike], torch.Tensor]


def _dequantized_linear(x: torch.Tensor, weight: WeightLike) -> torch.Tensor:
    """`F.linear` on the weight dequantised for this call (the torch path of a quantised weight:
    slow, exact weights)."""
    if isinstance(weight, QuantizedWeight):
        weight = dequantize_weight_ref(weight, x.dtype)
    return F.linear(x, weight)


def linear_impl(kernels: KernelChoice | None) -> LinearFn:
    """The bias-free linear of the "linear" family. torch: `F.linear` (a quantised weight is
    dequantised per call). triton: decode-sized inputs (2-D, at most `MAX_M` rows, K <= 4096,
    unit stride along K) go through the small-M kernel `kernels/linear/small_m.py` (narrow column
    blocks over many programs; another summation order than the BLAS), with a quantised weight
    through `kernels/linear/quantized.py` (dequantised in the kernel, any K); larger ones through
    `F.linear`, or with FP8 activations on and an FP8 weight through the W8A8 GEMM
    (`layers/fp8_linear.py`). A quantised weight above decode sizes: up to
    `_QUANTIZED_KERNEL_MAX_M` rows the dequantising kernel in 16-row blocks, beyond the weight
    dequantised once per call (`kernels/linear/dequantize.py`) and `F.linear`. With
    `kernels.batch_invariant` every M goes through the decode-size kernels
    (`_batch_invariant_linear`)."""
    if kernels is None or kernels.of("linear") == "torch":
        return _dequantized_linear
    from sgl_dspark.kernels.linear.quantized import quantized_linear
    from sgl_dspark.kernels.linear.small_m import MAX_M, small_m_linear

    if kernels.batch_invariant:
        return _batch_invariant_linear
    fp8 = fp8_linear_impl(kernels)

    def linear(x: torch.Tensor, weight: WeightLike) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            if x.dim() == 2 and 0 < x.shape[0] <= MAX_M and x.stride(1) == 1:
                return quantized_linear(x, weight)
            if fp8 is not None and fp8.takes(x, weight):
                return fp8(x, weight)
            return _wide_quantized_linear(x, weight)
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


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def _quantized_rows_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [..., K] through the dequantising kernel at any number of rows (16-row blocks)."""
    from sgl_dspark.kernels.linear.quantized import quantized_linear

    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()  # a copy: the same values
    y = quantized_linear(rows, weight)
    return y.view(*x.shape[:-1], y.shape[-1])


def _wide_quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """A quantised weight's GEMM above decode sizes (FP8 activations off): the dequantising
    kernel up to `_QUANTIZED_KERNEL_MAX_M` rows, beyond it the weight dequantised once and the
    BLAS."""
    from sgl_dspark.kernels.linear.dequantize import dequantize_weight

    if _rows(x) <= _QUANTIZED_KERNEL_MAX_M:
        return _quantized_rows_linear(x, weight)
    return F.linear(x, dequantize_weight(weight, x.dtype))


def _wide_quantized_grouped_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`_wide_quantized_linear` for the grouped projection (x [M, G, K], weight [G * N, K])."""
    from sgl_dspark.kernels.linear.dequantize import dequantize_weight
    from sgl_dspark.kernels.linear.quantized import quantized_grouped_linear

    if x.shape[0] <= _QUANTIZED_KERNEL_MAX_M:
        return quantized_grouped_linear(x if x.stride(2) == 1 else x.contiguous(), weight)
    dense = dequantize_weight(weight, x.dtype)
    return _grouped_linear_torch(x, dense.view(x.shape[1], -1, dense.shape[1]))


def _batch_invariant_linear(x: torch.Tensor, weight: WeightLike) -> torch.Tensor:
    """`--enable-deterministic-inference`: the decode-size kernels at every M (16-row blocks,
    launch shapes from (N, K) only), so a row's bits never depend on the batch; slower than
    the BLAS for prefill-sized M at large K."""
    from sgl_dspark.kernels.linear.small_m import small_m_linear

    if isinstance(weight, QuantizedWeight):
        return _quantized_rows_linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()  # a copy: the same values
    if weight.dtype != x.dtype:
        raise ValueError(f"linear: weight dtype {weight.dtype} != input dtype {x.dtype}")
    y = small_m_linear(rows, weight if weight.stride(1) == 1 else weight.contiguous())
    return y.view(*x.shape[:-1], y.shape[-1])


def _batch_invariant_grouped_linear(x: torch.Tensor, weight: WeightLike) -> torch.Tensor:
    """The grouped linear of `_batch_invariant_linear`: the decode-size kernels at every M."""
    from sgl_dspark.kernels.linear.quantized import quantized_grouped_linear
    from sgl_dspark.kernels.linear.small_m import small_m_grouped_linear

    if x.stride(2) != 1:
        x = x.contiguous()
    if isinstance(weight, QuantizedWeight):
        return quantized_grouped_linear(x, weight)
    if weight.dtype != x.dtype:
        raise ValueError(f"grouped linear: weight dtype {weight.dtype} != input dtype {x.dtype}")
    return small_m_grouped_linear(x, weight if weight.stride(2) == 1 else weight.contiguous())


# (x [M, G, K], weight [G, N, K]) -> [M, G, N]: group g's columns of x times its own weight
GroupedLinearFn = Callable[[torch.Tensor, WeightLike], torch.Tensor]


def _grouped_linear_torch(x: torch.Tensor, weight: WeightLike) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):  # [G * N, K], dequantised for this call
        dense = dequantize_weight_ref(weight, x.dtype)
        weight = dense.view(x.shape[1], dense.shape[0] // x.shape[1], dense.shape[1])
    return torch.einsum("mgk,gnk->mgn", x, weight)


def grouped_linear_impl(kernels: KernelChoice | None) -> GroupedLinearFn:
    """The grouped bias-free linear of the "linear" family (V4's grouped output projection
    `o_a`). torch: one batched einsum (the BLAS). triton: decode-sized inputs (at most `MAX_M`
    rows, K <= 4096, unit stride along K) as G small-M products in one launch
    (`kernels/linear/small_m.py::small_m_grouped_linear`; not bitwise against the BLAS), larger ones
    through the einsum (an FP8 weight with FP8 activations on: the grouped W8A8 GEMM; another
    quantised weight as in `linear_impl`: the dequantising kernel up to
    `_QUANTIZED_KERNEL_MAX_M` rows, beyond it dequantised once per call)."""
    if kernels is None or kernels.of("linear") == "torch":
        return _grouped_linear_torch
    from sgl_dspark.kernels.linear.quantized import quantized_grouped_linear
    from sgl_dspark.kernels.linear.small_m import MAX_M, small_m_grouped_linear

    if kernels.batch_invariant:
        return _batch_invariant_grouped_linear
    fp8 = fp8_linear_impl(kernels)

    def grouped_linear(x: torch.Tensor, weight: WeightLike) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            if 0 < x.shape[0] <= MAX_M and x.stride(2) == 1:
                return quantized_grouped_linear(x, weight)
            if fp8 is not None and fp8.takes(x, weight):
                return fp8.grouped(x, weight)
            return _wide_quantized_grouped_linear(x, weight)
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
    output per weight kind once fused).

    Members are quantizable (`layers/quantized.py`): each may hold a quantised weight. `fuse()`
    stacks the members of one kind (plain dtype, or quantised format and scale group) into one
    weight, so a group whose members are stored in two formats (V4's FP8 attention projections
    beside the bf16 compressor ones) runs one GEMM per format."""

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
            mark_quantizable(lin, "weight")
        if len({lin.in_features for lin in linears}) != 1:
            raise ValueError(
                f"LinearGroup members must share in_features, got "
                f"{[lin.in_features for lin in linears]}"
            )
        self.linears = list(linears)
        self.sizes = [lin.out_features for lin in linears]
        # Fused runs: (member indices, the stacked weight); members are views of it.
        self._runs: list[tuple[list[int], WeightLike]] = []
        self.linear = linear_impl(kernels)

    def fuse(self) -> None:
        """Stack the weights of each kind into one tensor and make each member's weight a view
        of it."""
        weights = [module_weight(lin) for lin in self.linears]
        kinds: dict[tuple[object, ...], list[int]] = {}
        for i, w in enumerate(weights):
            kinds.setdefault(weight_kind(w), []).append(i)
        runs: list[tuple[list[int], WeightLike]] = []
        for members in kinds.values():
            fused = cat_weights([weights[i] for i in members], dim=-2)
            for i, part in zip(members, split_rows(fused, [self.sizes[i] for i in members])):
                replace_weight(self.linears[i], "weight", part)
            runs.append((members, fused))
        self._runs = runs

    def restack(self, weight: WeightLike) -> None:
        """Adopt `weight` (every member's rows stacked in order, one kind) as the fused weight;
        the members' weights must already be views of it."""
        self._runs = [(list(range(len(self.linears))), weight)]

    @property
    def weight(self) -> WeightLike | None:
        """The stacked weight when every member is of one kind and fused, else None."""
        return self._runs[0][1] if self.fused and len(self._runs) == 1 else None

    @property
    def fused(self) -> bool:
        # Untied by a later Module.to(): fall back to the members (never compute with stale
        # weights).
        return bool(self._runs) and all(
            weight_ptr(module_weight(self.linears[members[0]])) == weight_ptr(fused)
            for members, fused in self._runs
        )

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """All outputs side by side `[..., sum(out_i)]` (contiguous): the GEMM's own output when
        fused into one weight, else the outputs concatenated."""
        weight = self.weight
        if weight is not None:
            return self.linear(x, weight)
        return torch.cat(self(x), dim=-1)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if len(self.linears) == 1 or not self.fused:
            return [self.linear(x, module_weight(lin)) for lin in self.linears]
        outs: list[torch.Tensor | None] = [None] * len(self.linears)
        for members, fused in self._runs:
            parts = self.linear(x, fused).split([self.sizes[i] for i in members], dim=-1)
            for i, part in zip(members, parts):
                outs[i] = part
        return [o for o in outs if o is not None]


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
