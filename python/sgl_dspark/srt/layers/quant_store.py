"""The cache-row stores of DeepSeek-V4.1: rotate rows, quantise them with the cache's quantiser
and write the packed form (`QuantizedRows`); and rotate rows, then keep the quantiser's values
(the index queries, quantised as the index keys are but never stored). One dispatch point of
the "rope" family (a store of rotated rows is a rope launch): the window KV store of every
layer, the latent and index-key stores of a kv source and every index source's queries go
through it. The read side is the consumers': the attention decodes the window keys and latents
in its loads (`attend_packed`), the index scoring the index keys."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sgl_dspark.kernels.quant.reference import fake_quant_fp4_index_ref
from sgl_dspark.kernels.rope.reference import rope_tail_ref
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.mem_cache.v41_pool import QuantizedRows

# (x [N, D] (normalised, before RoPE), cos [N, rd/2], sin [N, rd/2], cache, rows [N]) -> None:
# cache rows `rows` = quant(rope(x))
QuantStoreFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, QuantizedRows, torch.Tensor], None
]


# (x [T, H, D], cos [T, rd/2], sin [T, rd/2]) -> the FP4 index quantiser's values of rope(x),
# x's shape and dtype
IndexQueryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def index_query_impl(kernels: KernelChoice) -> IndexQueryFn:
    """torch: `rope_tail_ref`, then `fake_quant_fp4_index_ref` (a chain of some twenty
    elementwise kernels). triton: one launch (`kernels/quant/store.py::fake_quant_rows`) that
    reads the queries in place (a column slice of the joint q_b output), bit for bit the same
    values."""
    if kernels.of("rope") == "torch":

        def index_query_torch(
            x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
        ) -> torch.Tensor:
            return fake_quant_fp4_index_ref(rope_tail_ref(x, cos, sin))

        return index_query_torch
    from sgl_dspark.kernels.quant.store import fake_quant_rows

    def index_query_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return fake_quant_rows(x, "fp4_index", cos, sin)

    return index_query_triton


def quant_store_impl(kernels: KernelChoice) -> QuantStoreFn:
    """torch: `rope_tail_ref`, then the cache's torch quantiser and an index_put. triton: one
    launch (`kernels/quant/store.py::quant_store`), bit for bit the same bytes. A cache whose
    width its quantiser leaves unquantised stores the rotated rows as they are, on both."""
    if kernels.of("rope") == "torch":

        def store_torch(
            x: torch.Tensor,
            cos: torch.Tensor,
            sin: torch.Tensor,
            cache: QuantizedRows,
            rows: torch.Tensor,
        ) -> None:
            cache.store(rows, rope_tail_ref(x, cos, sin))

        return store_torch
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.quant.store import quant_store

    def store_triton(
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: QuantizedRows,
        rows: torch.Tensor,
    ) -> None:
        if not cache.packed:
            cache.store(rows, rope_tail_ref(x, cos, sin))
            return
        assert cache.scales is not None
        if x.stride(-1) != 1:
            x = x.contiguous()
        quant_store(x, rows, cache.data, cache.scales, cache.fmt, cos, sin)

    return store_triton


__all__ = [
    "IndexQueryFn",
    "QuantStoreFn",
    "index_query_impl",
    "quant_store_impl",
]
