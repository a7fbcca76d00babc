"""Who this process is among one host's ranks: its tensor-parallel (attention heads, vocabulary)
and expert-parallel (routed experts) positions, and the communicator of each group.

Layout: the world has `max(tp_size, ep_size)` ranks (the smaller size divides the larger).
Tensor-parallel groups are blocks of `tp_size` consecutive ranks and expert-parallel groups
blocks of `ep_size` consecutive ranks; every rank runs the same batch, so attention is
replicated across TP groups and the experts across EP groups. `--tp-size 4 --ep-size 4` splits
both over the same four ranks; `--ep-size 4` alone replicates attention on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sgl_dspark.srt.distributed.communicator import (
    Communicator,
    SingleProcessCommunicator,
    TorchDistCommunicator,
)

# Device collectives that do not finish within this time raise instead of hanging (a rank that
# died mid-step). Host-object broadcasts (the scheduler's inputs) run on their own gloo group
# without a practical limit, since an idle server waits there; a dead rank is noticed by the
# process watchdogs instead (`entrypoints/rank_group.py`).
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ParallelLayout:
    """Group sizes (`--tp-size`, `--ep-size`)."""

    tp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        for flag, size in (("--tp-size", self.tp_size), ("--ep-size", self.ep_size)):
            if size < 1:
                raise ValueError(f"{flag} must be >= 1, got {size}")
        big, small = max(self.tp_size, self.ep_size), min(self.tp_size, self.ep_size)
        if big % small:
            raise ValueError(
                f"--tp-size {self.tp_size} and --ep-size {self.ep_size}: the smaller must "
                "divide the larger (the world has max(tp, ep) ranks)"
            )

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)


@dataclass
class ParallelState:
    """This rank's position and the communicators of its groups (all size-1 in one process)."""

    layout: ParallelLayout = field(default_factory=ParallelLayout)
    rank: int = 0  # in the world of `layout.world_size` ranks
    tp: Communicator = field(default_factory=SingleProcessCommunicator)
    ep: Communicator = field(default_factory=SingleProcessCommunicator)
    world: Communicator = field(default_factory=SingleProcessCommunicator)
    # How expert-parallel ranks combine routed experts (`--ep-combine`): "exact" (bit-identical
    # to one rank) or "fast" (one all-reduce of the local sums).
    ep_combine: str = "exact"

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def ep_size(self) -> int:
        return self.ep.size

    @property
    def ep_rank(self) -> int:
        return self.ep.rank

    @property
    def is_single(self) -> bool:
        return self.layout.world_size == 1


def single_process_state() -> ParallelState:
    return ParallelState()


class _Current:
    """The process's current state (one process runs one rank)."""

    state = ParallelState()


def get_parallel_state() -> ParallelState:
    """The current process's state (the size-1 state unless `set_parallel_state` ran)."""
    return _Current.state


def set_parallel_state(state: ParallelState) -> ParallelState:
    """Make `state` current (models built from now on shard by it); returns the previous one."""
    previous, _Current.state = _Current.state, state
    return previous


@contextlib.contextmanager
def replicated() -> Iterator[None]:
    """Build modules inside this block whole on every rank (the DSpark draft): they see the
    size-1 state, so nothing in them is sharded or communicates."""
    previous = set_parallel_state(single_process_state())
    try:
        yield
    finally:
        set_parallel_state(previous)


def init_distributed(
    world_size: int,
    rank: int,
    init_addr: str,
    device: str,
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> None:
    """Join the `torch.distributed` world (NCCL on CUDA, gloo on CPU) at `init_addr`
    ("host:port", rank 0 listens there)."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{init_addr}",
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


_GROUPS: dict[tuple[int, ...], tuple[Any, Any]] = {}


def leave_world() -> None:
    """Leave the `torch.distributed` world: the size-1 state becomes current, the groups made
    here are forgotten and the process group is destroyed (no-op outside a world). Dropping our
    references first lets the gloo groups' worker threads end now, while the interpreter is
    whole, instead of at its finalisation (where a gloo work still holding a tensor can abort
    the process). A finished engine's modules and scheduler refer to each other, so the
    communicators they hold outlive the last reference to the engine until the cycle collector
    runs: it runs here, before the groups are destroyed."""
    import gc

    import torch.distributed as dist

    set_parallel_state(single_process_state())
    _GROUPS.clear()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _group(ranks: tuple[int, ...]) -> tuple[Any, Any]:
    """(device group, gloo group) of `ranks`, created once. Every rank of the world creates
    every group in the same order (`torch.distributed.new_group` is collective)."""
    import torch.distributed as dist

    if ranks not in _GROUPS:
        main = dist.new_group(list(ranks))
        cpu = dist.new_group(list(ranks), backend="gloo", timeout=_CONTROL_TIMEOUT)
        _GROUPS[ranks] = (main, cpu)
    return _GROUPS[ranks]


def _communicator(size: int, rank: int, world: int) -> Communicator:
    """The communicator of the block of `size` consecutive ranks holding `rank`; blocks tile
    the whole world, each created on every rank."""
    if size == 1:
        return SingleProcessCommunicator()
    mine: Communicator | None = None
    for start in range(0, world, size):
        ranks = tuple(range(start, start + size))
        main, cpu = _group(ranks)
        if rank in ranks:
            mine = TorchDistCommunicator(list(ranks), main, cpu)
    assert mine is not None
    return mine


def init_parallel_state(layout: ParallelLayout, ep_combine: str = "exact") -> ParallelState:
    """The state of `layout` in the initialised `torch.distributed` world (whose size is a
    multiple of the layout's: tests run several layouts side by side in one world), made
    current."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % layout.world_size:
        raise ValueError(f"a world of {world} ranks cannot hold layout {layout}")
    state = ParallelState(
        layout=layout,
        rank=rank % layout.world_size,
        tp=_communicator(layout.tp_size, rank, world),
        ep=_communicator(layout.ep_size, rank, world),
        world=_communicator(layout.world_size, rank, world),
        ep_combine=ep_combine,
    )
    set_parallel_state(state)
    return state
