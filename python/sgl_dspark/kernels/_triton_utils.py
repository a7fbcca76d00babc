"""Triton helpers shared by several kernel modules."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def interpreted(kernel: object) -> bool:
    """True when `kernel` runs in the CPU interpreter (TRITON_INTERPRET=1). Its fp32 -> bf16
    cast truncates (kernels.md §0.4), so kernels round on the bits there (`round_to_bf16`);
    compiled, the native cast already rounds to nearest even (one instruction instead of six
    integer ops per element, which shows at the ~1 us scale of a decode-step kernel)."""
    return isinstance(kernel, InterpretedFunction)


@triton.jit
def round_to_bf16(x):
    """fp32 -> nearest-even bf16 value, kept in fp32 (NaN passes through). Portable: the CPU
    interpreter's own fp32 -> bf16 cast truncates (kernels.md §0.4), and the later store of an
    exact bf16 value is lossless."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def round_to_storage(x, KIND: tl.constexpr):
    """fp32 -> the nearest-even value of a storage dtype, kept in fp32 (exact on store):
    KIND 0 fp32 (identity), 1 bf16 (on the bits, `round_to_bf16`), 2 fp16 (whose cast rounds to
    nearest-even on every backend)."""
    if KIND == 1:
        x = round_to_bf16(x)
    elif KIND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def round_bf16_native_or_bits(x, ON_BITS: tl.constexpr):
    """fp32 -> nearest-even bf16 value, kept in fp32: on the bits in the interpreter
    (`ON_BITS`, see `interpreted`), else through the native round-to-nearest-even cast. Both
    give the same bits (NaN stays NaN)."""
    if ON_BITS:
        x = round_to_bf16(x)
    else:
        x = x.to(tl.bfloat16).to(tl.float32)
    return x
