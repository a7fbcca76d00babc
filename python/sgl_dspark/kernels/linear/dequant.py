"""In-kernel dequantisation of weights kept as stored (`QuantizedWeight`, formats in
`reference.py`): the chunk product that every W8A16 / W4A16 GEMM of the engine shares (the
small-M linear, the grouped linear, the MoE grouped GEMMs and the per-token MoE kernels).

`quantized_chunk_dot` forms one chunk of `SUB` input channels (at most one scale group):

    part[m, n] = sum_k a[m, k] * value(w[n, k])          (fp32, a matrix-unit dot from zero)
    return part * 2^(e[n, chunk] - 127)                    (one scale per output column)

Every product a * value is exact in fp32 (bf16 x FP8 or x E2M1), and a power-of-two scale
multiplies a partial sum exactly, so the result equals the dot of `a` with the dequantised weight
up to the order of the fp32 sums (chunk by chunk, each chunk in the matrix unit's order). The
scale is applied after the dot, once per output column and chunk, so the per-weight work is the
type conversion alone:

* FP8: the hardware conversion e4m3 -> bf16 (exact: every e4m3 value is a bf16 value).
* MXFP4: the byte's two codes become the fp16 bit patterns `sign << 15 | magnitude << 9`, which
  are the E2M1 values times 2^-14 exactly (E2M1's subnormal 0.5 lands on fp16's subnormal 2^-15),
  then fp16 -> bf16 (exact); the 2^14 joins the column's scale. The low nibbles multiply the
  even input channels and the high nibbles the odd ones, so the packed tile is never
  interleaved: every step from the loaded bytes to the dot operand is elementwise, which lets the
  compiler move the operand's layout conversion onto the stored bytes (1 or 1/2 byte a weight
  instead of 2).

E8M0 bytes decode on the bits: `e << 23` is 2^(e - 127) as an fp32 for e in 1..254 (the loader
refuses 0 and 255); MXFP4 scales must stay below 2^113 for the folded 2^14 to stay finite.
"""

from __future__ import annotations

import triton
import triton.language as tl

# E2M1 values are decoded as fp16 values 2^-14 times too small; the scale makes up for it.
E2M1_FP16_SHIFT = 16384.0


@triton.jit
def e8m0_to_fp32(e):
    """E8M0 exponent bytes (1..254, any integer dtype) -> 2^(e - 127) in fp32, exactly."""
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to(codes, DTYPE: tl.constexpr):
    """4-bit E2M1 codes (uint8 in 0..15) -> their values times 2^-14 in DTYPE, exactly."""
    c = codes.to(tl.uint16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.float16, bitcast=True).to(DTYPE)


@triton.jit
def quantized_chunk_dot(
    a_rows,
    a_ok,
    w_rows,
    w_ok,
    s_rows,
    k0,
    k_dim,
    FP4: tl.constexpr,
    SUB: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """The scaled product of input channels [k0, k0 + SUB) (module doc) as fp32 [BM, BN].

    a_rows [BM]: pointers to the rows of A (unit stride along K), a_ok [BM] which are live;
    w_rows [BN]: pointers to the stored rows of the weight (FP8 elements or MXFP4 bytes) of each
    output column, w_ok [BN]; s_rows [BN]: pointers to the columns' scale rows. SUB divides
    GROUP (or equals it), k0 is a multiple of SUB; channels past k_dim read as zero."""
    if FP4:
        HALF: tl.constexpr = SUB // 2
        j = k0 // 2 + tl.arange(0, HALF)  # byte index: channels 2j (low nibble) and 2j + 1
        j_ok = j < k_dim // 2
        a_mask = a_ok[:, None] & j_ok[None, :]
        a_even = tl.load(a_rows[:, None] + 2 * j[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_rows[:, None] + 2 * j[None, :] + 1, mask=a_mask, other=0.0)
        packed = tl.load(w_rows[None, :] + j[:, None], mask=j_ok[:, None] & w_ok[None, :], other=0)
        if DOT_FP32:
            w_lo = e2m1_to(packed & 15, tl.float32)
            w_hi = e2m1_to(packed >> 4, tl.float32)
            part = tl.dot(a_even.to(tl.float32), w_lo, input_precision="ieee")
            part = tl.dot(a_odd.to(tl.float32), w_hi, part, input_precision="ieee")
        else:
            w_lo = e2m1_to(packed & 15, a_even.dtype)
            w_hi = e2m1_to(packed >> 4, a_even.dtype)
            part = tl.dot(a_even, w_lo)
            part = tl.dot(a_odd, w_hi, part)
    else:
        k = k0 + tl.arange(0, SUB)
        k_ok = k < k_dim
        a = tl.load(a_rows[:, None] + k[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows[None, :] + k[:, None], mask=k_ok[:, None] & w_ok[None, :], other=0.0)
        if DOT_FP32:
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w.to(a.dtype))
    e = tl.load(s_rows + k0 // GROUP, mask=w_ok & (k0 < k_dim), other=0)
    scale = e8m0_to_fp32(e)
    if FP4:
        scale = scale * 16384.0  # E2M1_FP16_SHIFT
    return part * scale[None, :]


def chunk_channels(group: int, block_k: int) -> int:
    """Input channels per `quantized_chunk_dot`: the scale group, or the K step when smaller."""
    return min(group, block_k)


def quantized_block_k(fmt: str, k_dim: int, block_k: int) -> int:
    """A K step for a quantised weight: `block_k` channels (a power of two), bounded by K's next
    power of two, at least one matrix-unit step (16 channels; 32 for MXFP4, whose nibble halves
    each take 16). A power of two, so it divides the scale group or is a multiple of it."""
    step = max(16, min(block_k, triton.next_power_of_2(max(k_dim, 1))))
    return max(step, 32) if fmt == "mxfp4" else step


__all__ = [
    "E2M1_FP16_SHIFT",
    "chunk_channels",
    "e2m1_to",
    "e8m0_to_fp32",
    "quantized_block_k",
    "quantized_chunk_dot",
]
