"""In-kernel dequantisation of weights kept as stored (`QuantizedWeight`, formats in
`reference.py`): the weight tile that every W8A16 / W4A16 GEMM of the engine multiplies (the
small-M linear, the grouped linear, the MoE grouped GEMMs and the per-token MoE kernels).

A K step's stored bytes of BN output columns x BLOCK_K input channels become the dequantised
weight `value(w[n, k]) * 2^(e[n, k // group] - 127)` in registers, in bf16 for the matrix unit
(or fp32 for fp32 activations and the CPU interpreter): one tile and one dot (FP8), or the even
and the odd channels and two dots (MXFP4). Decode
steps are few integer or half-precision operations per weight and no table lookups: at decode
sizes the GEMM streams the weight once and the GPU must convert bytes as fast as HBM delivers
them (a conversion through the slow `F2F` path, or a dot per scale group, would leave the loads
idle).

* FP8 (e4m3): the hardware conversion to fp32 (exact), then bf16 (exact: every e4m3 value is a
  bf16 value) times the block's multiplier 2^(e - 127), a bf16 power of two for every byte
  1..254.
* MXFP4 (e2m1 pairs): bits 2..0 of a code are exactly bf16's low exponent bits and top mantissa
  bit of `value * 2^-126` (code 1, the value 0.5, lands on bf16's subnormal 2^-127), bit 3 its
  sign, so a few shifts and masks give a code's bf16 bits; the multiplier 2^(e - 1) then
  restores the scale, so a group's scale byte must be at most `reference.MXFP4_MAX_SCALE_BYTE` =
  128 (scale <= 2, |w| <= 12: the loader refuses larger ones).
  - The GEMMs (`quantized_product` -> `fp4_half_tiles`) read a step's code bytes and keep the
    low nibbles (the even channels) and the high nibbles (the odd channels) apart, multiplied in
    two dots against the activation's even and odd channels: no decoded value is moved. On
    NVIDIA sm90 and later the decode and the scale are inline PTX (`E2M1_SCALED_PTX`: a byte
    permute that sign-extends, a shift, a mask and a packed bf16 multiply per two weights);
    elsewhere (the CPU interpreter, AMD) per-element shifts, masks and multiplies give the same
    bits.
  - The whole tile in channel order (`quantized_tile`, for `dequantize.py`) is assembled from
    32-bit words of eight codes, two codes per shift-and-mask pair; rows whose byte length is
    not a multiple of 16 (K not a multiple of 32) are read byte by byte into the same words.

Loads: the code bytes arrive by 16-byte asynchronous copies only if the compiler sees their mask
constant over each 16 bytes: rows of a multiple of 16 bytes bound the bytes in 16-byte units
(`ALIGNED`), and a K that is a multiple of the K step needs no K bound at all (`EVEN_K`). The
step's scale bytes are copied ahead the same way only where the compiler can
(`weight_loads.scales_loaded_ahead`: at least 4 bytes a thread, no K bound, alignment told by
the kernels: `weight_loads.scale_alignment`); the narrow tiles' are loaded a step ahead into
registers instead, so no step waits for a scale load of its own (but V4's FP8 128 x 128, whose
few groups a step stay in it, and the grouped MoE GEMMs: `grouped_gemm._launch_grouped`).

Exactness: every dequantised weight is the exact product of its value and its power-of-two scale
whenever that product is a normal bf16 (or fp32) number, i.e. the same number
`dequantize_weight_ref` produces (which rounds the fp32 product to the weight dtype): the tile
is bit for bit the reference's dequantised weight, so a GEMM on it differs from the reference
only in the order of its fp32 sums. (A product below 2^-126 in magnitude is a subnormal; the
multiplication keeps it, a matrix unit may flush it to zero: an absolute difference below
2^-126 per weight, for scales no checkpoint uses.)
"""

from __future__ import annotations

import triton
import triton.language as tl

