"""How an offline `Engine` with two ranks lets its second rank go: released in step with rank 0
(the rank's own exit, status 0), or, when rank 0's scheduler hung inside a step
(`shutdown(scheduler_stuck=True)`, the server's path after its watchdog fired), killed without
waiting on a collective. Each run is its own process (it joins a process group)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from worlds import run_world

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from sgl_dspark import Engine

    if __name__ == "__main__":  # the ranks are spawned: they import this file
        stuck = sys.argv[1] == "stuck"
        e = Engine(model_path="tiny", device="cpu", tp_size=2, max_total_tokens=1024,
                   context_length=128, skip_tokenizer_init=True)
        procs = list(e.ranks.procs)
        out = e.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 3})
        e.shutdown(scheduler_stuck=stuck)
        codes = [p.exitcode for p in procs]
        print(json.dumps({"tokens": len(out["output_ids"]), "codes": codes}))
    """
)


@pytest.mark.parametrize("mode, code", [("released", 0), ("stuck", -signal.SIGKILL)])
def test_the_second_rank_is_released_or_killed(tmp_path: Path, mode: str, code: int) -> None:
    script = tmp_path / "engine_ranks.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), mode], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # The ranks' stderr says why a rank ended otherwise (a fatal signal prints its threads' stacks).
    assert result == {"tokens": 3, "codes": [code]}, done.stderr[-3000:]


def _leave_after_groups(rank: int, out_dir: Path) -> None:
    import torch.distributed as dist
    from sgl_dspark.srt.distributed import (
        ParallelLayout,
        get_parallel_state,
        init_parallel_state,
        leave_world,
        parallel_state,
    )

    init_parallel_state(ParallelLayout(tp_size=2))
    held = len(parallel_state._GROUPS)
    leave_world()
    state = {
        "held": held,
        "left": len(parallel_state._GROUPS),
        "initialized": dist.is_initialized(),
        "single": get_parallel_state().is_single,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(state))


def _leave_with_groups_in_a_cycle(rank: int, out_dir: Path) -> None:
    import gc

    from sgl_dspark.srt.distributed import (
        ParallelLayout,
        TorchDistCommunicator,
        get_parallel_state,
        init_parallel_state,
        leave_world,
    )

    def alive() -> int:  # unreachable objects the collector has not yet freed count too
        return sum(isinstance(o, TorchDistCommunicator) for o in gc.get_objects())

    init_parallel_state(ParallelLayout(tp_size=2))
    # A finished engine: its parts refer to each other and to the communicators.
    engine: dict = {"parallel_state": get_parallel_state()}
    engine["model"] = {"engine": engine, "tp": get_parallel_state().tp}
    held = alive()
    del engine
    gc.disable()  # only leave_world may collect the cycle
    try:
        unreachable = alive()
        leave_world()
        left = alive()
    finally:
        gc.enable()
    (out_dir / f"rank{rank}.json").write_text(json.dumps([held, unreachable, left]))


def test_leaving_the_world_frees_communicators_held_in_cycles(tmp_path: Path) -> None:
    """Communicators that only a finished engine's reference cycle still holds are freed by
    `leave_world` before it destroys the process group, not at interpreter finalisation."""
    run_world(2, _leave_with_groups_in_a_cycle, tmp_path)
    for rank in range(2):
        held, unreachable, left = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert held >= 1 and unreachable == held and left == 0, (rank, held, unreachable, left)


def test_leaving_the_world_forgets_its_groups(tmp_path: Path) -> None:
    """`leave_world` destroys the process group after dropping the groups this process made
    (so their threads end before interpreter finalisation) and makes the size-1 state current."""
    run_world(2, _leave_after_groups, tmp_path)
    for rank in range(2):
        state = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert state == {"held": 1, "left": 0, "initialized": False, "single": True}
