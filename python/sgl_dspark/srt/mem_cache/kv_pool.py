"""Device KV state of DeepSeek-V4, addressed through `ReqToTokenPool`.

Per layer:
* window KV `[num_slots, Dh]`: the rotated kv of every token at its token slot (K = V), in the
  runtime dtype or `window_dtype` (`--kv-cache-dtype`: FP8 E4M3 rows are the rotated rows
  saturated to +-448 and rounded once; attention reads them back exactly, in the runtime dtype);
* CSA/HCA compressed entries `[num_slots // m, Dh]`: entry w of a request lives at
  `req_to_token[r, w*m] // m` (pages are multiples of m, so block-start slots are multiples of m);
* CSA indexer keys `[num_slots // m, Di]`, same addressing;
* compressor state rings `[req_slots, R, width]` of raw (kv, gate) rows of the last R positions
  (position p at row p % R), for the compressor and the indexer. R covers the 2m (CSA) or m (HCA)
  rows a block needs plus the rows a rejected verify can overwrite;
* per compressor, int32 arrival counters `[num_slots // m]`, one per entry, for the pooling
  kernel when it splits a wide entry's channels over programs (zero between launches).

Rollback is free: everything is addressed by position, readers only read positions below their
own, and rejected positions are rewritten when real tokens reach them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_dspark.srt.configs.model_config import CSA, HCA, ModelConfig
from sgl_dspark.srt.mem_cache.base import BaseKVPool

# The largest finite E4M3 magnitude: FP8 window rows saturate here rather than overflow to NaN.
FP8_E4M3_MAX = 448.0


def store_kv_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """`pool[slots] = rows` in the pool's dtype: FP8 E4M3 pools take the rows saturated to
    +-FP8_E4M3_MAX and rounded to nearest even (written as bytes, so any device indexes them)."""
    if pool.dtype == torch.float8_e4m3fn:
        codes = rows.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(pool.dtype)
        pool.view(torch.uint8)[slots] = codes.view(torch.uint8)
    else:
        pool[slots] = rows.to(pool.dtype)


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


@dataclass
class CompressorState:
    kv: torch.Tensor  # [req_slots, R, width]
    score: torch.Tensor  # [req_slots, R, width]
    # [entries] int32, zero; None: a kernel that needs them zeroes its own per call
    entry_counters: torch.Tensor | None = None

    @property
    def ring(self) -> int:
        return self.kv.shape[1]


@dataclass
class LayerKV:
    window: torch.Tensor
    compress_ratio: int = 0
    compressed: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    comp_state: CompressorState | None = None
    index_state: CompressorState | None = None


class DeepseekV4KVPool(BaseKVPool):
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        req_slots: int,
        max_verify_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        window_dtype: torch.dtype | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.max_verify_tokens = max_verify_tokens
        self.layers: list[LayerKV] = []
        dh, di = cfg.head_dim, cfg.index_head_dim
        for i, lt in enumerate(cfg.layer_types):
            window = torch.zeros(num_slots, dh, dtype=window_dtype or dtype, device=device)
            if lt not in (CSA, HCA):
                self.layers.append(LayerKV(window=window))
                continue
            m = cfg.compress_ratio(i)
            assert num_slots % m == 0, (num_slots, m)
            overlap = lt == CSA
            span = 2 * m if overlap else m
            ring = _next_pow2(span + max_verify_tokens)
            width = 2 * dh if overlap else dh

            def state(w: int, ring: int = ring, entries: int = num_slots // m) -> CompressorState:
                return CompressorState(
                    kv=torch.zeros(req_slots, ring, w, dtype=dtype, device=device),
                    score=torch.zeros(req_slots, ring, w, dtype=dtype, device=device),
                    entry_counters=torch.zeros(entries, dtype=torch.int32, device=device),
                )

            layer = LayerKV(
                window=window,
                compress_ratio=m,
                compressed=torch.zeros(num_slots // m, dh, dtype=dtype, device=device),
                comp_state=state(width),
            )
            if overlap:
                layer.index_keys = torch.zeros(num_slots // m, di, dtype=dtype, device=device)
                layer.index_state = state(2 * di)
            self.layers.append(layer)

    @staticmethod
    def bytes_per_token(
        cfg: ModelConfig, dtype: torch.dtype, window_dtype: torch.dtype | None = None
    ) -> float:
        """Device bytes per token slot (window KV + amortised compressed entries and their
        arrival counters)."""
        elem = torch.empty(0, dtype=dtype).element_size()
        window_elem = torch.empty(0, dtype=window_dtype or dtype).element_size()
        total = 0.0
        for i, lt in enumerate(cfg.layer_types):
            total += cfg.head_dim * window_elem
            if lt in (CSA, HCA):
                m = cfg.compress_ratio(i)
                total += (cfg.head_dim * elem + 4) / m
                if lt == CSA:
                    total += (cfg.index_head_dim * elem + 4) / m
        return total
