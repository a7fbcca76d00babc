"""Host values to device tensors without a stream synchronisation.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, which PyTorch follows
with a stream synchronisation: inside a decode step that would wait for the GPU work queued so
far. Staging through pinned memory with `non_blocking=True` keeps the copy stream-ordered and the
host free (the caching host allocator keeps the pinned buffer alive until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device_packed(
    groups: Sequence[Sequence[int] | Sequence[float]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """Several host lists of one dtype through a single pinned buffer and a single copy: each
    copy is a driver call plus a graph-free kernel launch, so a decode step's dozen small
    inputs cost one transfer instead of a dozen. Returns contiguous views, one per group."""
    device = torch.device(device)
    flat = [v for g in groups for v in g]
    host = torch.tensor(flat, dtype=dtype, pin_memory=device.type == "cuda")
    whole = host.to(device, non_blocking=device.type == "cuda")
    out, start = [], 0
    for g in groups:
        out.append(whole[start : start + len(g)])
        start += len(g)
    return out


def read_to_host(*tensors: torch.Tensor) -> list[list]:
    """Device tensors as host lists through pinned buffers, non-blocking copies and one event
    wait: a step's several results cost one synchronisation instead of one per `.tolist()`."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return [h.tolist() for h in host]


class PendingRead:
    """Device tensors being copied to pinned host buffers; `wait()` synchronises on the copies'
    event only (not the whole stream), so work queued after them keeps the device busy."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type != "cuda":
            self._host = [t.detach().clone() for t in tensors]
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(self._host, tensors):
            h.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> list[list]:
        if self._event is not None:
            self._event.synchronize()
        return [h.tolist() for h in self._host]
