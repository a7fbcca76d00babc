"""The launch floor of the kernel table: one kernel that adds 1 to a single element, timed by
`run_all.py` exactly as every other case (CUDA graph of back-to-back calls, ABBA against
torch.compile of the same one-element op).

Why it is in the table: for a fusion that torch.compile also emits as one kernel (the route
reduce, the clamped SwiGLU, RMSNorm) a ">= 3x compile" target would need ours below a third of
compile's time. This
row measures what no kernel can go below in the same harness: a launch with programmatic
dependent launch (ours) and a compiled one-element kernel (compile). If a third of a compiled
case's time is below "ours" here, no kernel, fused or not, can reach 3x on that case.

Bench-only: the kernel is not part of `sgl_dspark.kernels` (it does nothing the engine needs).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers


@triton.jit
def _add_one_kernel(x_ptr, out_ptr, PDL: tl.constexpr):
    # The library's kernel protocol: wait for the producer before the first load and store.
    wait_for_producers(PDL)
    tl.store(out_ptr, tl.load(x_ptr) + 1.0)


def add_one(x: torch.Tensor) -> torch.Tensor:
    """x + 1 for a one-element fp32 tensor, one program, launched as the library's kernels."""
    out = torch.empty_like(x)
    _add_one_kernel[(1,)](x, out, **programmatic_launch(_add_one_kernel, x.device))
    return out


def add_one_ref(x: torch.Tensor) -> torch.Tensor:
    return x + 1.0


def _make_inputs(m: int, device: str) -> dict[str, Any]:
    # One element whatever M: the row is a floor, not a shape sweep (M only labels the row).
    gen = torch.Generator().manual_seed(m)
    return dict(x=torch.randn(1, generator=gen).to(device))


def _check(want: torch.Tensor, got: torch.Tensor) -> None:
    assert torch.equal(got, want)


CASES: list[dict[str, Any]] = [
    dict(
        name="launch_floor_add_one_element",
        make_inputs=_make_inputs,
        reference=add_one_ref,
        launcher=add_one,
        check=_check,
        bytes_moved=lambda m: 8,
    ),
]
