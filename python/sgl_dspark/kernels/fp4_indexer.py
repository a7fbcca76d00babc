"""FP4 (E2M1) quantisation for the lightning indexer: K9 (index keys) and K10 (index queries).

Format, shared by keys and queries: groups of 32 consecutive channels share one UE8M0 scale byte
``e`` (value ``2^(e-127)``), chosen as the smallest power of two >= ``max(amax/6, 1e-4)`` and
clamped to [1, 254]. Each element ``x / 2^(e-127)`` is rounded to nearest, ties to even code, onto
the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (magnitudes above 6 saturate to 6); the code is
``sign << 3 | magnitude index`` where sign is the input's sign bit, so -0.0 and negative values
that round to zero encode as 0x8 (-0). Two codes per byte, low nibble = even element. An all-zero
group gets ``e = 114`` (2^-13, the first power of two >= 1e-4) and codes 0; a group holding an
infinity gets ``e = 254`` (the clamp). NaN inputs give undefined codes.

Every float operation here is elementwise with a defined rounding (div_rn, bit tricks, exact
power-of-two products, max), so the kernels are bit-exact against the references on any backend
and in the CPU interpreter (FMA contraction is disabled at launch).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require as _require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers
from sgl_dspark.kernels._triton_utils import round_to_bf16 as _round_to_bf16
from sgl_dspark.kernels.rope import rope_tail_ref

FP4_GROUP = 32
_HEAD_BLOCK = 16  # query heads per program in K10
_MAX_HEAD_BLOCKS = 4  # the query scale layout has room for 4 × 16 = 64 heads
_BLOCK_ROWS = 8  # key rows per program in K9
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_SCALE_FLOOR = 1e-4  # floor of amax/6 in the packing step
_FAKE_QUANT_AMAX_FLOOR = 6.0 * 2.0**-126  # floor of amax before the /6 in the fake-quant step


# ------------------------------------------------------------------------------------------------
# Reference helpers
# ------------------------------------------------------------------------------------------------


def e2m1_encode_ref(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> E2M1 codes uint8, RNE, saturating at 6."""
    a = v.float().abs().clamp(max=6.0)
    # torch.round is round-half-to-even; scaling by the grid step of each binade makes it RNE on
    # the E2M1 grid (step .5 below 2, 1 in [2, 4), 2 in [4, 6]).
    q = torch.where(
        a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2)
    )
    mag = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q / 2 + 4)).to(torch.uint8)
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode_ref(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) -> fp32 values; code 0x8 decodes to -0.0."""
    table = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    codes = codes.long()
    sign = torch.where((codes & 8) != 0, -1.0, 1.0).to(codes.device)
    return table[codes & 7] * sign


def _ceil_log2_ref(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2(v)) for positive normal fp32 v, exactly (frexp: v = m·2^k, m in [0.5, 1))."""
    mant, expo = torch.frexp(v)
    return torch.where(mant == 0.5, expo - 1, expo)


