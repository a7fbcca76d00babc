"""One communicator interface over a group of ranks: all-reduce (sum), all-gather and broadcast
of host objects.

`SingleProcessCommunicator` is the group of one: every call returns its input and touches no
`torch.distributed` state, so the size-1 engine pays nothing. `TorchDistCommunicator` runs the
collectives of `torch.distributed` on one process group (NCCL on GPU, gloo on CPU); host objects
travel over a gloo group of the same ranks (a CPU group also on GPU, so broadcasting a request
never touches the device stream).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class Communicator(ABC):
    """Collectives of one group; `rank` is this process's index in it, `size` its length."""

    rank: int
    size: int

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group, in place; returns `x`."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` (same shape on every rank) concatenated along `dim` in rank order."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s picklable `obj` on every rank (the others pass anything, e.g. None)."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank of the group has arrived."""


class SingleProcessCommunicator(Communicator):
    """The group of one process: every collective is the identity."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None


class TorchDistCommunicator(Communicator):
    """`torch.distributed` collectives on `group` (ranks `ranks`, in group order); host objects
    go over `cpu_group` (a gloo group of the same ranks)."""

    def __init__(self, ranks: list[int], group: Any, cpu_group: Any) -> None:
        import torch.distributed as dist

        self.ranks = list(ranks)
        self.group = group
        self.cpu_group = cpu_group
        self.size = len(ranks)
        self.rank = self.ranks.index(dist.get_rank())
        self._dist = dist

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        self._dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        self._dist.barrier(group=self.cpu_group)
