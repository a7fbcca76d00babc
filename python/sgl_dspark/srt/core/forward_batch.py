"""ForwardBatch: one flat token batch of many requests (prefill chunks, decode, verify).

Request r contributes `extend_lens[r]` consecutive tokens at positions
`prefix_lens[r] .. prefix_lens[r] + extend_lens[r] - 1`; its tokens are contiguous in the flat
batch and requests appear in batch order. `prefix_lens[r]` tokens of r are already in the KV state.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from sgl_dspark.srt.core.host_copy import to_device, to_device_packed

_Derived = TypeVar("_Derived")  # what `ForwardBatch.cached` keeps: a tensor or a tuple of them


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill or a chunk of it
    DECODE = "decode"  # one token per request
    VERIFY = "verify"  # W tokens per request whose state may later be rolled back


@dataclass(frozen=True)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    token_req: torch.Tensor  # [T] int64, batch row of each token
    out_cache_loc: torch.Tensor  # [T] int64, token slot each new token writes
    req_pool_indices: torch.Tensor  # [B] int64, request slot (row of req_to_token, state rings)
    prefix_lens: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, prefix + extend
    logits_indices: torch.Tensor  # [N] int64, flat rows whose logits are computed
    req_to_token: torch.Tensor  # [slots, max_ctx] int64 (shared table, not a copy)
    max_seq_len: int  # host: max(seq_lens), sizes the gathers
    extend_lens_cpu: tuple[int, ...]
    prefix_lens_cpu: tuple[int, ...]
    # False for an EXTEND batch over the static buffers of a prefill graph: its host lengths are
    # placeholders, so the row lists below come from device tensors (see `block_end_rows`).
    host_lens: bool = True
    # Tensors derived from the batch alone (token slots, entry tables), computed once per forward
    # and shared by every layer; the model clears it when a forward starts, so a captured CUDA
    # graph recomputes them inside the graph instead of reading a stale warm-up result.
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def cached(self, key: object, compute: Callable[[], _Derived]) -> _Derived:
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def token_slots(self) -> torch.Tensor:
        """[T] request slot (row of req_to_token) of every token."""
        return self.cached("token_slots", lambda: self.req_pool_indices[self.token_req])

    def token_prefix_lens(self) -> torch.Tensor:
        """[T] prefix length of every token's request."""
        return self.cached("token_prefix", lambda: self.prefix_lens[self.token_req])

    # Row lists of EXTEND batches, from host-known lengths (no device read: a synchronisation)
    # or, for a prefill graph's batch (`host_lens` False), computed on the device and padded
    # with -1 to a size fixed by the batch shape; consumers skip the -1 rows. Decode/verify graphs
    # build batches with placeholder host lengths: only EXTEND batches may call these.
    def block_end_rows(self, ratio: int) -> torch.Tensor:
        """[n] int64 flat rows whose position ends a block of `ratio` ((pos + 1) % ratio == 0)."""

        def compute() -> torch.Tensor:
            if not self.host_lens:
                # A request of n rows ends at most n // ratio + 1 blocks.
                cap = min(
                    self.num_tokens, self.num_tokens // ratio + self.req_pool_indices.shape[0]
                )
                ends = (self.positions + 1).remainder(ratio) == 0
                return compact_rows(ends & self._real_rows(), cap)
            rows: list[int] = []
            start = 0
            for p0, n in zip(self.prefix_lens_cpu, self.extend_lens_cpu):
                first = -(-(p0 + 1) // ratio) * ratio - 1  # the first block end >= p0
                rows.extend(range(start + first - p0, start + n, ratio))
                start += n
            return to_device(rows, torch.int64, self.positions.device)

        return self.cached(("block_end_rows", ratio), compute)

    def last_rows(self, count: int) -> torch.Tensor:
        """[n] int64 flat rows among the last `count` positions of their request."""

        def compute() -> torch.Tensor:
            if not self.host_lens:
                cap = min(self.num_tokens, count * self.req_pool_indices.shape[0])
                last = self.positions >= self.seq_lens[self.token_req] - count
                return compact_rows(last & self._real_rows(), cap)
            rows: list[int] = []
            start = 0
            for n in self.extend_lens_cpu:
                rows.extend(range(start + max(0, n - count), start + n))
                start += n
            return to_device(rows, torch.int64, self.positions.device)

        return self.cached(("last_rows", count), compute)

    def _real_rows(self) -> torch.Tensor:
        """[T] bool: rows of real requests (padding rows belong to request slot 0, reserved)."""
        return self.cached("real_rows", lambda: self.token_slots() != 0)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def uniform(
        cls,
        mode: ForwardMode,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        req_to_token: torch.Tensor,
        max_seq_len: int,
    ) -> ForwardBatch:
        """A batch of B requests with W rows each, from device tensors only (`[B, W]` ids,
        positions and token slots, `[B]` request slots and lengths), logits on every row: the
        shape captured CUDA graphs run. Host lengths are placeholders (W rows each, prefix 0),
        so nothing built here reads the device."""
        bs, w = input_ids.shape
        n = bs * w
        rows = torch.arange(n, dtype=torch.int64, device=input_ids.device)
        return cls(
            mode=mode,
            input_ids=input_ids.reshape(n),
            positions=positions.reshape(n),
            token_req=rows // w,
            out_cache_loc=out_cache_loc.reshape(n),
            req_pool_indices=req_pool_indices,
            prefix_lens=prefix_lens,
            seq_lens=seq_lens,
            logits_indices=rows,
            req_to_token=req_to_token,
            max_seq_len=max_seq_len,
            extend_lens_cpu=(w,) * bs,
            prefix_lens_cpu=(0,) * bs,
        )

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: list[list[int]],
        prefix_lens: list[int],
        req_pool_indices: list[int],
        req_to_token: torch.Tensor,
        logits_rows: str | list[list[int]] = "last",
        input_ids_device: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """Build from host lists. `logits_rows`: "last" (last token of each request), "all",
        or per request the offsets (within its extend) that need logits. `input_ids_device`
        (flat `[T]`) replaces the host ids, so tokens produced on the device (DSpark drafts)
        never round-trip through the host; `input_ids` then only gives the lengths."""
        device = req_to_token.device
        extend = [len(ids) for ids in input_ids]
        assert all(n > 0 for n in extend), f"every request needs >= 1 token, got {extend}"
        assert len(prefix_lens) == len(extend) == len(req_pool_indices)
        flat_ids = [t for ids in input_ids for t in ids]
        positions: list[int] = []
        token_req: list[int] = []
        rows: list[int] = []
        start = 0
        for r, (p0, n) in enumerate(zip(prefix_lens, extend)):
            positions.extend(range(p0, p0 + n))
            token_req.extend([r] * n)
            if logits_rows == "last":
                rows.append(start + n - 1)
            elif logits_rows == "all":
                rows.extend(range(start, start + n))
            else:
                assert not isinstance(logits_rows, str), logits_rows
                rows.extend(start + j for j in logits_rows[r])
            start += n

        seq = [p + n for p, n in zip(prefix_lens, extend)]
        assert max(seq) <= req_to_token.shape[1], f"sequence {max(seq)} exceeds the context table"
        host_ids = flat_ids if input_ids_device is None else []
        ids_t, pos_t, req_t, pool_t, prefix_t, seq_t, rows_t = to_device_packed(
            [host_ids, positions, token_req, list(req_pool_indices), list(prefix_lens), seq, rows],
            torch.int64,
            device,
        )
        out_loc = req_to_token[pool_t[req_t], pos_t]
        if input_ids_device is not None:
            ids_t = input_ids_device
        assert ids_t.shape[0] == len(flat_ids), (ids_t.shape, len(flat_ids))
        return cls(
            mode=mode,
            input_ids=ids_t,
            positions=pos_t,
            token_req=req_t,
            out_cache_loc=out_loc,
            req_pool_indices=pool_t,
            prefix_lens=prefix_t,
            seq_lens=seq_t,
            logits_indices=rows_t,
            req_to_token=req_to_token,
            max_seq_len=max(seq),
            extend_lens_cpu=tuple(extend),
            prefix_lens_cpu=tuple(prefix_lens),
        )


def compact_rows(mask: torch.Tensor, size: int) -> torch.Tensor:
    """Indices of the true entries of `mask` [T] in ascending order, padded with -1 to [size]
    (at least the number of true entries), without reading the device: each true entry goes to
    its rank, the others to a discarded extra element."""
    rank = torch.cumsum(mask, 0) - 1
    dest = torch.where(mask, rank, size)
    out = torch.full((size + 1,), -1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, dest, torch.arange(mask.shape[0], device=mask.device))
    return out[:size]
