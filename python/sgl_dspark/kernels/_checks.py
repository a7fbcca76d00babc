"""Argument checks shared by the kernel launchers.

A bad argument is the caller's error, so it raises `ValueError` whose message names the argument
and says what was expected. Launchers check every layout assumption before launching: a kernel
reads raw pointers, and a wrong stride would corrupt memory silently.
"""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def require(cond: bool, message: str) -> None:
    """Raise `ValueError(message)` unless `cond`."""
    if not cond:
        raise ValueError(message)


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
) -> None:
    """Exact shape, one of `dtypes`, contiguous, on `device`."""
    require(tuple(t.shape) == shape, f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    require(t.dtype in dtypes, f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    require(t.is_contiguous(), f"{name}: must be contiguous")
    require(t.device == device, f"{name}: expected device {device}, got {t.device}")


def check_index_vector(name: str, t: torch.Tensor, length: int) -> None:
    """int32/int64 `[length]` with unit stride (any stride when it has at most one element)."""
    require(
        t.dim() == 1 and t.shape[0] == length and t.dtype in INDEX_DTYPES,
        f"{name} must be int32/int64 [{length}], got {t.dtype} {tuple(t.shape)}",
    )
    require(length <= 1 or t.stride(0) == 1, f"{name} must be contiguous, got {t.stride()}")


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """Unit stride along the last dim (the other strides are free)."""
    require(
        t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1,
        f"{name} must have unit stride in its last dim, got strides {t.stride()}",
    )


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    require(len(set(devices.values())) == 1, f"all tensors must be on one device, got {devices}")
    return next(iter(devices.values()))
