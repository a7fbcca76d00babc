"""The FP4 (E2M1) format in Triton (the module doc of `reference.py` defines it), shared by the
index-key and index-query kernels. Every float operation is elementwise with a defined rounding
(div_rn, bit tricks, exact power-of-two products, max), so results are bit-exact against the
references on any backend and in the CPU interpreter (the kernels launch with FMA contraction
disabled)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ceil_pow2_biased_exponent(v):
    """Biased exponent of the smallest power of two >= v (v positive normal fp32)."""
    bits = v.to(tl.int32, bitcast=True)
    return (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def pow2_from_biased_exponent(e):
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_encode(v):
    """RNE onto the E2M1 grid by counting crossed midpoints: a midpoint whose lower neighbour has
    an even code rounds down (strict >), one whose lower neighbour is odd rounds up (>=)."""
    a = tl.abs(v)
    mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    mag += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    mag += (a > 5.0).to(tl.int32)
    return mag + 8 * (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)


@triton.jit
def e2m1_decode(code):
    mag_code = code & 7
    mag = tl.where(
        mag_code < 4,
        mag_code.to(tl.float32) * 0.5,
        tl.where(mag_code < 6, (mag_code - 2).to(tl.float32), tl.where(mag_code == 6, 4.0, 6.0)),
    )
    # Multiply (not negate): Triton lowers -x as 0 - x, which turns -0.0 into +0.0.
    return mag * tl.where(code >= 8, -1.0, 1.0)


@triton.jit
def fp4_quant_groups(even, odd):
    """even/odd fp32 [A, G, 16]: the two halves of each 32-group's element pairs.
    Returns (packed bytes int32 [A, G, 16], UE8M0 exponent bytes int32 [A, G])."""
    # No division can see a zero dividend: a correctly rounded division can call a slow subroutine
    # for one (the masked rows of a row block at small T, zero groups). sf only decides the power of
    # two, and flooring amax at 6·2^-13 first gives the same one as flooring amax/6 at 1e-4 (2^-13).
    amax = tl.maximum(tl.max(tl.abs(even), axis=2), tl.max(tl.abs(odd), axis=2))
    sf = tl.div_rn(tl.maximum(amax, 6.0 * 2.0**-13), 6.0)
    exponent = tl.minimum(tl.maximum(ceil_pow2_biased_exponent(sf), 1), 254)
    # x / 2^(e-127) == x · 2^(127-e), both correctly rounded, with the exact factor built from
    # its bits (e = 254: the subnormal 2^-127; no flush to zero on either backend by default).
    inv_bits = tl.where(exponent < 254, (254 - exponent) << 23, 0x400000)
    inv_scale = inv_bits.to(tl.float32, bitcast=True)[:, :, None]
    packed = e2m1_encode(even * inv_scale) | (e2m1_encode(odd * inv_scale) << 4)
    return packed, exponent
