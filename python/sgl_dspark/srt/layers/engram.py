"""Engram: an n-gram hash memory added to the mHC streams before a layer (DeepSeek-V4.1).

Hashing (once per forward for every engram layer): token t at position p sees the tokens at
p, p-1, ..., p-(N-1) (missing positions read the pad token), each through the compressed token
map (`tokenizer/engram_map.py`). With the layer's odd multipliers M, `r_0 = c_0 * M_0` and
`r_i = r_(i-1) XOR (c_i * M_i)`; the (i+1)-gram hash of head h is `r_i mod P[i-1][h]` plus the
row offset of that (n-gram, head) slice of the layer's table (int64, never overflowing:
`c * M < 2^63`).

Module (per engram layer): the rows of every hash are embedded and concatenated, projected to
one key per stream and one shared value; each stream j gets `sigmoid(signed_sqrt(dot_j)) *
value` added, where dot_j is the scaled product of the RMS-normalised stream, the key and
`q_weight * k_weight` (all fp32, each stream normalised on its own; `engram_gate_ref` is the
spec, the triton path one kernel whose row sums do not depend on the batch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sgl_dspark.kernels.engram.reference import engram_gate_ref, engram_gather_ref
from sgl_dspark.srt.configs.deepseek_v41 import EngramConfig
from sgl_dspark.srt.core.forward_batch import ForwardBatch
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.fused_linear import linear_impl
from sgl_dspark.srt.layers.quantized import WeightLike, mark_quantizable, module_weight


def ngram_history(
    batch: ForwardBatch, token_ids: torch.Tensor, n: int, pad_id: int
) -> torch.Tensor:
    """`[T, n]` token ids at positions p, p-1, ..., p-(n-1) of every row's request (the pad id
    before position 0), read from the per-slot ids of `token_ids` (this batch's rows already
    written there)."""
    shifts = torch.arange(n, device=batch.positions.device)
    pos = batch.positions[:, None] - shifts[None, :]
    slots = batch.req_to_token[batch.token_slots()[:, None], pos.clamp(min=0)]
    return torch.where(pos >= 0, token_ids[slots], torch.full_like(slots, pad_id))


# Parameter names (substrings) of the Engram hash tables: the tensors `--engram-table-location
# host` keeps in page-locked host memory.
ENGRAM_TABLE_NAMES = ("engram.embed.",)


def is_engram_table(name: str) -> bool:
    return any(part in name for part in ENGRAM_TABLE_NAMES)


# (table [V, E] plain or FP8 as released, compressed n-gram history [T, N], the layer's
# `EngramHash`, the rows' dtype: a plain table's own, any for a decoded one) -> [T, K * E]: the
# table rows of every hashed id, side by side
EngramLookupFn = Callable[[WeightLike, torch.Tensor, "EngramHash", torch.dtype], torch.Tensor]


def engram_lookup_impl(kernels: KernelChoice) -> EngramLookupFn:
    """The hashing and embedding gather of the "engram" family. torch: `EngramHash` (some ten
    kernels), then `engram_gather_ref` (an index, then the selected rows of an FP8 table
    dequantised). triton: `kernels/engram/gather.py::engram_gather_hashed`, one launch that
    hashes the ids from the history and decodes an FP8 table's rows, also from a table in
    page-locked host memory; both give the same bits."""
    if kernels.of("engram") == "torch":

        def lookup_torch(
            table: WeightLike, compressed: torch.Tensor, hashing: EngramHash, dtype: torch.dtype
        ) -> torch.Tensor:
            return engram_gather_ref(table, hashing(compressed), dtype)

        return lookup_torch
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.engram.gather import engram_gather_hashed

    def lookup_triton(
        table: WeightLike, compressed: torch.Tensor, hashing: EngramHash, dtype: torch.dtype
    ) -> torch.Tensor:
        return engram_gather_hashed(
            table,
            compressed.to(torch.int64).contiguous(),  # no-ops for the model's history
            hashing.multipliers,
            hashing.primes,
            hashing.offsets,
            dtype,
        )

    return lookup_triton


# (streams [T, n, D], kv [T, (n + 1) * D], q_weight [n, D], k_weight [n, D], eps) -> the
# streams with the gated value added [T, n, D] (streams' dtype)
EngramGateFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def engram_gate_impl(kernels: KernelChoice) -> EngramGateFn:
    """The gated add of the "engram" family. torch: `engram_gate_ref` (torch's fp32 reductions,
    whose split of a row may follow the batch's shape on a GPU). triton:
    `kernels/engram/gate.py::engram_gate`, one launch, one program per (token, stream), sums
    over D in a tree fixed by D: batch-invariant by construction, within a tolerance of the
    reference."""
    if kernels.of("engram") == "torch":
        return engram_gate_ref
    from sgl_dspark.kernels.engram.gate import engram_gate

    return engram_gate


class EngramHash(nn.Module):
    """The hashing constants of one engram layer, as non-persistent buffers."""

    multipliers: torch.Tensor  # [N] int64
    primes: torch.Tensor  # [N - 1, heads] int64
    offsets: torch.Tensor  # [(N - 1) * heads] int64

    def __init__(self, cfg: EngramConfig, index: int) -> None:
        super().__init__()
        # Derived buffers, on the host whatever the ambient device (a meta-device build).
        for name, values in (
            ("multipliers", cfg.multipliers[index]),
            ("primes", cfg.primes[index]),
            ("offsets", cfg.offsets(index)),
        ):
            host = torch.tensor(values, dtype=torch.int64, device="cpu")
            self.register_buffer(name, host, persistent=False)

    def forward(self, compressed: torch.Tensor) -> torch.Tensor:
        """compressed `[T, N]` compressed ids -> table rows `[T, (N - 1) * heads]` int64
        (n-gram size major, head minor)."""
        products = compressed * self.multipliers[None, :]
        mixed = products[:, 0]
        cols = []
        for i in range(1, products.shape[1]):
            mixed = torch.bitwise_xor(mixed, products[:, i])
            cols.append(mixed[:, None].remainder(self.primes[i - 1][None, :]))
        return torch.cat(cols, dim=1) + self.offsets[None, :]


class Engram(nn.Module):
    """`embed` (the hash table), `wkv`, `q_weight`, `k_weight` (checkpoint names), plus the
    hashing constants `hash`."""

    def __init__(
        self,
        cfg: EngramConfig,
        index: int,
        hidden_size: int,
        hc_mult: int,
        eps: float,
        kernels: KernelChoice | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.lookup = engram_lookup_impl(kernels or KernelChoice())
        self.gate = engram_gate_impl(kernels or KernelChoice())
        self.linear = linear_impl(kernels)
        self.hc_mult = hc_mult
        self.hash = EngramHash(cfg, index)
        self.embed = nn.Embedding(cfg.num_embeddings[index], cfg.head_dim)
        # FP8 rows with one exponent byte per 32 channels as released: kept so with
        # --weight-format native, only the gathered rows decoded.
        mark_quantizable(self.embed, "weight")
        self.wkv = nn.Linear(
            cfg.ids_per_token * cfg.head_dim, (hc_mult + 1) * hidden_size, bias=False
        )
        mark_quantizable(self.wkv, "weight")  # FP8 32 x 32 as released
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden_size))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden_size))

    def forward(self, streams: torch.Tensor, compressed_history: torch.Tensor) -> torch.Tensor:
        """streams `[T, n, D]`, compressed_history `[T, N]` -> streams with the gated value
        added (streams' dtype)."""
        # A table kept as stored decodes its rows to the streams' dtype (the runtime dtype, which
        # a table dequantised at load has).
        embedded = self.lookup(
            module_weight(self.embed), compressed_history, self.hash, streams.dtype
        )
        kv = self.linear(embedded, module_weight(self.wkv))
        return self.gate(streams, kv, self.q_weight, self.k_weight, self.eps)


__all__ = ["ENGRAM_TABLE_NAMES", "Engram", "EngramHash", "is_engram_table", "ngram_history"]
