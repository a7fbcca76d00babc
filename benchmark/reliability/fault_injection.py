"""`python -m benchmark.reliability.fault_injection (--die-after-steps N | --hang-after-steps N)
[--when-running K] [server flags]`: the server of `sgl_dspark.launch_server` with a fault
injected into its scheduler thread after N scheduler steps (counted once K requests run at
once): the thread dies of an uncaught exception, or its step blocks forever (a hung device).
Testing only: the faults the server must survive cleanly."""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Sequence


class InjectedThreadDeath(BaseException):
    """Not an Exception: nothing in the scheduler loop catches it, so the thread dies."""


def install(die_after_steps: int | None, hang_after_steps: int | None, when_running: int) -> None:
    from sgl_dspark.srt.managers.scheduler_loop import SchedulerLoop

    real_step = SchedulerLoop._step
    steps = 0
    never = threading.Event()

    def step(self: SchedulerLoop) -> None:
        nonlocal steps
        if steps or len(self._scheduler.running) >= when_running:
            steps += 1
        if die_after_steps is not None and steps > die_after_steps:
            raise InjectedThreadDeath(f"injected after {die_after_steps} steps")
        if hang_after_steps is not None and steps > hang_after_steps:
            never.wait()
        real_step(self)

    SchedulerLoop._step = step  # type: ignore[method-assign]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--die-after-steps", type=int)
    group.add_argument("--hang-after-steps", type=int)
    parser.add_argument("--when-running", type=int, default=1)
    ns, server_argv = parser.parse_known_args(argv)
    install(ns.die_after_steps, ns.hang_after_steps, ns.when_running)
    from sgl_dspark.launch_server import main as launch

    return launch(server_argv)


if __name__ == "__main__":
    sys.exit(main())
