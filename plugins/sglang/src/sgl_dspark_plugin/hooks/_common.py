"""What every kernel hook shares: where our kernels can run, and a once-per-reason note when a
hook hands a call back to SGLang's own path."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("sgl_dspark_plugin")

_noted: set[tuple[str, str]] = set()


def kernels_run_on(*tensors: torch.Tensor) -> bool:
    """Our Triton kernels run on a GPU, or on CPU tensors under the Triton interpreter (how the
    contract tests run them without a GPU)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return all(t.is_cuda or (interpreted and t.device.type == "cpu") for t in tensors)


def decline(hook: str, reason: str) -> None:
    """Log (once per hook and reason) that a call went to SGLang's implementation: the hook's
    preconditions are narrower than SGLang's function, and SGLang's result is always valid."""
    key = (hook, reason)
    if key not in _noted:
        _noted.add(key)
        logger.info("sglang-dspark %s hook: SGLang's path for this call (%s)", hook, reason)
