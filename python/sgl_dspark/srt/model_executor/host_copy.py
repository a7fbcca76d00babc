"""Host values to device tensors without a stream synchronisation.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, which PyTorch follows
with a stream synchronisation: inside a decode step that would wait for the GPU work queued so
far. Staging through pinned memory with `non_blocking=True` keeps the copy stream-ordered and the
host free (the caching host allocator keeps the pinned buffer alive until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool] | torch.Tensor,
              dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
