"""Triton helpers shared by several kernel modules."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """fp32 -> nearest-even bf16 value, kept in fp32 (NaN passes through). Portable: the CPU
    interpreter's own fp32 -> bf16 cast truncates (kernels.md §0.4), and the later store of an
    exact bf16 value is lossless."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
