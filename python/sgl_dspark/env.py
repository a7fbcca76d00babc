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
