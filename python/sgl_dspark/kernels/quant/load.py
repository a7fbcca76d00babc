"""The read side of `store.py`, inside a consumer's loads: a tile of cache rows of DeepSeek-V4.1's
packed formats gathered and decoded in registers (`quant_load_ref` is the spec: an index of the
stored bytes, then `dequantize_*_ref`). The window KV rows (E4M3 elements, one exponent byte per
32 channels), the compressed latents (packed E2M1, one E4M3 scale per 16) and the index keys
(packed E2M1, one exponent byte per 32) are read as the uint8 rows the cache keeps; a consumer
(the attention over packed keys, `attention/packed_keys.py`) gets the values without a decoded
copy of the rows in memory. Plain rows (a cache whose width its quantiser leaves unquantised)
load as they are.

Exactness: bit-exact against the reference on any backend. Every decode is exact (E4M3 and E2M1
codes through fp16's bits and a power-of-two product, exponent bytes straight into fp32's
exponent field), so the only roundings are the reference's: one fp32 product, then one round to
the output dtype. Both are exact for every row the quantisers write; only raw scale bytes near
the bottom of the exponent range give bf16 subnormals that round, on the bits under the
interpreter (whose bf16 cast truncates).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import round_to_dtype
from sgl_dspark.kernels.linear.dequant import e2m1_to, e8m0_to_fp32
from sgl_dspark.kernels.quant.reference import INDEX_BLOCK, LATENT_BLOCK, WINDOW_BLOCK
from sgl_dspark.kernels.quant.store import FORMATS

# Row formats of `load_rows_tile`: the packed caches' (`store.py`'s codes), then plain rows.
PLAIN = 3
ROW_FORMATS = {**FORMATS, "plain": PLAIN}
BLOCKS = {"fp8_window": WINDOW_BLOCK, "fp4_latent": LATENT_BLOCK, "fp4_index": INDEX_BLOCK}


@triton.jit
def e4m3_to_fp32(codes):
    """E4M3 bytes -> their values in fp32, exactly. The sign bit placed at fp16's and the
    exponent and mantissa bits at the bottom of fp16's exponent and the top of its mantissa are
    the fp16 number value * 2^-8 (subnormals land on fp16's subnormals), so a shift-or, a
    reinterpretation and a power-of-two product decode every code; the NaN codes (0x7F, 0xFF)
    would land on 480 and are mapped to NaN, as torch's cast reads them."""
    c = codes.to(tl.uint16)
    bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    v = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((c & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def load_rows_tile(
    data_ptr,
    data_stride,
    scales_ptr,
    scales_stride,
    rows,
    row_ok,
    dims,
    dim_ok,
    FMT: tl.constexpr,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """Cache rows `rows` [R] (int64), channels `dims` [C] -> fp32 [R, C] holding the values
    rounded to the dtype KIND (`DTYPE_KIND`), as `quant_load_ref` decodes them. Where a row or
    channel is masked the value is zero: zero codes and zero scale bytes (every format's decode
    of them; E4M3 scales included, whose 0x7F is NaN), and nothing is read."""
    mask = row_ok[:, None] & dim_ok[None, :]
    row_data = data_ptr + rows[:, None] * data_stride
    row_scales = scales_ptr + rows[:, None] * scales_stride
    if FMT == 3:  # plain rows
        v = tl.load(row_data + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    elif FMT == 0:  # FP8 window: byte d is channel d
        codes = tl.load(row_data + dims[None, :], mask=mask, other=0)
        e = tl.load(row_scales + (dims // BLOCK)[None, :], mask=mask, other=0)
        v = round_to_dtype(e4m3_to_fp32(codes) * e8m0_to_fp32(e), KIND, ON_BITS)
    else:  # FP4: byte d // 2 holds channel d in its low (d even) or high nibble
        pair = tl.load(row_data + (dims // 2)[None, :], mask=mask, other=0)
        code = (pair >> ((dims % 2) * 4).to(tl.uint8)[None, :]) & 15
        s = tl.load(row_scales + (dims // BLOCK)[None, :], mask=mask, other=0)
        if FMT == 1:
            scale = e4m3_to_fp32(s)
        else:
            scale = e8m0_to_fp32(s)
        v = round_to_dtype(e2m1_to(code, tl.float32) * 16384.0 * scale, KIND, ON_BITS)
    return v


def stored_width(fmt: str, dim: int) -> int:
    """Bytes a packed row of `dim` channels keeps (FP8: one a channel; FP4: one a pair)."""
    return dim if fmt == "fp8_window" else dim // 2


__all__ = ["BLOCKS", "PLAIN", "ROW_FORMATS", "e4m3_to_fp32", "load_rows_tile", "stored_width"]
