"""Rotate, quantise and store cache rows in one launch (`quant_store_ref` is the spec): the
DeepSeek-V4.1 window KV store (FP8, the rope of the layer's own positions), the compressed-latent
store of a kv source (FP4 with E4M3 scales) and its index-key store (FP4 with exponent scales),
both rotated at the group's first position; and (`quant_store_values`) the DSpark draft's
window KV rows, which hold the FP8 quantiser's values in the model dtype.

One program per row: it loads the row as its even and odd channels (the RoPE pairs), rotates the
tail, rounds it to the row's dtype (what the unfused rope would have written), quantises every
block and writes the elements and scales straight into the packed cache rows.

Exactness: bit-exact against the reference on any backend. The rotation is `rope_tail`'s
arithmetic with FMA contraction off; the quantisers use only max, exact power-of-two scaling,
correctly rounded division (`div_rn`) and integer rounding on the fp32 bits (E4M3 and E2M1 round
to nearest, ties to even, as torch's casts and the reference do).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import check_index_vector, require
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    programmatic_launch,
    round_to_dtype,
    wait_for_producers,
)
from sgl_dspark.kernels.indexer.fp4_codec import (
    ceil_pow2_biased_exponent,
    pow2_from_biased_exponent,
)
from sgl_dspark.kernels.quant.reference import (
    FP4_MAX,
    FP8_MAX,
    INDEX_BLOCK,
    LATENT_BLOCK,
    WINDOW_BLOCK,
    quantizes,
)

# Row formats, as the kernel's FMT constexpr.
FORMATS = {"fp8_window": 0, "fp4_latent": 1, "fp4_index": 2}
_BLOCKS = {"fp8_window": WINDOW_BLOCK, "fp4_latent": LATENT_BLOCK, "fp4_index": INDEX_BLOCK}


@triton.jit
def e4m3_round(a):
    """Non-negative fp32 a <= 448 -> (E4M3 code without sign, the code's value in fp32), round
    to nearest, ties to even: normal values round the fp32 mantissa to 3 bits on the bits;
    values below 2^-6 (the subnormals, quantum 2^-9) round through an fp32 add of 2^14, whose
    ulp is 2^-9."""
    bits = a.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # clear the low 20 bits
    normal_code = (rounded >> 20) - 960  # fp32 exponent field - 120 = E4M3's
    sub = (a + 16384.0) - 16384.0
    sub_code = (sub * 512.0).to(tl.int32)
    is_normal = a >= 0.015625
    code = tl.where(is_normal, normal_code, sub_code)
    value = tl.where(is_normal, rounded.to(tl.float32, bitcast=True), sub)
    return code, value


@triton.jit
def e2m1_code(v):
    """fp32 v, |v| <= 6 -> E2M1 code (bit 3 = sign), round to nearest, ties to the even code; a
    value that rounds to zero is +0 whatever its sign."""
    a = tl.abs(v)
    mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    mag += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    mag += (a > 5.0).to(tl.int32)
    negative = (v.to(tl.int32, bitcast=True) < 0) & (mag != 0)
    return mag + 8 * negative.to(tl.int32)


@triton.jit
def e2m1_code_value(code):
    """E2M1 code (bit 3 = sign) -> its value in fp32: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
    (no code here is a signed zero)."""
    mag = code & 7
    big = tl.where(mag == 5, 3.0, tl.where(mag == 6, 4.0, 6.0))
    v = tl.where(mag <= 4, mag.to(tl.float32) * 0.5, big)
    return tl.where(code >= 8, -1.0, 1.0) * v


@triton.jit
def _store_pairs(dst, even, out_a, out_b, mask, OUT_KIND: tl.constexpr):
    """Store the values of every pair's even and odd channel (exact in the output dtype)."""
    if OUT_KIND == 1:
        out_a, out_b = out_a.to(tl.bfloat16), out_b.to(tl.bfloat16)
    elif OUT_KIND == 2:
        out_a, out_b = out_a.to(tl.float16), out_b.to(tl.float16)
    tl.store(dst + even, out_a, mask=mask)
    tl.store(dst + even + 1, out_b, mask=mask)


@triton.jit
def quant_store_row(
    t,
    x_ptr,
    x_row_stride,
    x_head_stride,
    heads,
    cos_ptr,
    sin_ptr,
    cs_row_stride,
    rows_ptr,
    data_ptr,
    data_row_stride,
    scales_ptr,
    scales_row_stride,
    D: tl.constexpr,
    HALF_ROPE: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    BLOCK: tl.constexpr,
    FMT: tl.constexpr,
    VALUES: tl.constexpr,
    IDENTITY_ROWS: tl.constexpr,
    OUT_KIND: tl.constexpr,
    X_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """Row t of a store (the kernel's whole work; `rope/q_kv.py` stores a layer's KV row in the
    launch that rotates its queries). Its values depend on no other lane's order: per-block
    maxima and elementwise operations, the same bits whatever the launch's warps."""
    H: tl.constexpr = BLOCK // 2
    # Row t is head (t % heads) of token (t // heads); a token's heads share its cos / sin row.
    token = t // heads
    if IDENTITY_ROWS:
        out_row = t.to(tl.int64)
    else:
        out_row = tl.load(rows_ptr + t).to(tl.int64)
    offs_b = tl.arange(0, NBP)
    offs_h = tl.arange(0, H)
    mask = (offs_b < NB)[:, None] & (offs_h < H)[None, :]
    even = offs_b[:, None] * BLOCK + 2 * offs_h[None, :]  # channel of each pair's first element
    src = x_ptr + token.to(tl.int64) * x_row_stride + (t % heads).to(tl.int64) * x_head_stride
    a = tl.load(src + even, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + even + 1, mask=mask, other=0.0).to(tl.float32)
    if HALF_ROPE > 0:
        # Pair i of the tail = channels (D - rd + 2i, D - rd + 2i + 1), rd = 2 * HALF_ROPE.
        pair = (even - (D - 2 * HALF_ROPE)) // 2
        tail = mask & (pair >= 0)
        cs = token.to(tl.int64) * cs_row_stride + tl.maximum(pair, 0)
        c = tl.load(cos_ptr + cs, mask=tail, other=1.0)
        s = tl.load(sin_ptr + cs, mask=tail, other=0.0)
        ra = round_to_dtype(a * c - b * s, X_KIND, ON_BITS)
        rb = round_to_dtype(a * s + b * c, X_KIND, ON_BITS)
        a = tl.where(tail, ra, a)
        b = tl.where(tail, rb, b)
    amax = tl.maximum(tl.max(tl.abs(a), axis=1), tl.max(tl.abs(b), axis=1))  # [NBP]
    mask_b = offs_b < NB
    dst = data_ptr + out_row * data_row_stride
    if FMT == 0:  # FP8 window: ue8m0 scale from amax / 448 (floor 1e-4)
        e = ceil_pow2_biased_exponent(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        scale = pow2_from_biased_exponent(e)[:, None]
        va = tl.minimum(tl.maximum(tl.div_rn(a, scale), -448.0), 448.0)
        vb = tl.minimum(tl.maximum(tl.div_rn(b, scale), -448.0), 448.0)
        ca, ra = e4m3_round(tl.abs(va))
        cb, rb = e4m3_round(tl.abs(vb))
        neg_a = va.to(tl.int32, bitcast=True) < 0
        neg_b = vb.to(tl.int32, bitcast=True) < 0
        if VALUES:  # the dequantised values (exact in the output dtype), no scales
            # Multiply by -1.0 (not negate): -0.0 must survive, as in the reference's product.
            out_a = tl.where(neg_a, -1.0, 1.0) * ra * scale
            out_b = tl.where(neg_b, -1.0, 1.0) * rb * scale
            _store_pairs(dst, even, out_a, out_b, mask, OUT_KIND)
        else:
            tl.store(dst + even, (ca + 128 * neg_a.to(tl.int32)).to(tl.uint8), mask=mask)
            tl.store(dst + even + 1, (cb + 128 * neg_b.to(tl.int32)).to(tl.uint8), mask=mask)
        scale_byte = e
    else:
        if FMT == 1:  # FP4 latent: E4M3 scale amax / 6 (floor 6 * 2^-9, cap 448)
            s_code, s_val = e4m3_round(
                tl.minimum(tl.div_rn(tl.maximum(amax, 6.0 * 2.0**-9), 6.0), 448.0)
            )
            scale = s_val[:, None]
            scale_byte = s_code
        else:  # FP4 index: ue8m0 scale from amax / 6 (floor 6 * 2^-126)
            e = ceil_pow2_biased_exponent(tl.maximum(amax, 6.0 * 2.0**-126) * (1.0 / 6.0))
            scale = pow2_from_biased_exponent(e)[:, None]
            scale_byte = e
        va = tl.minimum(tl.maximum(tl.div_rn(a, scale), -6.0), 6.0)
        vb = tl.minimum(tl.maximum(tl.div_rn(b, scale), -6.0), 6.0)
        if VALUES:  # the dequantised values (exact in the output dtype), no scales
            out_a = e2m1_code_value(e2m1_code(va)) * scale
            out_b = e2m1_code_value(e2m1_code(vb)) * scale
            _store_pairs(dst, even, out_a, out_b, mask, OUT_KIND)
        else:
            packed = e2m1_code(va) | (e2m1_code(vb) << 4)
            tl.store(dst + offs_b[:, None] * H + offs_h[None, :], packed.to(tl.uint8), mask=mask)
    if not VALUES:
        scale_ptrs = scales_ptr + out_row * scales_row_stride + offs_b
        tl.store(scale_ptrs, scale_byte.to(tl.uint8), mask=mask_b)


@triton.jit
def _quant_store_kernel(
    x_ptr,
    x_row_stride,
    x_head_stride,
    heads,
    cos_ptr,
    sin_ptr,
    cs_row_stride,
    rows_ptr,
    data_ptr,
    data_row_stride,
    scales_ptr,
    scales_row_stride,
    D: tl.constexpr,
    HALF_ROPE: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    BLOCK: tl.constexpr,
    FMT: tl.constexpr,
    VALUES: tl.constexpr,
    IDENTITY_ROWS: tl.constexpr,
    OUT_KIND: tl.constexpr,
    X_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # x comes from the previous kernel; the cache rows may be read
    quant_store_row(
        tl.program_id(0),
        x_ptr,
        x_row_stride,
        x_head_stride,
        heads,
        cos_ptr,
        sin_ptr,
        cs_row_stride,
        rows_ptr,
        data_ptr,
        data_row_stride,
        scales_ptr,
        scales_row_stride,
        D,
        HALF_ROPE,
        NB,
        NBP,
        BLOCK,
        FMT,
        VALUES,
        IDENTITY_ROWS,
        OUT_KIND,
        X_KIND,
        ON_BITS,
    )


def quant_store_values(
    x: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> None:
    """`quant_store_values_ref` in one launch: rotate, then write the FP8 window quantiser's
    values (`fake_quant_fp8_window_ref`) into float rows `out` `[R, D]` (fp32/bf16/fp16, unit
    stride) at `rows` (a dense cache of the model dtype, which holds them exactly). Bit-exact."""
    require(
        out.dim() == 2 and out.dtype in DTYPE_KIND and out.stride(1) == 1,
        f"out: expected fp32/bf16/fp16 [R, D] with unit stride, got {out.dtype} {tuple(out.shape)}",
    )
    require(out.shape[1] == x.shape[-1], f"out: expected D={x.shape[-1]}, got {out.shape[1]}")
    require(out.device == x.device, f"out: expected device {x.device}, got {out.device}")
    _launch(x, rows, out, out, "fp8_window", cos, sin, values=True)


def fake_quant_rows(
    x: torch.Tensor,
    fmt: str,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate, then the quantiser's values, in one launch: `fake_quant_<fmt>_ref(rope_tail_ref(
    x, cos, sin))` ("fp8_window" or "fp4_index") as a new tensor of x's shape and dtype, bit for
    bit. x [N, D] or [N, H, D] (unit stride in D; any token and head strides, e.g. a column
    slice of a fused projection's output); cos, sin fp32 [N, rd/2], shared by a token's heads.
    DeepSeek-V4.1's index queries take it with "fp4_index"."""
    require(
        fmt in ("fp8_window", "fp4_index"), f"fmt: expected fp8_window or fp4_index, got {fmt!r}"
    )
    require(x.dim() in (2, 3), f"x: expected [N, D] or [N, H, D], got shape {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not quantizes(x.shape[-1], _BLOCKS[fmt]):  # the reference leaves such rows as they are
        from sgl_dspark.kernels.rope.tail import rope_tail

        if cos is None or sin is None:
            return out.copy_(x)
        return rope_tail(x, cos, sin)
    rows_2d = out.view(-1, x.shape[-1])
    _launch(x, None, rows_2d, rows_2d, fmt, cos, sin, values=True)
    return out


def quant_store(
    x: torch.Tensor,
    rows: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> None:
    """`quant_store_ref` in one launch, no host sync.

    Args:
        x: [N, D] fp32/bf16/fp16, unit stride in D (rows may be strided).
        rows: [N] int32/int64 destination cache rows.
        data, scales: the packed cache (`QuantizedRows`): uint8 [R, D] (FP8 codes) or [R, D/2]
            (E2M1 pairs), and uint8 [R, D / block] scale bytes; contiguous rows.
        fmt: "fp8_window", "fp4_latent" or "fp4_index".
        cos, sin: fp32 [N, rd/2] (both or neither): rotate the trailing rd channels first.
    """
    _launch(x, rows, data, scales, fmt, cos, sin, values=False)


class StorePlan(NamedTuple):
    """One store, validated: `args` its runtime arguments after the program index
    (`quant_store_row`'s order), `meta` its constexprs but ON_BITS, `rows` the rows to write
    (tokens x heads), `num_warps` its own launch's warps."""

    args: tuple
    meta: dict[str, Any]
    rows: int
    num_warps: int


def plan_quant_store(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    data: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    *,
    values: bool,
) -> StorePlan:
    """The checks of a store (ValueError naming the argument) and its launch arguments."""
    require(fmt in FORMATS, f"fmt: expected one of {tuple(FORMATS)}, got {fmt!r}")
    # [N, D], or [N, H, D] (identity rows only: fake_quant_rows): H rows per token.
    require(
        x.dim() == 2 or (x.dim() == 3 and rows is None),
        f"x: expected [N, D], got shape {tuple(x.shape)}",
    )
    n, d = x.shape[0], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    head_stride = x.stride(1) if x.dim() == 3 else 0
    block = _BLOCKS[fmt]
    require(quantizes(d, block), f"x: D={d} is not a multiple of the {fmt} block {block}")
    require(x.dtype in DTYPE_KIND, f"x: expected fp32/bf16/fp16, got {x.dtype}")
    require(x.stride(-1) == 1 or d == 1, "x: needs unit stride in its last dim")
    if rows is not None:
        check_index_vector("rows", rows, n)
    width = d if fmt == "fp8_window" else d // 2
    checked = () if values else (("data", data, width), ("scales", scales, d // block))
    for name, t, w in checked:
        require(
            t.dtype == torch.uint8 and t.dim() == 2 and t.shape[1] == w and t.stride(1) == 1,
            f"{name}: expected uint8 [R, {w}] with unit stride, got {t.dtype} {tuple(t.shape)}",
        )
        require(t.device == x.device, f"{name}: expected device {x.device}, got {t.device}")
    require((cos is None) == (sin is None), "cos and sin come together")
    half = 0
    if cos is not None and sin is not None:
        half = cos.shape[1] if cos.dim() == 2 else -1
        for name, t in (("cos", cos), ("sin", sin)):
            require(
                t.dim() == 2 and t.shape == (n, half) and t.dtype == torch.float32,
                f"{name}: expected fp32 [{n}, rd/2], got {t.dtype} {tuple(t.shape)}",
            )
        require(cos.stride() == sin.stride() and cos.stride(1) == 1, "cos/sin: same strides")
        require(2 * half <= d, f"rope dim {2 * half} exceeds D={d}")
    nb = d // block
    dummy = x if cos is None else cos
    args = (
        x,
        x.stride(0),
        head_stride,
        heads,
        dummy,
        dummy if sin is None else sin,
        0 if cos is None else cos.stride(0),
        x if rows is None else rows,
        data,
        data.stride(0),
        scales,
        scales.stride(0),
    )
    meta = dict(
        D=d,
        HALF_ROPE=half,
        NB=nb,
        NBP=triton.next_power_of_2(nb),
        BLOCK=block,
        FMT=FORMATS[fmt],
        VALUES=values,
        IDENTITY_ROWS=rows is None,
        OUT_KIND=DTYPE_KIND[data.dtype] if values else 0,
        X_KIND=DTYPE_KIND[x.dtype],
    )
    return StorePlan(args, meta, n * heads, 4 if d >= 1024 else 1)


def _launch(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    data: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    *,
    values: bool,
) -> None:
    plan = plan_quant_store(x, rows, data, scales, fmt, cos, sin, values=values)
    if plan.rows == 0:
        return
    _quant_store_kernel[(plan.rows,)](
        *plan.args,
        **plan.meta,
        ON_BITS=interpreted(_quant_store_kernel),
        num_warps=plan.num_warps,
        enable_fp_fusion=False,
        **programmatic_launch(_quant_store_kernel, x.device),
    )


__all__ = [
    "FORMATS",
    "StorePlan",
    "fake_quant_rows",
    "plan_quant_store",
    "quant_store",
    "quant_store_row",
    "quant_store_values",
]
# Constants the kernel spells as literals (Triton reads no module globals).
assert (FP8_MAX, FP4_MAX) == (448.0, 6.0)
