"""Weight bytes pulled into L2 ahead of the GEMM that streams them (`l2_prefetch`).

A decode step alternates kernels that stream weights from HBM (the quantised linears, the MoE
stages) with kernels that read almost nothing (the mHC boundary, the attention over a few
hundred cached keys, the router): during the latter HBM sits idle. A prefetch launched on a side
stream as such a stretch begins (`srt/layers/weight_prefetch.py` decides where) fetches the next
GEMM's first bytes into L2 while it lasts, so that GEMM's programs find them there and wait on
L2's latency instead of HBM's.

The kernel issues one `prefetch.global.L2` per 128-byte line: program p of region r takes lines
p * BLOCK .. of r, then every `programs * BLOCK`-th block after (one line a thread a step). A
prefetch has no destination register and no ordering: the program retires as soon as its hints
are issued, and nothing any kernel computes depends on it. NVIDIA only (PTX); the launcher
refuses other devices, whose callers do not prefetch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import prefetch_l2, sm_count

LINE_BYTES = 128
MAX_REGIONS = 4
_BLOCK = 128  # lines a program hints per step: one per thread of its 4 warps


@triton.jit
def _prefetch_region(ptr, nbytes, BLOCK: tl.constexpr):
    lines = (nbytes + 127) // 128
    step = tl.num_programs(0) * BLOCK
    for first in range(tl.program_id(0) * BLOCK, lines, step):
        line = tl.minimum(first + tl.arange(0, BLOCK), lines - 1)  # repeats are harmless
        prefetch_l2(ptr + line.to(tl.int64) * 128)


@triton.jit
def _l2_prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, BLOCK: tl.constexpr):
    region = tl.program_id(1)
    if region == 0:
        _prefetch_region(p0, n0, BLOCK)
    elif region == 1:
        _prefetch_region(p1, n1, BLOCK)
    elif region == 2:
        _prefetch_region(p2, n2, BLOCK)
    else:
        _prefetch_region(p3, n3, BLOCK)


def prefetch_plan(
    regions: Sequence[torch.Tensor], max_bytes: int
) -> list[tuple[torch.Tensor, int]]:
    """The byte ranges `l2_prefetch` hints: each region's leading bytes, in order, until
    `max_bytes` are taken (a region cut short keeps its first bytes: a GEMM's programs start
    at the beginning of their rows' K range, and rows are stored one after another). Regions
    are contiguous tensors of one device; empty ones and those past the budget are left out.
    Returns (region as flat bytes, bytes to hint)."""
    require(max_bytes >= 0, f"max_bytes must be >= 0, got {max_bytes}")
    plan: list[tuple[torch.Tensor, int]] = []
    left = max_bytes
    for i, region in enumerate(regions):
        require(
            region.is_contiguous(),
            f"regions[{i}]: a contiguous tensor is needed, got strides {region.stride()}",
        )
        require(
            region.device == regions[0].device,
            f"regions[{i}] is on {region.device}, regions[0] on {regions[0].device}",
        )
        size = region.numel() * region.element_size()
        take = min(size, left)
        if take > 0:
            plan.append((region.reshape(-1).view(torch.uint8), take))
            left -= take
    require(
        len(plan) <= MAX_REGIONS,
        f"at most {MAX_REGIONS} regions a launch, got {len(plan)} within the budget",
    )
    return plan


def l2_prefetch(regions: Sequence[torch.Tensor], max_bytes: int) -> int:
    """Hint the leading bytes of `regions` into L2, at most `max_bytes` in all
    (`prefetch_plan`), in one launch on the current stream; returns the bytes hinted. Nothing
    waits for the lines to arrive. NVIDIA GPUs only (ValueError elsewhere)."""
    plan = prefetch_plan(regions, max_bytes)
    if not plan:
        return 0
    device = plan[0][0].device
    require(
        device.type == "cuda" and torch.version.hip is None,
        f"l2_prefetch runs on NVIDIA GPUs (PTX prefetch), got {device}",
    )
    args: list[object] = []
    for region, take in plan:
        args += [region, take]
    args += [plan[0][0], 0] * (MAX_REGIONS - len(plan))  # never reached: grid axis 1 stops
    lines = max(triton.cdiv(take, LINE_BYTES) for _, take in plan)
    programs = max(1, min(sm_count(device), triton.cdiv(lines, _BLOCK)))
    _l2_prefetch_kernel[(programs, len(plan))](*args, BLOCK=_BLOCK, num_warps=4)
    return sum(take for _, take in plan)


__all__ = ["LINE_BYTES", "MAX_REGIONS", "l2_prefetch", "prefetch_plan"]
