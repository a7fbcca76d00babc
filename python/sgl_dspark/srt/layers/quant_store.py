"""The cache-row stores and loads of DeepSeek-V4.1: rotate rows, quantise them with the cache's
quantiser and write the packed form (`QuantizedRows`); gather packed rows and decode them; and
rotate rows, then keep the quantiser's values (the index queries, quantised as the index keys
are but never stored). One dispatch point of the "rope" family (a store of rotated rows is a
rope launch; its read side goes with it): the window KV store and read of every layer, the
latent and index-key stores and reads of a kv source and every index source's queries go
through it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

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


class QuantLoadFn(Protocol):
    """(cache, rows (any shape), out) -> the decoded rows [*rows.shape, dim] in the cache's
    dtype, written into `out` when given (for rows [T, K] a [T, K, dim] view whose K x dim block
    per token is contiguous, e.g. a column range of wider rows of keys)."""

    def __call__(
        self, cache: QuantizedRows, rows: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...


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


def quant_load_impl(kernels: KernelChoice) -> QuantLoadFn:
    """torch: `QuantizedRows.load` (index the stored bytes, then the torch dequantiser: several
    elementwise ops and intermediates). triton: one launch (`kernels/quant/load.py::quant_load`)
    that gathers and decodes, bit for bit the same values, straight into `out` when given. A
    cache its quantiser leaves unquantised is a plain index on both."""
    if kernels.of("rope") == "torch":

        def load_torch(
            cache: QuantizedRows, rows: torch.Tensor, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            values = cache.load(rows)
            return values if out is None else out.copy_(values)

        return load_torch
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.quant.load import quant_load

    def load_triton(
        cache: QuantizedRows, rows: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not cache.packed:
            values = cache.load(rows)
            return values if out is None else out.copy_(values)
        assert cache.scales is not None
        return quant_load(cache.data, cache.scales, rows, cache.fmt, cache.dtype, out=out)

    return load_triton


# (cache a, rows a, out a, cache b, rows b, out b) -> None: two `QuantLoadFn` calls into given
# outputs
QuantLoadPairFn = Callable[
    [QuantizedRows, torch.Tensor, torch.Tensor, QuantizedRows, torch.Tensor, torch.Tensor], None
]


def quant_load_pair_impl(kernels: KernelChoice) -> QuantLoadPairFn:
    """Two loads into given outputs (DeepSeek-V4.1's window keys and attended latents, side by
    side in one keys tensor). torch: `quant_load_impl`'s twice. triton: one launch for two
    packed caches (`kernels/quant/load.py::quant_load_pair`), the values of two loads."""
    load = quant_load_impl(kernels)
    if kernels.of("rope") == "torch":

        def twice(
            a: QuantizedRows,
            rows_a: torch.Tensor,
            out_a: torch.Tensor,
            b: QuantizedRows,
            rows_b: torch.Tensor,
            out_b: torch.Tensor,
        ) -> None:
            load(a, rows_a, out_a)
            load(b, rows_b, out_b)

        return twice
    from sgl_dspark.kernels.quant.load import quant_load_pair

    def pair(
        a: QuantizedRows,
        rows_a: torch.Tensor,
        out_a: torch.Tensor,
        b: QuantizedRows,
        rows_b: torch.Tensor,
        out_b: torch.Tensor,
    ) -> None:
        if not (a.packed and b.packed) or a.dtype != b.dtype:
            load(a, rows_a, out_a)
            load(b, rows_b, out_b)
            return
        assert a.scales is not None and b.scales is not None
        quant_load_pair(
            (a.data, a.scales, rows_a, a.fmt, out_a),
            (b.data, b.scales, rows_b, b.fmt, out_b),
            a.dtype,
        )

    return pair


__all__ = [
    "IndexQueryFn",
    "QuantLoadFn",
    "QuantLoadPairFn",
    "QuantStoreFn",
    "index_query_impl",
    "quant_load_impl",
    "quant_load_pair_impl",
    "quant_store_impl",
]
