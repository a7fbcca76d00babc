"""Spawned `torch.distributed` worlds (gloo, CPU) for the parallel tests: one world per test
module, each rank running one function that writes its results for the test process to read.

A rank that fails or a world that does not finish in time fails the test (every rank is killed),
never hangs it.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORLD_TIMEOUT_S = 900.0
COLLECTIVE_TIMEOUT_S = 600.0  # generous: ranks share two CPU cores with other test processes


def free_addr() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _rank_main(
    fn: Callable[..., None], rank: int, world: int, addr: str, out_dir: Path, args: tuple
) -> None:
    import torch
    import torch.distributed as dist
    from interpreter_shortcuts import install as install_interpreter_shortcuts
    from sgl_dspark.srt.distributed.parallel_state import init_distributed, leave_world

    install_interpreter_shortcuts()  # as in the test process (conftest.py)
    torch.set_num_threads(1)
    try:
        init_distributed(world, rank, addr, "cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
        fn(rank, out_dir, *args)
        if dist.is_initialized():  # `fn` may have left the world itself
            dist.barrier()
        leave_world()
    except BaseException:
        (out_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def run_world(world: int, fn: Callable[..., None], out_dir: Path, *args: Any) -> None:
    """Run `fn(rank, out_dir, *args)` on `world` spawned gloo ranks; raise with the failing
    rank's traceback if any fails or the world outlives `WORLD_TIMEOUT_S`."""
    ctx = mp.get_context("spawn")
    addr = free_addr()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, addr, out_dir, args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(WORLD_TIMEOUT_S)
            if p.is_alive():
                raise AssertionError(f"rank world did not finish in {WORLD_TIMEOUT_S} s")
            if p.exitcode != 0:
                errors = sorted(out_dir.glob("rank*.error"))
                text = "\n".join(e.read_text() for e in errors)
                raise AssertionError(f"a rank exited with {p.exitcode}:\n{text}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
