"""`pytest --fence-allocations`: every floating-point CPU tensor made by torch's factory
functions (and by the copying methods a launcher uses to prepare its inputs; `as_tensor`, which
may alias its input, is left alone) is the start of a
longer buffer whose tail is NaN. Under the Triton interpreter a kernel reads raw host memory, so
an unmasked load past the end of a tensor then reads NaN and shows up in the results, where
without the fence it reads whatever the allocator left there (usually finite, so the bug stays
silent until it is not). Off by default: the patched factories slow a run down several times."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# Elements of NaN after every fenced tensor: more than any kernel's tile reaches past a row.
FENCE = 4096

_full = torch.full
_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "randn",
    "rand",
    "tensor",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "randn_like",
)
_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "contiguous", "clone", "float", "to")


def fence(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a contiguous view at the start of a buffer followed by FENCE NaN; tensors
    that cannot be fenced (not floating point, not on the CPU, 0-d, not contiguous, or
    requiring grad) are returned as they are."""
    if (
        not isinstance(t, torch.Tensor)
        or not t.is_floating_point()
        or t.device.type != "cpu"
        or t.dim() == 0
        or not t.is_contiguous()
        or t.requires_grad
    ):
        return t
    buf = _full((t.numel() + FENCE,), float("nan"), dtype=t.dtype, device="cpu")
    view = buf[: t.numel()].view(t.shape)
    view.copy_(t)
    return view


def _fenced_factory(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(make)
    def wrapper(*args, **kwargs):
        return fence(make(*args, **kwargs))

    return wrapper


def _fenced_method(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        return out if out is self else fence(out)

    return wrapper


def install() -> None:
    """Fence every later allocation of the process (for the whole pytest session)."""
    for name in _FACTORIES:
        setattr(torch, name, _fenced_factory(getattr(torch, name)))
    for name in _METHODS:
        setattr(torch.Tensor, name, _fenced_method(getattr(torch.Tensor, name)))
