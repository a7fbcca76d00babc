"""Parallel state and collectives of one host's ranks (`parallel_state.py`, `communicator.py`).

A process that runs one model shard sets its `ParallelState` once (`set_parallel_state`); model
code reads it at construction (`get_parallel_state`), so a single-process engine sees the
size-1 state, whose communicators do nothing and call no `torch.distributed` function.
"""

from __future__ import annotations

from sgl_dspark.srt.distributed.communicator import (
    Communicator,
    SingleProcessCommunicator,
    TorchDistCommunicator,
)
from sgl_dspark.srt.distributed.parallel_state import (
    ParallelLayout,
    ParallelState,
    get_parallel_state,
    init_distributed,
    init_parallel_state,
    leave_world,
    replicated,
    set_parallel_state,
    single_process_state,
)

__all__ = [
    "Communicator",
    "ParallelLayout",
    "ParallelState",
    "SingleProcessCommunicator",
    "TorchDistCommunicator",
    "get_parallel_state",
    "init_distributed",
    "init_parallel_state",
    "leave_world",
    "replicated",
    "set_parallel_state",
    "single_process_state",
]
