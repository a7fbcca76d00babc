"""The cache-row stores and loads of DeepSeek-V4.1: rotate rows, quantise them with the cache's
quantiser and write the packed form (`QuantizedRows`); gather packed rows and decode them. One
dispatch point of the "rope" family (a store of rotated rows is a rope launch; its read side
goes with it): the window KV store and read of every layer and the latent and index-key stores
and reads of a kv source all go through it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sgl_dspark.kernels.rope.reference import rope_tail_ref
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.mem_cache.v41_pool import QuantizedRows

# (x [N, D] (normalised, before RoPE), cos [N, rd/2], sin [N, rd/2], cache, rows [N]) -> None:
# cache rows `rows` = quant(rope(x))
QuantStoreFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, QuantizedRows, torch.Tensor], None
]
# (cache, rows (any shape)) -> the decoded rows [*rows.shape, dim] in the cache's dtype
QuantLoadFn = Callable[[QuantizedRows, torch.Tensor], torch.Tensor]


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


def quant_load_impl(kernels: KernelChoice) -> QuantLoadFn:
    """torch: `QuantizedRows.load` (index the stored bytes, then the torch dequantiser: several
    elementwise ops and intermediates). triton: one launch (`kernels/quant/load.py::quant_load`)
    that gathers and decodes, bit for bit the same values. A cache its quantiser leaves
    unquantised is a plain index on both."""
    if kernels.of("rope") == "torch":

        def load_torch(cache: QuantizedRows, rows: torch.Tensor) -> torch.Tensor:
            return cache.load(rows)

        return load_torch
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.quant.load import quant_load

    def load_triton(cache: QuantizedRows, rows: torch.Tensor) -> torch.Tensor:
        if not cache.packed:
            return cache.load(rows)
        assert cache.scales is not None
        return quant_load(cache.data, cache.scales, rows, cache.fmt, cache.dtype)

    return load_triton


__all__ = ["QuantLoadFn", "QuantStoreFn", "quant_load_impl", "quant_store_impl"]
