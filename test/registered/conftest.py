"""Test-wide setup. Kernel tests run under the Triton CPU interpreter when no GPU is present;
on a GPU box the same tests run compiled."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined (i.e. before kernel modules import).
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Only the interpreter's entry points change (compiled launches never reach them).
from interpreter_shortcuts import install as install_interpreter_shortcuts  # noqa: E402

install_interpreter_shortcuts()

# pytest-xdist runs one worker per core: one intra-op thread each avoids oversubscription.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--fence-allocations",
        action="store_true",
        help="follow every float CPU tensor with NaN memory (fenced_allocations.py)",
    )
    parser.addoption(
        "--poison-stale-graph-outputs",
        action="store_true",
        help="EagerGraph replays poison the pool outputs of regions captured after them "
        "(cuda_graph_runner.py's module doc)",
    )


def pytest_configure(config) -> None:
    if config.getoption("--poison-stale-graph-outputs"):
        from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph

        EagerGraph.poison_by_default = True
        # Ranks spawned by the parallel tests read it from here (rank_engines.py).
        os.environ["SGL_DSPARK_TEST_POISON_STALE_GRAPH_OUTPUTS"] = "1"
    if config.getoption("--fence-allocations"):
        from fenced_allocations import install

        install()
