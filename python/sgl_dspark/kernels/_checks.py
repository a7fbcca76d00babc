"""Argument checks shared by the kernel launchers (user-facing errors: ValueError)."""

from __future__ import annotations

import torch


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...],
                 dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    """Exact shape, one of `dtypes`, contiguous, on `device`; the message names the argument."""
    require(tuple(t.shape) == shape, f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    require(t.dtype in dtypes, f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    require(t.is_contiguous(), f"{name}: must be contiguous")
    require(t.device == device, f"{name}: expected device {device}, got {t.device}")