def _pow2_ref(k: torch.Tensor) -> torch.Tensor:
    """2^k as fp32 for integer k in [-126, 127], built from the exponent bits (exact)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def fp4_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K9 quantisation of the last dim (a multiple of 32).

    Args: x [..., K] float. Returns (codes uint8 [..., K/2], scales uint8 [..., K/32]) where
    scales are UE8M0 bytes. For K = 128, ``scales.view(torch.int32)`` is the little-endian word
    e0 | e1<<8 | e2<<16 | e3<<24 of kernels.md K9.
    """
    k = x.shape[-1]
    assert k % FP4_GROUP == 0, f"last dim {k} is not a multiple of {FP4_GROUP}"
    groups = x.float().reshape(*x.shape[:-1], k // FP4_GROUP, FP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    sf = torch.maximum(amax / 6, torch.tensor(_SCALE_FLOOR, dtype=torch.float32, device=x.device))
    exponent = torch.where(sf.isinf(), 254, (_ceil_log2_ref(sf) + 127).clamp(1, 254))
    codes = e2m1_encode_ref(groups / _pow2_ref(exponent - 127).unsqueeze(-1))
    codes = codes.reshape(*x.shape[:-1], k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, exponent.to(torch.uint8)


def fp4_dequant_ref(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of fp4_quant_ref: (uint8 [..., K/2], uint8 [..., K/32]) -> fp32 [..., K]."""
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1)
    values = e2m1_decode_ref(nibbles)
    k = values.shape[-1]
    factor = _pow2_ref(scales.long() - 127).repeat_interleave(FP4_GROUP, dim=-1)
    assert factor.shape[-1] == k, f"scales cover {factor.shape[-1]} channels, codes {k}"
    return values * factor


def fp4_fake_quant_ref(x: torch.Tensor) -> torch.Tensor:
    """K10 step 2 per 32-group of the last dim: s = ceil_pow2(max(amax, 6·2^-126)/6),
    v = e2m1_rne(clamp(x/s, ±6))·s, returned in x's dtype (exactly representable in bf16)."""
    k = x.shape[-1]
    groups = x.float().reshape(*x.shape[:-1], k // FP4_GROUP, FP4_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=_FAKE_QUANT_AMAX_FLOOR)
    s = _pow2_ref(_ceil_log2_ref(amax / 6))
    values = e2m1_decode_ref(e2m1_encode_ref((groups / s).clamp(-6.0, 6.0))) * s
    return values.reshape(x.shape).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Shared Triton helpers
# ------------------------------------------------------------------------------------------------


@triton.jit
def _ceil_pow2_biased_exponent(v):
    """Biased exponent of the smallest power of two >= v (v positive normal fp32)."""
    bits = v.to(tl.int32, bitcast=True)
    return (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _pow2_from_biased_exponent(e):
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_encode(v):
    """RNE onto the E2M1 grid by counting crossed midpoints: a midpoint whose lower neighbour has
    an even code rounds down (strict >), one whose lower neighbour is odd rounds up (>=)."""
    a = tl.abs(v)
    mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    mag += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    mag += (a > 5.0).to(tl.int32)
    return mag + 8 * (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)


@triton.jit
def _e2m1_decode(code):
    mag_code = code & 7
    mag = tl.where(
        mag_code < 4,
        mag_code.to(tl.float32) * 0.5,
        tl.where(mag_code < 6, (mag_code - 2).to(tl.float32), tl.where(mag_code == 6, 4.0, 6.0)),
    )
    # Multiply (not negate): Triton lowers -x as 0 - x, which turns -0.0 into +0.0.
    return mag * tl.where(code >= 8, -1.0, 1.0)


@triton.jit
def _fp4_quant_groups(even, odd):
    """even/odd fp32 [A, G, 16]: the two halves of each 32-group's element pairs.
    Returns (packed bytes int32 [A, G, 16], UE8M0 exponent bytes int32 [A, G])."""
    # No division can see a zero dividend: NVIDIA's div_rn calls a slow subroutine for one (the
    # masked rows of a row block at small T, zero groups). sf only decides the power of two, and
    # flooring amax at 6·2^-13 first gives the same one as flooring amax/6 at 1e-4 (2^-13).
    amax = tl.maximum(tl.max(tl.abs(even), axis=2), tl.max(tl.abs(odd), axis=2))
    sf = tl.div_rn(tl.maximum(amax, 6.0 * 2.0**-13), 6.0)
    exponent = tl.minimum(tl.maximum(_ceil_pow2_biased_exponent(sf), 1), 254)
    # x / 2^(e-127) == x · 2^(127-e), both correctly rounded, with the exact factor built from
    # its bits (e = 254: the subnormal 2^-127; no flush to zero on either backend by default).
    inv_bits = tl.where(exponent < 254, (254 - exponent) << 23, 0x400000)
    inv_scale = inv_bits.to(tl.float32, bitcast=True)[:, :, None]
    packed = _e2m1_encode(even * inv_scale) | (_e2m1_encode(odd * inv_scale) << 4)
    return packed, exponent


# ------------------------------------------------------------------------------------------------
# K9: index-key quantisation
# ------------------------------------------------------------------------------------------------


def fp4_index_k_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K9 reference: x [T, K] -> (codes uint8 [T, K/2], scales uint8 [T, K/32])."""
    return fp4_quant_ref(x)


@triton.jit
def _fp4_index_k_quant_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    loc_ptr,
    T,
    x_row_stride,
    codes_row_stride,
    scales_row_stride,
    G: tl.constexpr,
    GP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    HAS_LOC: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # x is the previous kernel's output; the cache rows may be read
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < T
    if HAS_LOC:  # issued with the row's loads: one round trip before the stores, not two
        out_rows = tl.load(loc_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        out_rows = rows.to(tl.int64)
    offs_g = tl.arange(0, GP)
    offs_p = tl.arange(0, 16)
    mask = row_ok[:, None, None] & (offs_g < G)[None, :, None]
    cols = (offs_g * 32)[None, :, None] + 2 * offs_p[None, None, :]
    src = x_ptr + rows.to(tl.int64)[:, None, None] * x_row_stride + cols
    even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    packed, exponent = _fp4_quant_groups(even, odd)
    if HAS_LOC:
        row_ok = row_ok & (out_rows != 0)  # slot 0 is the reserved dummy slot: publish nothing
    mask = row_ok[:, None, None] & (offs_g < G)[None, :, None]
    dst = codes_ptr + out_rows[:, None, None] * codes_row_stride + cols // 2
    tl.store(dst, packed.to(codes_ptr.dtype.element_ty), mask=mask)
    dst = scales_ptr + out_rows[:, None] * scales_row_stride + offs_g[None, :]
    mask = row_ok[:, None] & (offs_g < G)[None, :]
    tl.store(dst, exponent.to(scales_ptr.dtype.element_ty), mask=mask)


def _k_quant_meta(t: int, k: int) -> dict[str, int]:
    """Launch meta-parameters of K9 (rows per program, warps). Every row is quantised on its
    own with exact operations, so the bits do not depend on them; `sweep_launch.py` in
    `benchmark/kernels` times alternatives against this default: on an H200 one row per
    one-warp program won at every M (1.50-1.72 against 1.74-2.11 us for 8 rows x 4 warps)."""
    return {"BLOCK_ROWS": 1, "num_warps": 1}


def fp4_index_k_quant(
    x: torch.Tensor,
    *,
    loc: torch.Tensor | None = None,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K9: FP4-quantise index keys, several rows per program (format in the module docstring).

    Args:
        x: [T, K] bf16/fp16/fp32 with unit inner stride (any row stride); K a multiple of 32.
        loc: optional int32/int64 [T] destination rows; rows with loc == 0 (reserved dummy slot)
            are not written. Requires out_codes and out_scales.
        out_codes: uint8/int8 [rows, K/2], unit inner stride (e.g. ``cache[:, :K//2]``).
        out_scales: uint8/int8 [rows, K/32], unit inner stride (e.g. ``cache[:, K//2:]``).
    Returns:
        (out_codes, out_scales); allocated as [T, K/2] / [T, K/32] uint8 when not given.
    """
    _require(x.dim() == 2, f"x: expected [T, K], got shape {tuple(x.shape)}")
    t, k = x.shape
    _require(k % FP4_GROUP == 0 and k > 0, f"x: K={k} must be a positive multiple of 32")
    _require(x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x: bad dtype {x.dtype}")
    _require(x.stride(1) == 1 or t == 0, "x: inner stride must be 1")
    if loc is not None:
        _require(
            out_codes is not None and out_scales is not None,
            "loc: out_codes and out_scales are required with loc",
        )
        _require(
            loc.shape == (t,) and loc.dtype in (torch.int32, torch.int64) and loc.is_contiguous(),
            f"loc: expected contiguous int32/int64 [{t}], got {loc.dtype} {tuple(loc.shape)}",
        )
    rows = out_codes.shape[0] if out_codes is not None else t
    if out_codes is None:
        out_codes = torch.empty(t, k // 2, dtype=torch.uint8, device=x.device)
    if out_scales is None:
        out_scales = torch.empty(t, k // FP4_GROUP, dtype=torch.uint8, device=x.device)
    for name, buf, width in (
        ("out_codes", out_codes, k // 2),
        ("out_scales", out_scales, k // FP4_GROUP),
    ):
        _require(buf.dtype in (torch.uint8, torch.int8), f"{name}: uint8/int8, not {buf.dtype}")
        _require(
            buf.dim() == 2 and buf.shape == (rows, width) and buf.stride(1) == 1,
            f"{name}: expected [{rows}, {width}] with inner stride 1, got {tuple(buf.shape)}",
        )
        _require(buf.device == x.device, f"{name}: expected device {x.device}")
    _require(loc is not None or rows == t, f"out_codes: expected {t} rows without loc, got {rows}")
    if t == 0:
        return out_codes, out_scales
    g = k // FP4_GROUP
    meta = _k_quant_meta(t, k)
    _fp4_index_k_quant_kernel[(triton.cdiv(t, meta["BLOCK_ROWS"]),)](
        x,
        out_codes,
        out_scales,
        loc if loc is not None else x,
        t,
        x.stride(0),
        out_codes.stride(0),
        out_scales.stride(0),
        G=g,
        GP=triton.next_power_of_2(g),
        HAS_LOC=loc is not None,
        enable_fp_fusion=False,
        **programmatic_launch(_fp4_index_k_quant_kernel, x.device),
        **meta,
    )
    return out_codes, out_scales


# ------------------------------------------------------------------------------------------------
# K10: index-query RoPE tail + fake-quant + pack (+ head-weight reduce)
# ------------------------------------------------------------------------------------------------


class IndexQFp4Output(NamedTuple):
    """Outputs of index_q_rope_fp4 for T tokens, Hi heads of Di channels."""

    codes: torch.Tensor  # uint8 [T, Hi, Di/2]
    scales: torch.Tensor  # uint8 [T, 1, Di/32, 16, 4]: head h, group c at [t, 0, c, h%16, h//16]
    head_weights: torch.Tensor | None  # [T, Hi] q's dtype, when weight_partials were given
    fake_quant: torch.Tensor | None  # [T, Hi·Di] q's dtype: rotated, fake-quantised q (step 2)


def index_q_rope_ref(
    x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """K10 step 1: rotate the trailing rope_dim channels of x [T, H, Dh] by interleaved pairs
    (§3, K13's rope_tail_ref) at each token's position.

    cos_sin: fp32 [max_pos, rope_dim/2, 2] (cos, sin); positions [T]; positions outside the table
    use entry 0. The rotation is computed in fp32 and cast to x's dtype.
    """
    assert cos_sin.shape[1] * 2 == rope_dim, f"cos_sin {tuple(cos_sin.shape)}, rope_dim {rope_dim}"
    pos = positions.long()
    pos = torch.where((pos >= 0) & (pos < cos_sin.shape[0]), pos, 0)
    return rope_tail_ref(x, cos_sin[pos, :, 0].float(), cos_sin[pos, :, 1].float())


def index_q_rope_fp4_ref(
    q: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    n_heads: int,
    rope_dim: int,
    weight_partials: torch.Tensor | None = None,
    head_weight_scale: float = 1.0,
) -> IndexQFp4Output:
    """K10 unfused chain (kernels.md K10 steps 1-4).

    Args:
        q: [T, Hi·Di] (indexer slice of the q projection); cos_sin, positions: index_q_rope_ref.
        weight_partials: optional fp32 [S, T, Hi] split-K partials of the head-weight projection,
            summed in order s = 0..S-1, times head_weight_scale (softmax_scale · Hi_total^-0.5),
            cast to q's dtype.
    """
    t = q.shape[0]
    head_dim = q.shape[1] // n_heads
    x = index_q_rope_ref(q.view(t, n_heads, head_dim), cos_sin, positions, rope_dim)
    fake_quant = fp4_fake_quant_ref(x)
    codes, exponents = fp4_quant_ref(fake_quant)
    scales = torch.zeros(
        t,
        1,
        head_dim // FP4_GROUP,
        _HEAD_BLOCK,
        _MAX_HEAD_BLOCKS,
        dtype=torch.uint8,
        device=q.device,
    )
    for h in range(n_heads):
        scales[:, 0, :, h % _HEAD_BLOCK, h // _HEAD_BLOCK] = exponents[:, h, :]
    head_weights = None
    if weight_partials is not None:
        acc = weight_partials[0].float()
        for s in range(1, weight_partials.shape[0]):
            acc = acc + weight_partials[s].float()
        factor = torch.tensor(head_weight_scale, dtype=torch.float32, device=q.device)
        head_weights = (acc * factor).to(q.dtype)
    return IndexQFp4Output(codes, scales, head_weights, fake_quant.reshape(t, n_heads * head_dim))


@triton.jit
def _index_q_rope_fp4_kernel(
    q_ptr,
    cos_sin_ptr,
    pos_ptr,
    codes_ptr,
    scales_ptr,
    partials_ptr,
    weights_ptr,
    fake_quant_ptr,
    q_row_stride,
    max_pos,
    n_heads,
    partial_stride,
    head_weight_scale,
    NUM_PARTIALS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    WRITE_FAKE_QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, 4): 16 heads of one token per program; head blocks beyond n_heads zero-fill
    their scale slots."""
    wait_for_producers(PDL)  # q and the weight partials are the projections' outputs
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    heads = head_block * 16 + tl.arange(0, 16)
    offs_g = tl.arange(0, GP)
    offs_p = tl.arange(0, 16)
    g_ok = offs_g < G
    scale_offs = t * (G * 64) + offs_g[None, :] * 64 + tl.arange(0, 16)[:, None] * 4 + head_block
    if head_block * 16 >= n_heads:
        zeros = tl.zeros([16, GP], tl.int32).to(tl.uint8)
        tl.store(scales_ptr + scale_offs, zeros, mask=g_ok[None, :])
        return

    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.where((pos >= 0) & (pos < max_pos), pos, 0)
    pair = (offs_g * 16)[None, :, None] + offs_p[None, None, :]  # pair index inside a head
    mask = g_ok[None, :, None] & (heads < n_heads)[:, None, None]
    src = q_ptr + t * q_row_stride + heads[:, None, None] * HEAD_DIM + 2 * pair
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)

    # Step 1: rotate the trailing ROPE_DIM channels (complex multiply by e^{i·phi}).
    NOPE_PAIRS: tl.constexpr = (HEAD_DIM - ROPE_DIM) // 2
    is_rope = pair >= NOPE_PAIRS
    table = cos_sin_ptr + pos * ROPE_DIM + 2 * (pair - NOPE_PAIRS)
    cos = tl.load(table, mask=mask & is_rope, other=1.0)
    sin = tl.load(table + 1, mask=mask & is_rope, other=0.0)
    rot_a = a * cos - b * sin
    rot_b = a * sin + b * cos
    if ROUND_BF16:
        rot_a = _round_to_bf16(rot_a)
        rot_b = _round_to_bf16(rot_b)
    a = tl.where(is_rope, rot_a, a)
    b = tl.where(is_rope, rot_b, b)

    # Step 2: fake-quant with a power-of-two scale (amax floored before the /6).
    amax = tl.maximum(tl.max(tl.abs(a), axis=2), tl.max(tl.abs(b), axis=2))
    sf = tl.div_rn(tl.maximum(amax, 6.0 * 2.0**-126), 6.0)
    s = _pow2_from_biased_exponent(_ceil_pow2_biased_exponent(sf))[:, :, None]
    a = _e2m1_decode(_e2m1_encode(tl.div_rn(a, s))) * s
    b = _e2m1_decode(_e2m1_encode(tl.div_rn(b, s))) * s
    if WRITE_FAKE_QUANT:
        dst = fake_quant_ptr + t * n_heads * HEAD_DIM + heads[:, None, None] * HEAD_DIM + 2 * pair
        tl.store(dst, a.to(fake_quant_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + 1, b.to(fake_quant_ptr.dtype.element_ty), mask=mask)

    # Step 3: real quantisation of the (exactly bf16) fake-quant values, floor after the /6.
    packed, exponent = _fp4_quant_groups(a, b)
    dst = codes_ptr + t * n_heads * (HEAD_DIM // 2) + heads[:, None, None] * (HEAD_DIM // 2) + pair
    tl.store(dst, packed.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + scale_offs, exponent.to(tl.uint8), mask=g_ok[None, :])

    # Step 4: head weights, split-K partials summed in order.
    if HAS_WEIGHTS:
        acc = tl.load(partials_ptr + t * n_heads + heads)
        for sk in range(1, NUM_PARTIALS):
            acc = acc + tl.load(partials_ptr + sk * partial_stride + t * n_heads + heads)
        w = acc * head_weight_scale
        if ROUND_BF16:
            w = _round_to_bf16(w)
        tl.store(weights_ptr + t * n_heads + heads, w.to(weights_ptr.dtype.element_ty))


def index_q_rope_fp4(
    q: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    n_heads: int,
    rope_dim: int,
    weight_partials: torch.Tensor | None = None,
    head_weight_scale: float = 1.0,
    return_fake_quant: bool = False,
    out: IndexQFp4Output | None = None,
) -> IndexQFp4Output:
    """K10 in one launch: index_q_rope_fp4_ref bit for bit.

    Args:
        q: [T, n_heads·Di] bf16 or fp32, unit inner stride; n_heads a multiple of 16, <= 64;
            Di a multiple of 32.
        cos_sin: fp32 [max_pos, rope_dim/2, 2] contiguous; rope_dim even, <= Di.
        positions: int32/int64 [T]; out-of-table positions use entry 0.
        weight_partials: optional fp32 [S, T, n_heads] contiguous (see the reference).
        return_fake_quant: also write the step-2 tensor [T, n_heads·Di].
        out: optional preallocated outputs; the fields used must be given with the right shapes.
    """
    _require(q.dim() == 2, f"q: expected [T, n_heads*Di], got {tuple(q.shape)}")
    t, width = q.shape
    _require(
        n_heads % _HEAD_BLOCK == 0 and 0 < n_heads <= _HEAD_BLOCK * _MAX_HEAD_BLOCKS,
        f"n_heads: must be a multiple of 16 in [16, 64], got {n_heads}",
    )
    _require(width % n_heads == 0, f"q: width {width} is not a multiple of n_heads={n_heads}")
    head_dim = width // n_heads
    _require(head_dim % FP4_GROUP == 0, f"q: head dim {head_dim} must be a multiple of 32")
    _require(
        rope_dim % 2 == 0 and 0 < rope_dim <= head_dim,
        f"rope_dim: must be even in (0, {head_dim}], got {rope_dim}",
    )
    _require(q.dtype in (torch.bfloat16, torch.float32), f"q: must be bf16/fp32, got {q.dtype}")
    _require(q.stride(1) == 1 or t == 0, "q: inner stride must be 1")
    _require(
        cos_sin.dim() == 3
        and cos_sin.shape[1:] == (rope_dim // 2, 2)
        and cos_sin.dtype == torch.float32
        and cos_sin.is_contiguous(),
        f"cos_sin: expected contiguous fp32 [max_pos, {rope_dim // 2}, 2]",
    )
    _require(
        positions.shape == (t,) and positions.dtype in (torch.int32, torch.int64),
        f"positions: expected int32/int64 [{t}]",
    )
    positions = positions.contiguous()
    if weight_partials is not None:
        _require(
            weight_partials.dim() == 3
            and weight_partials.shape[1:] == (t, n_heads)
            and weight_partials.shape[0] >= 1
            and weight_partials.dtype == torch.float32
            and weight_partials.is_contiguous(),
            f"weight_partials: expected contiguous fp32 [S>=1, {t}, {n_heads}]",
        )
    g = head_dim // FP4_GROUP
    dev = q.device
    specs: list[tuple[tuple[int, ...], torch.dtype, bool]] = [  # (shape, dtype, wanted)
        ((t, n_heads, head_dim // 2), torch.uint8, True),
        ((t, 1, g, _HEAD_BLOCK, _MAX_HEAD_BLOCKS), torch.uint8, True),
        ((t, n_heads), q.dtype, weight_partials is not None),
        ((t, width), q.dtype, return_fake_quant),
    ]
    given: tuple[torch.Tensor | None, ...] = out if out is not None else (None,) * 4
    bufs: list[torch.Tensor | None] = []
    for name, buf, (shape, dt, want) in zip(IndexQFp4Output._fields, given, specs):
        if want and buf is None and out is None:
            buf = torch.empty(shape, dtype=dt, device=dev)
        if want:
            _require(
                buf is not None
                and tuple(buf.shape) == shape
                and buf.dtype == dt
                and buf.is_contiguous()
                and buf.device == dev,
                f"out.{name}: expected contiguous {dt} {shape} on {dev}",
            )
        bufs.append(buf if want else None)
    codes, scales, head_weights, fake_quant = bufs
    assert codes is not None and scales is not None
    out = IndexQFp4Output(codes, scales, head_weights, fake_quant)
    if t == 0:
        return out
    _index_q_rope_fp4_kernel[(t, _MAX_HEAD_BLOCKS)](
        q,
        cos_sin,
        positions,
        out.codes,
        out.scales,
        weight_partials if weight_partials is not None else q,
        out.head_weights if out.head_weights is not None else q,
        out.fake_quant if out.fake_quant is not None else q,
        q.stride(0),
        cos_sin.shape[0],
        n_heads,
        t * n_heads,
        float(head_weight_scale),
        NUM_PARTIALS=weight_partials.shape[0] if weight_partials is not None else 0,
        HEAD_DIM=head_dim,
        ROPE_DIM=rope_dim,
        G=g,
        GP=triton.next_power_of_2(g),
        ROUND_BF16=q.dtype == torch.bfloat16,
        HAS_WEIGHTS=weight_partials is not None,
        WRITE_FAKE_QUANT=return_fake_quant,
        num_warps=4,
        enable_fp_fusion=False,
        **programmatic_launch(_index_q_rope_fp4_kernel, q.device),
    )
    return out