# Element-wise decoders for kernels that decode scales and codes one at a time (the MX MoE's
# emulated scaled dot): E2M1 values come out as fp16 values 2^-14 times too small, which the
# caller's scale makes up for.
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
def _power_of_two(exponent_bits, WIDE: tl.constexpr):
    """Biased exponents (1..254) -> those powers of two as fp32 (WIDE) or bf16 (exact)."""
    if WIDE:
        p = (exponent_bits.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        p = (exponent_bits.to(tl.int32) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return p


@triton.jit
def _shift_left(w, SHIFT: tl.constexpr):
    if SHIFT > 0:
        w = w << SHIFT
    elif SHIFT < 0:
        w = w >> (-SHIFT)
    return w


@triton.jit
def _e2m1_pair(w, SHIFT: tl.constexpr, WIDE: tl.constexpr):
    """The codes at bits [SHIFT, SHIFT + 4) and [SHIFT + 16, SHIFT + 20) of uint32 words `w`
    -> their values times 2^-126, exactly (fp32 if WIDE, else bf16): one 32-bit word holds both
    results' bf16 bits (magnitude bits 2..0 to bits 8..6 of each half, the sign to bit 15)."""
    pair = (_shift_left(w, 6 - SHIFT) & 0x01C001C0) | (_shift_left(w, 12 - SHIFT) & 0x80008000)
    if WIDE:  # a bf16 bit pattern shifted up 16 is the same number in fp32
        lo = (pair << 16).to(tl.float32, bitcast=True)
        hi = (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        lo = (pair & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (pair >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _bytes_to_words(q, BN: tl.constexpr, WORDS: tl.constexpr):
    """uint8 [BN, 4 * WORDS] -> uint32 [BN, WORDS], little-endian (byte 0 in bits 0..7)."""
    q = tl.reshape(q.to(tl.uint32), [BN, WORDS, 2, 2])
    even, odd = tl.split(q)  # bytes 2p and 2p + 1 of each word, p = 0, 1
    b0, b2 = tl.split(even)
    b1, b3 = tl.split(odd)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _e2m1_tile(words, BN: tl.constexpr, BLOCK_K: tl.constexpr, WIDE: tl.constexpr):
    """uint32 [BN, BLOCK_K / 8] words of eight codes -> values * 2^-126 [BN, BLOCK_K] in channel
    order (channel 8j + c is code c of word j, bits [4c, 4c + 4))."""
    l0, h0 = _e2m1_pair(words, 0, WIDE)  # channels 8j + 0 and 8j + 4
    l1, h1 = _e2m1_pair(words, 4, WIDE)
    l2, h2 = _e2m1_pair(words, 8, WIDE)
    l3, h3 = _e2m1_pair(words, 12, WIDE)
    # Nested joins add trailing axes of size 2, the innermost join's axis most significant:
    # channel 8j + 4 * half + 2 * i1 + i0 for the pair of code i = 2 * i1 + i0.
    v = tl.join(
        tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3))
    )
    return tl.reshape(v, [BN, BLOCK_K])


@triton.jit
def quantized_scales(
    s_rows,
    w_ok,
    k0,
    k_dim,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr = False,
):
    """The scale bytes of input channels [k0, k0 + BLOCK_K) of the columns whose scale rows
    `s_rows` [BN] point to: [BN, BLOCK_K / GROUP] (one per group), or [BN] when the step lies in
    one group. Groups past k_dim, and columns not `w_ok`, read 127 (a multiplier of 1 for
    their zero weights). EVEN_K (k_dim a multiple of BLOCK_K): no group is past k_dim, and a
    mask by column only keeps the loads vectorised (and so software-pipelined)."""
    if BLOCK_K > GROUP:
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        if EVEN_K:
            g_ok = w_ok[:, None]
        else:
            g_ok = w_ok[:, None] & (g * GROUP < k_dim)[None, :]
        e = tl.load(s_rows[:, None] + g[None, :], mask=g_ok, other=127)
    else:
        e = tl.load(s_rows + k0 // GROUP, mask=w_ok & (k0 < k_dim), other=127)
    return e


@triton.jit
def quantized_tile(
    w_rows,
    w_ok,
    e,
    k0,
    k_dim,
    FP4: tl.constexpr,
    WORDS: tl.constexpr,
    GROUP: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDE: tl.constexpr,
    EVEN_K: tl.constexpr = False,
):
    """The dequantised weight of input channels [k0, k0 + BLOCK_K) of BN output columns:
    [BN, BLOCK_K] in bf16, or fp32 if WIDE (module doc); channels past k_dim and columns not
    `w_ok` are zero.

    w_rows [BN]: pointers to each column's stored row: FP8 elements, or for MXFP4 uint32 words
    (WORDS; k_dim a multiple of 32) or bytes. e: the step's scale bytes (`quantized_scales`).
    k0 is a multiple of BLOCK_K; BLOCK_K and GROUP are powers of two (MXFP4: BLOCK_K >= 8)."""
    if FP4:
        # Code bytes -> values * 2^-126; the multiplier 2^(e - 1) (biased exponent e + 126).
        if WORDS:
            # k_dim is a multiple of 32 here; a bound in whole 4-word units lets the copies move
            # 16 bytes at a time.
            j = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
            j_ok = (j // 4) * 32 < k_dim
            words = tl.load(
                w_rows[:, None] + j[None, :], mask=w_ok[:, None] & j_ok[None, :], other=0
            )
        else:
            b = tl.multiple_of(k0 // 2, BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            q = tl.load(
                w_rows[:, None] + b[None, :],
                mask=w_ok[:, None] & (b < (k_dim + 1) // 2)[None, :],
                other=0,
            )
            words = _bytes_to_words(q, BN, BLOCK_K // 8)
        v = _e2m1_tile(words, BN, BLOCK_K, WIDE)
        v = _scaled_tile(v, _power_of_two(e.to(tl.int32) + 126, WIDE), BN, BLOCK_K, GROUP)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:  # k_dim a multiple of BLOCK_K: a mask by column only
            k_ok = w_ok[:, None]
        else:
            k_ok = w_ok[:, None] & (k < k_dim)[None, :]
        codes = tl.load(w_rows[:, None] + k[None, :], mask=k_ok, other=0.0)
        v = fp8_scaled_tile(codes, e, BN, BLOCK_K, GROUP, WIDE)
    return v


@triton.jit
def _scaled_tile(v, multiplier, BN: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """A K step's values v [BN, BLOCK_K] times their groups' multipliers ([BN, BLOCK_K / GROUP],
    or [BN] when the step lies in one group)."""
    if BLOCK_K > GROUP:
        v = tl.reshape(v, [BN, BLOCK_K // GROUP, GROUP]) * multiplier[:, :, None]
        v = tl.reshape(v, [BN, BLOCK_K])
    else:
        v = v * multiplier[:, None]
    return v


@triton.jit
def fp8_scaled_tile(
    codes, e, BN: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, WIDE: tl.constexpr
):
    """A K step's loaded FP8 codes [BN, BLOCK_K] and scale bytes e (`quantized_scales`) -> the
    dequantised tile, bf16 (fp32 if WIDE): `quantized_tile`'s FP8 decode, for kernels that load
    the codes their own way."""
    v = codes.to(tl.float32)
    if not WIDE:
        v = v.to(tl.bfloat16)
    return _scaled_tile(v, _power_of_two(e, WIDE), BN, BLOCK_K, GROUP)


# Four MXFP4 code bytes per 32-bit register ($4) and their multipliers (bf16 pairs: bytes 0, 1 in
# $5, bytes 2, 3 in $6) in; out, two bf16 per register, the dequantised weights of the low
# nibbles (bytes 0, 1 then 2, 3: $0, $1) and of the high nibbles ($2, $3). A nibble in a byte's
# top four bits becomes a bf16's sign and its low exponent / top mantissa bits, the value times
# 2^-126, once the byte is sign-extended into a 16-bit half (PRMT selector 8 + i: the sign of
# byte i replicated) and the half shifted up 2 and masked; the low nibbles take that path after
# the word is shifted up 4. A packed multiply (sm90) applies the scale to two weights at once.
# Four instructions per two weights, against the portable decode's per-element shifts, masks
# and multiplies (`fp4_half_tiles`, the same bits; the tests compare the two).
E2M1_SCALED_PTX = tl.constexpr(
    """
{
.reg .b32 byte_pair, shifted;
shl.b32 shifted, $4, 4;
prmt.b32 byte_pair, shifted, 0, 0x9180;
shl.b32 byte_pair, byte_pair, 2;
and.b32 byte_pair, byte_pair, 0x81C081C0;
mul.rn.bf16x2 $0, byte_pair, $5;
prmt.b32 byte_pair, shifted, 0, 0xB3A2;
shl.b32 byte_pair, byte_pair, 2;
and.b32 byte_pair, byte_pair, 0x81C081C0;
mul.rn.bf16x2 $1, byte_pair, $6;
prmt.b32 byte_pair, $4, 0, 0x9180;
shl.b32 byte_pair, byte_pair, 2;
and.b32 byte_pair, byte_pair, 0x81C081C0;
mul.rn.bf16x2 $2, byte_pair, $5;
prmt.b32 byte_pair, $4, 0, 0xB3A2;
shl.b32 byte_pair, byte_pair, 2;
and.b32 byte_pair, byte_pair, 0x81C081C0;
mul.rn.bf16x2 $3, byte_pair, $6;
}
"""
)


@triton.jit
def _e2m1_nibbles(q, WIDE: tl.constexpr):
    """uint8 code bytes q (channel 2b in byte b's low nibble, 2b + 1 in its high one) -> (low,
    high) nibbles' values * 2^-126, each the shape of q, fp32 if WIDE else bf16. A code's
    magnitude bits 2..0 are bf16's low exponent bits and top mantissa bit (code 1, the value
    0.5, lands on the subnormal 2^-127), its bit 3 the sign."""
    c = q.to(tl.uint32)
    lo = ((c & 0x08) << 12) | ((c & 0x07) << 6)
    hi = ((c & 0x80) << 8) | ((c & 0x70) << 2)
    if WIDE:  # a bf16 bit pattern shifted up 16 is the same number in fp32
        lo = (lo << 16).to(tl.float32, bitcast=True)
        hi = (hi << 16).to(tl.float32, bitcast=True)
    else:
        lo = lo.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _scale_half_tile(v, multiplier, BN: tl.constexpr, HALF: tl.constexpr, GROUP: tl.constexpr):
    """The even (or odd) channels v [BN, HALF] of a K step times their groups' multipliers
    ([BN, 2 * HALF / GROUP], or [BN] when the step lies in one group)."""
    if 2 * HALF > GROUP:
        if GROUP == 1:  # a scale per channel: the even (odd) channels' own are passed
            v = v * multiplier
        else:
            v = tl.reshape(v, [BN, 2 * HALF // GROUP, GROUP // 2]) * multiplier[:, :, None]
            v = tl.reshape(v, [BN, HALF])
    else:
        v = v * multiplier[:, None]
    return v


@triton.jit
def fp4_half_tiles(
    w_rows,
    w_ok,
    e,
    k0,
    k_dim,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    WIDE: tl.constexpr,
    PTX: tl.constexpr,
    ALIGNED: tl.constexpr,
    EVEN_K: tl.constexpr = False,
):
    """The dequantised MXFP4 weight of input channels [k0, k0 + BLOCK_K) as its even and its
    odd channels, [BN, BLOCK_K / 2] each (w_rows: byte pointers to each column's stored row;
    e: the step's scale bytes). Channels past k_dim and columns not `w_ok` are zero. fp32 if
    WIDE, else bf16, decoded by `E2M1_SCALED_PTX` if PTX (NVIDIA sm90+; scale groups of at
    least two channels), the same bits either way.

    ALIGNED (`fp4_rows_aligned`: rows of a multiple of 16 bytes) bounds the bytes in whole
    16-byte units, a mask the compiler sees constant over each unit, so the copies move 16
    bytes at a time (a bound at any byte makes them byte loads); EVEN_K (k_dim a multiple of
    BLOCK_K) needs no bound."""
    HALF: tl.constexpr = BLOCK_K // 2
    b = tl.multiple_of(k0 // 2, HALF) + tl.arange(0, HALF)
    if EVEN_K:
        q_ok = w_ok[:, None]
    elif ALIGNED:
        q_ok = w_ok[:, None] & ((b // 16) * 16 < k_dim // 2)[None, :]
    else:
        q_ok = w_ok[:, None] & (b < k_dim // 2)[None, :]
    q = tl.load(w_rows[:, None] + b[None, :], mask=q_ok, other=0)
    return fp4_scaled_halves(q, e, BN, BLOCK_K, GROUP, WIDE, PTX)


@triton.jit
def fp4_scaled_halves(
    q,
    e,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    WIDE: tl.constexpr,
    PTX: tl.constexpr,
):
    """A K step's loaded MXFP4 code bytes q [BN, BLOCK_K / 2] and scale bytes e -> its even and
    odd channels dequantised: `fp4_half_tiles`' decode, for kernels that load the bytes their own
    way."""
    HALF: tl.constexpr = BLOCK_K // 2
    multiplier = _power_of_two(e.to(tl.int32) + 126, WIDE)  # 2^(e - 1) on values * 2^-126
    if PTX and not WIDE and GROUP >= 2:
        # Each byte's multiplier (its two channels share a group), beside it in registers.
        if BLOCK_K > GROUP:
            per_byte = tl.broadcast_to(multiplier[:, :, None], [BN, BLOCK_K // GROUP, GROUP // 2])
            per_byte = tl.reshape(per_byte, [BN, HALF])
        else:
            per_byte = tl.broadcast_to(multiplier[:, None], [BN, HALF])
        lo, hi = tl.inline_asm_elementwise(
            E2M1_SCALED_PTX,
            "=r,=r,=r,=r,r,r,r",
            [q, per_byte],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        lo, hi = _e2m1_nibbles(q, WIDE)
        if BLOCK_K > GROUP and GROUP == 1:
            m_even, m_odd = tl.split(tl.reshape(multiplier, [BN, HALF, 2]))
        else:
            m_even = multiplier
            m_odd = multiplier
        lo = _scale_half_tile(lo, m_even, BN, HALF, GROUP)
        hi = _scale_half_tile(hi, m_odd, BN, HALF, GROUP)
    return lo, hi


@triton.jit
def _accumulate(acc, a, w, SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + a [BM, C] @ w [BN, C]^T: acc is [BM, BN], or [SPLIT_K, BM, BN] with slice s of the
    C channels into accumulator s (one batched dot)."""
    if SPLIT_K == 1:
        w_t = tl.trans(w)
    else:
        SLICE: tl.constexpr = a.shape[1] // SPLIT_K
        a = tl.permute(tl.reshape(a, [a.shape[0], SPLIT_K, SLICE]), (1, 0, 2))
        w_t = tl.permute(tl.reshape(w, [w.shape[0], SPLIT_K, SLICE]), (1, 2, 0))
    if DOT_FP32:
        acc = tl.dot(a, w_t, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w_t, acc)
    return acc


@triton.jit
def _activation_tile(
    a_rows, a_ok, k0, k_dim, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr
):
    """Channels [k0, k0 + BLOCK_K) of the A rows `a_rows` (rows not `a_ok` and channels past
    k_dim read zero), fp32 for an fp32 dot."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        a_k_ok = a_ok[:, None]
    else:
        a_k_ok = a_ok[:, None] & (ks < k_dim)[None, :]
    a = tl.load(a_rows[:, None] + ks[None, :], mask=a_k_ok, other=0.0)
    if DOT_FP32:
        a = a.to(tl.float32)
    return a


@triton.jit
def _accumulate_halves(acc, a, w_even, w_odd, SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + a @ w^T for an MXFP4 step: the even channels' dot, then the odd channels'."""
    a_even, a_odd = tl.split(tl.reshape(a, [a.shape[0], a.shape[1] // 2, 2]))
    acc = _accumulate(acc, a_even, w_even, SPLIT_K, DOT_FP32)
    acc = _accumulate(acc, a_odd, w_odd, SPLIT_K, DOT_FP32)
    return acc


@triton.jit
def quantized_product(
    a_rows,
    a_ok,
    w_rows,
    w_ok,
    s_rows,
    k_dim,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP4: tl.constexpr,
    PTX: tl.constexpr,
    ALIGNED: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
    EVEN_K: tl.constexpr = False,
    SCALES_AHEAD: tl.constexpr = False,
    SECOND_ROWS: tl.constexpr = False,
    a_rows_2=None,
    a_ok_2=None,
):
    """fp32 [BM, BN] = A rows (pointers `a_rows` [BM], unit stride along K; rows not `a_ok`
    read zero) times the dequantised weight columns (`w_rows` / `w_ok` / `s_rows`: pointers to
    each column's stored row, FP8 elements or MXFP4 bytes, and to its scale row) over all K, one
    BLOCK_K step at a time (bf16 operands, or fp32 with IEEE products if DOT_FP32).

    FP8: the step's tile (`quantized_tile`) in one dot. MXFP4: the low nibbles of a step's bytes
    are its even channels and the high nibbles its odd ones (`fp4_half_tiles`; PTX: NVIDIA's
    inline decode, `fp4_ptx_decode`), so the step is two dots, the even channels' then the odd
    channels', against the matching activation channels: no interleaving of decoded values.

    SPLIT_K > 1 (one warp each, so launch SPLIT_K warps) cuts every dot into SPLIT_K slices of
    its channels, multiplied by one batched dot into SPLIT_K accumulators that are summed once at
    the end: a narrow column block then keeps SPLIT_K warps busy, each with its own chain of
    matrix-unit accumulations, where one warp's dependent chain would bound the step rate. The
    sum order is fixed by (format, BLOCK_K, SPLIT_K): per step and dot, slice s into
    accumulator s, then the accumulators summed.

    EVEN_K (k_dim a multiple of BLOCK_K): no load is bounded along K, so the tiles load as
    vectors the software pipeline copies ahead (the scale bytes too, where
    `scales_loaded_ahead` finds they can be).

    The weight and activation tiles are software-pipelined (asynchronous copies). The scale
    bytes are copied the same way only where the compiler can (`scales_loaded_ahead`); where it
    cannot, SCALES_AHEAD loads each step's scale bytes one step early into registers, so no
    iteration waits for a load it issued itself (a scale load is a global-memory round trip,
    the longest latency of a step). The kernels tell the compiler the alignment of the scale
    rows `s_rows` where they form them (`scale_alignment`; a hint on a function's argument is
    lost).

    SECOND_ROWS: a second block of BM rows (`a_rows_2` / `a_ok_2`) multiplied by every step's
    dequantised weight tile too, into its own accumulator (returned second): the weight is read
    and decoded once for 2 * BM rows, and each block's sums are the same operations, in the same
    order, as a product of its own (its rows' bits do not depend on the pairing)."""
    if SPLIT_K == 1:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    else:
        acc = tl.zeros([SPLIT_K, BM, BN], dtype=tl.float32)
    acc_2 = acc
    if SCALES_AHEAD:
        e_next = quantized_scales(s_rows, w_ok, 0, k_dim, GROUP, BLOCK_K, EVEN_K)
    for k0 in range(0, k_dim, BLOCK_K):
        if SCALES_AHEAD:
            e = e_next
            k_next = k0 + BLOCK_K
            # The last step's read ahead is masked off (no byte past the weight's groups).
            e_next = quantized_scales(
                s_rows, w_ok & (k_next < k_dim), k_next, k_dim, GROUP, BLOCK_K, EVEN_K
            )
        else:
            e = quantized_scales(s_rows, w_ok, k0, k_dim, GROUP, BLOCK_K, EVEN_K)
        a = _activation_tile(a_rows, a_ok, k0, k_dim, BLOCK_K, DOT_FP32, EVEN_K)
        if SECOND_ROWS:
            a_2 = _activation_tile(a_rows_2, a_ok_2, k0, k_dim, BLOCK_K, DOT_FP32, EVEN_K)
        if FP4:
            w_even, w_odd = fp4_half_tiles(
                w_rows, w_ok, e, k0, k_dim, BN, BLOCK_K, GROUP, DOT_FP32, PTX, ALIGNED, EVEN_K
            )
            acc = _accumulate_halves(acc, a, w_even, w_odd, SPLIT_K, DOT_FP32)
            if SECOND_ROWS:
                acc_2 = _accumulate_halves(acc_2, a_2, w_even, w_odd, SPLIT_K, DOT_FP32)
        else:
            w = quantized_tile(
                w_rows, w_ok, e, k0, k_dim, False, False, GROUP, BN, BLOCK_K, DOT_FP32, EVEN_K
            )
            acc = _accumulate(acc, a, w, SPLIT_K, DOT_FP32)
            if SECOND_ROWS:
                acc_2 = _accumulate(acc_2, a_2, w, SPLIT_K, DOT_FP32)
    if SPLIT_K > 1:
        acc = tl.sum(acc, axis=0)
    if SECOND_ROWS:
        if SPLIT_K > 1:
            acc_2 = tl.sum(acc_2, axis=0)
        return acc, acc_2
    else:
        return acc


__all__ = [
    "E2M1_FP16_SHIFT",
    "E2M1_SCALED_PTX",
    "e2m1_to",
    "e8m0_to_fp32",
    "fp4_half_tiles",
    "fp4_scaled_halves",
    "fp8_scaled_tile",
    "quantized_product",
    "quantized_scales",
    "quantized_tile",
]
