"""Device KV state of DeepSeek-V4.1, addressed through `ReqToTokenPool` like V4's.

* every layer: its window K=V at each token slot, stored in the FP8 form of the window
  quantiser (E4M3 elements + one exponent byte per 32 channels);
* every kv source (ratio m): its compressed latents, one row per group, group g of request r at
  `req_to_token[r, g * m] // m`, stored packed FP4 with E4M3 scales; its index keys, same rows,
  packed FP4 with exponent scales; for m = 2 the pending-pair ring of raw fp32 (kv, gate) rows
  of the last R positions of each request slot (position p at row p % R);
* with Engram: the token id at every token slot (the n-gram history is read by position).

The stored forms are exactly what the model's quantisers produce (`quantization/fake_quant.py`), so
caching loses nothing. Rollback is free: everything is addressed by position, a reader only
reads positions at or below its own, and a rejected position is rewritten when the real token
reaches it (before any reader of a later position reads it). Layers whose dimensions are not a
multiple of a quantiser's block store plain rows, as the quantiser leaves them unquantised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.mem_cache.base import BaseKVPool
from sgl_dspark.srt.quantization import fake_quant as fq

RowFormat = Literal["fp8_window", "fp4_latent", "fp4_index"]
_BLOCKS: dict[RowFormat, int] = {
    "fp8_window": fq.WINDOW_BLOCK,
    "fp4_latent": fq.LATENT_BLOCK,
    "fp4_index": fq.INDEX_BLOCK,
}
_QUANTIZE: dict[RowFormat, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "fp8_window": fq.quantize_fp8_window,
    "fp4_latent": fq.quantize_fp4_latent,
    "fp4_index": fq.quantize_fp4_index,
}


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


class QuantizedRows:
    """`rows` cache rows of `dim` channels in the packed form of one quantiser, or plain in
    `dtype` when `dim` is not a multiple of its block. Packed elements and scales are kept as
    raw bytes (uint8; FP8 codes are viewed as `float8_e4m3fn` only to convert them), so every
    device indexes them like any byte tensor."""

    def __init__(
        self,
        rows: int,
        dim: int,
        fmt: RowFormat,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.fmt, self.dim, self.dtype = fmt, dim, dtype
        self.packed = fq.quantizes(dim, _BLOCKS[fmt])
        self.scales: torch.Tensor | None = None
        if not self.packed:
            self.data = torch.zeros(rows, dim, dtype=dtype, device=device)
            return
        width = dim if fmt == "fp8_window" else dim // 2  # FP8 codes, or E2M1 pairs
        self.data = torch.zeros(rows, width, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(rows, dim // _BLOCKS[fmt], dtype=torch.uint8, device=device)

    @staticmethod
    def bytes_per_row(dim: int, fmt: RowFormat, dtype: torch.dtype) -> float:
        if not fq.quantizes(dim, _BLOCKS[fmt]):
            return dim * torch.empty(0, dtype=dtype).element_size()
        elements = dim if fmt == "fp8_window" else dim / 2
        return elements + dim // _BLOCKS[fmt]

    def store(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Quantise `values` `[n, dim]` and write them at `rows` `[n]`."""
        if not self.packed:
            self.data[rows] = values.to(self.dtype)
            return
        assert self.scales is not None
        elements, scales = _QUANTIZE[self.fmt](values)
        self.data[rows] = elements.view(torch.uint8)
        self.scales[rows] = scales.view(torch.uint8)

    def load(self, rows: torch.Tensor) -> torch.Tensor:
        """The values at `rows` (any shape) `[*rows.shape, dim]` in the pool's dtype (the torch
        path; `srt/layers/quant_store.py::quant_load_impl` picks the kernel family's)."""
        if not self.packed:
            return self.data[rows]
        assert self.scales is not None
        return fq.quant_load(self.data, self.scales, rows, self.fmt, self.dtype)


@dataclass
class PairState:
    """Raw (kv, gate) fp32 rows of the last R positions of each request slot: `[slots, R, Dh]`."""

    kv: torch.Tensor
    score: torch.Tensor

    @property
    def ring(self) -> int:
        return self.kv.shape[1]


@dataclass
class SourceState:
    """What a kv source owns and its consumers read."""

    ratio: int
    latents: QuantizedRows
    index_keys: QuantizedRows
    pairs: PairState | None


class DeepseekV41KVPool(BaseKVPool):
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        req_slots: int,
        max_verify_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        v41 = cfg.v41
        assert v41 is not None, "the V4.1 pool needs a V4.1 config"
        self.num_slots = num_slots
        dh, di = cfg.head_dim, cfg.index_head_dim
        self.window = [
            QuantizedRows(num_slots, dh, "fp8_window", dtype, device)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sources: dict[int, SourceState] = {}
        for src in v41.kv_source_layer_ids:
            m = v41.compress_ratios[src]
            assert num_slots % m == 0, (num_slots, m)
            pairs = None
            if m > 1:
                # A verify of W rows writes W ring rows; the committed row before them must
                # survive until the next forward pairs with it.
                ring = _next_pow2(m + max_verify_tokens)
                shape = (req_slots, ring, dh)
                pairs = PairState(
                    kv=torch.zeros(shape, dtype=torch.float32, device=device),
                    score=torch.zeros(shape, dtype=torch.float32, device=device),
                )
            self.sources[src] = SourceState(
                ratio=m,
                latents=QuantizedRows(num_slots // m, dh, "fp4_latent", dtype, device),
                index_keys=QuantizedRows(num_slots // m, di, "fp4_index", dtype, device),
                pairs=pairs,
            )
        self.token_ids: torch.Tensor | None = None
        if v41.engram is not None:
            self.token_ids = torch.zeros(num_slots, dtype=torch.int64, device=device)

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> float:
        v41 = cfg.v41
        assert v41 is not None
        total = cfg.num_hidden_layers * QuantizedRows.bytes_per_row(
            cfg.head_dim, "fp8_window", dtype
        )
        for src in v41.kv_source_layer_ids:
            latent = QuantizedRows.bytes_per_row(cfg.head_dim, "fp4_latent", dtype)
            key = QuantizedRows.bytes_per_row(cfg.index_head_dim, "fp4_index", dtype)
            total += (latent + key) / v41.compress_ratios[src]
        return total + (8 if v41.engram is not None else 0)
