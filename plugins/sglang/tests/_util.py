"""Helpers shared by the contract tests."""

from __future__ import annotations

import os
import subprocess
import sys

from sgl_dspark_plugin.hooks import HOOKS

ALL_HOOKS = ",".join(spec.name for spec in HOOKS)


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """Run ``code`` in a fresh interpreter of this venv; return stdout, fail with its output."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout
