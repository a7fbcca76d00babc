"""The environment variables the package reads (every other knob is a server argument)."""

from __future__ import annotations

import os

# Where built-in models are materialised as Hugging Face directories.
CACHE_ENV = "SGL_DSPARK_CACHE"


def cache_root() -> str:
    """`$SGL_DSPARK_CACHE`, else `$XDG_CACHE_HOME/sglang-dspark`, else `~/.cache/sglang-dspark`."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang-dspark")


# Tests only: the CPU graph stand-ins (`EagerGraph`) enforce the graph pool's rule
# (`srt/model_executor/cuda_graph_runner.py`); set by `pytest --poison-stale-graph-outputs`.
POISON_STALE_GRAPH_OUTPUTS_ENV = "SGL_DSPARK_POISON_STALE_GRAPH_OUTPUTS"


def poison_stale_graph_outputs() -> bool:
    """Whether `$SGL_DSPARK_POISON_STALE_GRAPH_OUTPUTS` is 1."""
    return os.environ.get(POISON_STALE_GRAPH_OUTPUTS_ENV) == "1"
