"""One process per rank on one host: rank 0 (the caller: the HTTP server or the offline
`Engine`) spawns ranks 1..N-1, and every rank joins the `torch.distributed` world and builds the
same engine over its shard of the model.

Rank 0 owns HTTP, the tokenizer and every output; the others run `ReplicatedScheduler.
serve_forever` (they step when rank 0 broadcasts a step). A rank that dies takes the server
down with a clear error rather than leaving the others waiting in a collective: rank 0 watches
its children's process handles, and each child watches a pipe from rank 0 (closed when rank 0
dies, however it dies).
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, cast

from sgl_dspark.srt.distributed import (
    ParallelLayout,
    init_distributed,
    init_parallel_state,
    leave_world,
)

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from sgl_dspark.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 30.0


def layout_of(args: ServerArgs) -> ParallelLayout:
    return ParallelLayout(args.tp_size, args.ep_size)


def _free_addr() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def join_world(args: ServerArgs, rank: int, addr: str) -> None:
    """Join the world of `args`' layout as `rank` and make its parallel state current."""
    layout = layout_of(args)
    init_distributed(layout.world_size, rank, addr, args.device)
    state = init_parallel_state(layout, args.ep_combine)
    if args.device == "cuda":
        # The first collective of a NCCL group sets up its communicator: run it here, never
        # for the first time inside a CUDA-graph capture.
        import torch

        for comm in (state.tp, state.ep, state.world):
            comm.all_reduce(torch.zeros(1, device="cuda"))


class RankGroup:
    """Rank 0's handle on ranks 1..N-1 (`start` spawns them and joins the world)."""

    def __init__(self, procs: Sequence[BaseProcess], pipes: list[Connection]) -> None:
        self.procs = list(procs)
        self._pipes = pipes  # rank 0's ends: closing them (or dying) tells the children
        self._closing = threading.Event()
        self._watchdog = threading.Thread(
            target=self._watch, name="sgl-dspark-rank-watchdog", daemon=True
        )
        self._watchdog.start()

    @classmethod
    def start(cls, args: ServerArgs) -> RankGroup:
        layout = layout_of(args)
        addr = args.dist_init_addr or _free_addr()
        ctx = mp.get_context("spawn")
        procs, pipes = [], []
        for rank in range(1, layout.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=follower_main,
                args=(args, rank, addr, theirs),
                name=f"sgl-dspark-rank{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            procs.append(proc)
            pipes.append(ours)
        group = cls(procs, pipes)
        logger.info("rank 0 of %d: joining the world at %s", layout.world_size, addr)
        join_world(args, 0, addr)
        return group

    def _watch(self) -> None:
        pending = {p.sentinel: p for p in self.procs}
        while pending:
            for sentinel in wait(list(pending)):
                proc = pending.pop(cast("int", sentinel))
                if self._closing.is_set():
                    continue
                proc.join(5.0)  # reap it, for its exit code
                logger.critical(
                    "%s exited (code %s) while serving; the ranks cannot continue without it: "
                    "shutting the server down",
                    proc.name,
                    proc.exitcode,
                )
                for other in self.procs:
                    if other.is_alive():
                        other.kill()
                os._exit(1)

    def close(self, kill: bool = False) -> None:
        """After the scheduler released the followers: wait for them to exit. `kill`: they were
        not released (rank 0's scheduler hung inside a step): kill them now, and leave the
        process group as it is (a collective may still wait in it)."""
        self._closing.set()
        for proc in self.procs:
            if kill:
                proc.kill()
            proc.join(_JOIN_TIMEOUT_S)
            if proc.is_alive():
                logger.error("%s did not exit; killing it", proc.name)
                proc.kill()
        for pipe in self._pipes:
            pipe.close()
        if not kill:
            leave_world()


def _exit_when_leader_dies(pipe: Connection) -> None:
    try:
        pipe.recv()  # rank 0 never sends: this returns only by EOF, when rank 0 is gone
    except (EOFError, OSError):
        pass
    logger.critical("rank 0 is gone; this rank exits")
    os._exit(1)


def follower_main(args: ServerArgs, rank: int, addr: str, pipe: Connection) -> None:
    """Rank `rank` >= 1: join the world, build the engine, serve rank 0's steps, exit."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"[%(asctime)s] rank{rank} %(levelname)s %(name)s: %(message)s",
    )
    # Ctrl-C reaches every process of the terminal's group: rank 0 shuts the ranks down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A rank killed by a fatal signal (an abort inside a C++ library) prints each thread's
    # Python stack to its stderr, which rank 0's logs then show beside the exit code.
    faulthandler.enable()
    threading.Thread(target=_exit_when_leader_dies, args=(pipe,), daemon=True).start()
    from sgl_dspark.srt.entrypoints.engine import Engine
    from sgl_dspark.srt.managers.replicated_scheduler import ReplicatedScheduler

    try:
        join_world(args, rank, addr)
        engine = Engine.for_rank(args)
        assert isinstance(engine.scheduler, ReplicatedScheduler)
        engine.scheduler.serve_forever()
        engine.executor.close()
        leave_world()
    except BaseException:
        logger.exception("rank %d failed", rank)
        os._exit(1)
    # Released and out of the world, this rank has nothing left to do. It ends here rather than
    # through the interpreter's finalisation, which would destroy the engine's remaining C++
    # objects (communicator handles, CUDA graphs) after Python's own state is gone: a late
    # destructor there can abort the process (SIGABRT) although every step completed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
