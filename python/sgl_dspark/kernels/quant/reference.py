"""DeepSeek-V4.1's activation quantisers (part of the model, applied even with unquantised
weights) and the packed formats its caches store them in: the reference of the kernels that
quantise while they store (`store.py`: the window KV store, the compressed-latent and index-key
stores, each with its rotation) and of the kernel that gathers and decodes stored rows
(`load.py`).

Three quantisers, each over blocks of the last dimension (left unquantised when that dimension
is not a multiple of the block):

| name | used on | block | element | scale |
|---|---|---|---|---|
| FP8 window | window K=V after its norm and RoPE | 32 | FP8 E4M3 | power of two (ue8m0), from amax / 448 (floor 1e-4) |
| FP4 latent | compressed latents after RoPE | 16 | FP4 E2M1 | FP8 E4M3, from amax / 6 (floor 6 * 2^-9) |
| FP4 index | indexer queries and keys after RoPE | 32 | FP4 E2M1 | power of two (ue8m0), from amax / 6 (floor 6 * 2^-126) |

Every `fake_quant_*` is `dequantize_*(quantize_*(x))`: the value the model computes with is the
value a cache that stores the packed form reads back, so storing packed is lossless. All
arithmetic is fp32; E2M1 rounds to nearest with ties to the even code, and a value that rounds
to zero is +0.0 whatever its sign.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_dspark.kernels.rope.reference import rope_tail_ref

FP8_MAX = 448.0
FP4_MAX = 6.0
WINDOW_BLOCK = 32
LATENT_BLOCK = 16
INDEX_BLOCK = 32
_WINDOW_AMAX_FLOOR = 1e-4
_LATENT_AMAX_FLOOR = 6.0 * 2.0**-9
_INDEX_AMAX_FLOOR = 6.0 * 2.0**-126
_E8M0_BIAS = 127
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between E2M1 codes k and k + 1; a tie rounds to the even code of the two.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class Fp8Rows(NamedTuple):
    """FP8 E4M3 elements [..., D] and one ue8m0 exponent byte per 32 channels [..., D / 32]."""

    codes: torch.Tensor
    exponents: torch.Tensor


class Fp4Rows(NamedTuple):
    """E2M1 codes packed two per byte [..., D / 2] (element 2i in the low nibble) and one scale
    per block: E4M3 [..., D / 16] (latents) or ue8m0 exponent bytes [..., D / 32] (index)."""

    packed: torch.Tensor
    scales: torch.Tensor


def quantizes(dim: int, block: int) -> bool:
    """Whether a last dimension of `dim` channels is quantised in blocks of `block`."""
    return dim % block == 0


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    assert quantizes(x.shape[-1], block), (tuple(x.shape), block)
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pow2_ceil_exponent(t: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent e of the smallest power of two >= t (t > 0 fp32), from the IEEE bits:
    the exponent field, plus one when any mantissa bit is set."""
    bits = t.contiguous().view(torch.int32)
    field = (bits >> 23) & 0xFF
    return field - _E8M0_BIAS + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _exp2(e: torch.Tensor) -> torch.Tensor:
    """2**e as fp32, exactly, for integer e in [-126, 127] (built from the exponent field)."""
    return ((e.to(torch.int32) + _E8M0_BIAS) << 23).view(torch.float32)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit codes (bit 3 = sign) of fp32 v, |v| <= 6, rounded to nearest, ties to even."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for k, mid in enumerate(_E2M1_MIDPOINTS):
        passed = mag > mid if k % 2 == 0 else mag >= mid  # a tie goes to code k if k is even
        code += passed.to(torch.uint8)
    negative = (v < 0) & (code != 0)
    return code | (negative.to(torch.uint8) << 3)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The values of 4-bit codes (uint8 in 0..15) in fp32, from the bits rather than a table (a
    table tensor would be copied from the host on every call, which a CUDA graph cannot capture).
    E2M1's sign, exponent and mantissa bits placed at fp16's sign bit and at the bottom of its
    exponent and top of its mantissa are the fp16 number value * 2^-14 (code 1, the subnormal
    0.5, lands on fp16's subnormal 2^-15), so one shift-or, a reinterpretation and one exact
    power-of-two product decode every code: four elementwise ops where the arithmetic form
    (exponent, mantissa, two selects) took eight, on the path every V4.1 cache read takes."""
    c = codes.to(torch.int16)
    bits = ((c & 0x8) << 12) | ((c & 0x7) << 9)
    return bits.view(torch.float16).float() * 16384.0


def _pack(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ---- FP8 window KV -----------------------------------------------------------------------------


def quantize_fp8_window_ref(x: torch.Tensor) -> Fp8Rows:
    """x [..., D] (D a multiple of 32) -> E4M3 elements and ue8m0 exponents."""
    b = _blocks(x, WINDOW_BLOCK)
    amax = b.abs().amax(-1, keepdim=True).clamp(min=_WINDOW_AMAX_FLOOR)
    e = _pow2_ceil_exponent(amax * (1.0 / FP8_MAX))
    scaled = (b / _exp2(e)).clamp(-FP8_MAX, FP8_MAX)
    codes = scaled.to(torch.float8_e4m3fn).reshape(x.shape)
    return Fp8Rows(codes, (e + _E8M0_BIAS).to(torch.uint8).squeeze(-1))


def dequantize_fp8_window_ref(rows: Fp8Rows, dtype: torch.dtype) -> torch.Tensor:
    codes = rows.codes.float()
    b = codes.reshape(*codes.shape[:-1], codes.shape[-1] // WINDOW_BLOCK, WINDOW_BLOCK)
    scale = _exp2(rows.exponents.to(torch.int32) - _E8M0_BIAS).unsqueeze(-1)
    return (b * scale).reshape(codes.shape).to(dtype)


def fake_quant_fp8_window_ref(x: torch.Tensor) -> torch.Tensor:
    if not quantizes(x.shape[-1], WINDOW_BLOCK):
        return x
    return dequantize_fp8_window_ref(quantize_fp8_window_ref(x), x.dtype)


# ---- FP4 compressed latents (E4M3 scales) -------------------------------------------------------


def quantize_fp4_latent_ref(x: torch.Tensor) -> Fp4Rows:
    """x [..., D] (D a multiple of 16) -> packed E2M1 and E4M3 scales per 16 channels."""
    b = _blocks(x, LATENT_BLOCK)
    amax = b.abs().amax(-1, keepdim=True).clamp(min=_LATENT_AMAX_FLOOR)
    # amax >= 6 * 2^-9 keeps the scale at or above E4M3's smallest subnormal; the cap keeps it
    # finite (an E4M3 cast past 448 is not saturating on every device).
    # A correctly rounded division on every device (CUDA turns a division by a Python scalar
    # into a product with its reciprocal).
    scale = (amax / torch.full_like(amax, FP4_MAX)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    codes = _e2m1_codes((b / scale.float()).clamp(-FP4_MAX, FP4_MAX))
    return Fp4Rows(_pack(codes.reshape(x.shape)), scale.squeeze(-1))


def dequantize_fp4_latent_ref(rows: Fp4Rows, dtype: torch.dtype) -> torch.Tensor:
    v = _e2m1_values(_unpack(rows.packed))
    b = v.reshape(*v.shape[:-1], v.shape[-1] // LATENT_BLOCK, LATENT_BLOCK)
    return (b * rows.scales.float().unsqueeze(-1)).reshape(v.shape).to(dtype)


def fake_quant_fp4_latent_ref(x: torch.Tensor) -> torch.Tensor:
    if not quantizes(x.shape[-1], LATENT_BLOCK):
        return x
    return dequantize_fp4_latent_ref(quantize_fp4_latent_ref(x), x.dtype)


# ---- FP4 indexer queries and keys (ue8m0 scales) ------------------------------------------------


def quantize_fp4_index_ref(x: torch.Tensor) -> Fp4Rows:
    """x [..., D] (D a multiple of 32) -> packed E2M1 and ue8m0 exponents per 32 channels."""
    b = _blocks(x, INDEX_BLOCK)
    amax = b.abs().amax(-1, keepdim=True).clamp(min=_INDEX_AMAX_FLOOR)
    e = _pow2_ceil_exponent(amax * (1.0 / FP4_MAX))
    codes = _e2m1_codes((b / _exp2(e)).clamp(-FP4_MAX, FP4_MAX))
    return Fp4Rows(_pack(codes.reshape(x.shape)), (e + _E8M0_BIAS).to(torch.uint8).squeeze(-1))


def dequantize_fp4_index_ref(rows: Fp4Rows, dtype: torch.dtype) -> torch.Tensor:
    v = _e2m1_values(_unpack(rows.packed))
    b = v.reshape(*v.shape[:-1], v.shape[-1] // INDEX_BLOCK, INDEX_BLOCK)
    scale = _exp2(rows.scales.to(torch.int32) - _E8M0_BIAS).unsqueeze(-1)
    return (b * scale).reshape(v.shape).to(dtype)


def fake_quant_fp4_index_ref(x: torch.Tensor) -> torch.Tensor:
    if not quantizes(x.shape[-1], INDEX_BLOCK):
        return x
    return dequantize_fp4_index_ref(quantize_fp4_index_ref(x), x.dtype)


# ---- the fused stores ------------------------------------------------------------------------

_QUANTIZE_REF = {
    "fp8_window": quantize_fp8_window_ref,
    "fp4_latent": quantize_fp4_latent_ref,
    "fp4_index": quantize_fp4_index_ref,
}


def quant_store_ref(
    x: torch.Tensor,
    rows: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> None:
    """What `store.py::quant_store` computes: rotate the trailing `2 * cos.shape[1]` channels of
    every row of x `[N, D]` (`rope_tail_ref`, when cos/sin are given), quantise the rows with
    `fmt`'s quantiser ("fp8_window", "fp4_latent", "fp4_index") and write the packed elements
    and scale bytes (uint8) at `rows` of `data` / `scales`."""
    if cos is not None:
        assert sin is not None
        x = rope_tail_ref(x, cos, sin)
    elements, scale = _QUANTIZE_REF[fmt](x)
    data[rows] = elements.view(torch.uint8)
    scales[rows] = scale.view(torch.uint8)


def quant_load_ref(
    data: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    fmt: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """What `load.py::quant_load` computes: the packed cache rows `rows` (any shape) of `data` /
    `scales` (uint8, as `quant_store_ref` writes them) decoded with `fmt`'s dequantiser,
    `[*rows.shape, D]` in `dtype`."""
    elements, scale = data[rows], scales[rows]
    if fmt == "fp8_window":
        return dequantize_fp8_window_ref(Fp8Rows(elements.view(torch.float8_e4m3fn), scale), dtype)
    if fmt == "fp4_latent":
        return dequantize_fp4_latent_ref(Fp4Rows(elements, scale.view(torch.float8_e4m3fn)), dtype)
    assert fmt == "fp4_index", fmt
    return dequantize_fp4_index_ref(Fp4Rows(elements, scale), dtype)


def quant_store_values_ref(
    x: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> None:
    """What `store.py::quant_store_values` computes: `fake_quant_fp8_window_ref` of the rotated
    rows of x (as `quant_store_ref`) written at `rows` of the float rows `out`."""
    if cos is not None:
        assert sin is not None
        x = rope_tail_ref(x, cos, sin)
    out[rows] = fake_quant_fp8_window_ref(x).to(out.dtype)


__all__ = [
    "FP4_MAX",
    "FP8_MAX",
    "INDEX_BLOCK",
    "LATENT_BLOCK",
    "WINDOW_BLOCK",
    "Fp4Rows",
    "Fp8Rows",
    "dequantize_fp4_index_ref",
    "dequantize_fp4_latent_ref",
    "dequantize_fp8_window_ref",
    "fake_quant_fp4_index_ref",
    "fake_quant_fp4_latent_ref",
    "fake_quant_fp8_window_ref",
    "quantize_fp4_index_ref",
    "quantize_fp4_latent_ref",
    "quantize_fp8_window_ref",
    "quant_load_ref",
    "quant_store_ref",
    "quant_store_values_ref",
    "quantizes",
]
