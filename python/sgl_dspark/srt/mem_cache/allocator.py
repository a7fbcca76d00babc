"""Host-side KV memory management: request slots and paged token slots.

`ReqToTokenPool` maps (request slot, position) -> token slot; `PagedTokenAllocator` hands out
pages of `page_size` contiguous token slots. Page 0 is reserved as the dummy page that padded
rows (CUDA-graph padding, dummy requests) point at, so it is never handed to a request.
"""

from __future__ import annotations

import torch

from sgl_dspark.srt.core.host_copy import to_device


class OutOfKVMemory(RuntimeError):
    """Raised when an allocation cannot be satisfied; the scheduler treats it as back-pressure."""


class PagedTokenAllocator:
    """Free list of pages. Token slot of (page p, offset o) is `p * page_size + o`."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(
                f"KV pool needs at least 2 pages (one is the dummy page), got {num_pages}"
            )
        self.page_size = page_size
        self.num_pages = num_pages
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfKVMemory(f"need {n} KV pages, {len(self._free)} free")
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return out[::-1]

    def free(self, pages: list[int]) -> None:
        assert all(0 < p < self.num_pages for p in pages), f"bad page ids {pages}"
        self._free.extend(pages)
        assert len(self._free) <= self.num_pages - 1, "double free of KV pages"


class ReqToTokenPool:
    """Per-request-slot page lists mirrored into a device table `req_to_token [slots, max_ctx]`.

    Slot 0 is reserved for padding rows: its table row points at the dummy page.
    """

    def __init__(
        self,
        max_reqs: int,
        max_context_len: int,
        allocator: PagedTokenAllocator,
        device: torch.device | str,
    ) -> None:
        ps = allocator.page_size
        self.allocator = allocator
        self.max_context_len = -(-max_context_len // ps) * ps
        self.size = max_reqs + 1
        self.req_to_token = torch.zeros(
            self.size, self.max_context_len, dtype=torch.int64, device=device
        )
        self._pages: dict[int, list[int]] = {}
        self._free_slots = list(range(self.size - 1, 0, -1))
        self._dummy_row = torch.arange(self.max_context_len, device=device) % ps

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def alloc_slot(self) -> int:
        if not self._free_slots:
            raise OutOfKVMemory("no free request slot")
        slot = self._free_slots.pop()
        self._pages[slot] = []
        return slot

    def capacity(self, slot: int) -> int:
        return len(self._pages[slot]) * self.allocator.page_size

    def pages_needed(self, slot: int, num_tokens: int) -> int:
        ps = self.allocator.page_size
        return max(0, -(-num_tokens // ps) - len(self._pages[slot]))

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Make positions [0, num_tokens) of `slot` addressable (allocating pages as needed)."""
        if num_tokens > self.max_context_len:
            raise ValueError(
                f"{num_tokens} tokens exceed the context table ({self.max_context_len})"
            )
        n_new = self.pages_needed(slot, num_tokens)
        if n_new == 0:
            return
        pages = self._pages[slot]
        new = self.allocator.alloc(n_new)
        ps = self.allocator.page_size
        start = len(pages)
        pages.extend(new)
        page_t = torch.tensor(new, dtype=torch.int64)
        slots = (page_t[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)
        self.req_to_token[slot, start * ps : (start + n_new) * ps] = to_device(
            slots, torch.int64, self.req_to_token.device
        )

    def free_slot(self, slot: int) -> None:
        self.allocator.free(self._pages.pop(slot))
        self.req_to_token[slot] = self._dummy_row
        self._free_slots.append(slot)
