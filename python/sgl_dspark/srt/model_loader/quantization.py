"""Checkpoint weight formats of DeepSeek-V4: FP8 E4M3 with block scales and MXFP4.

Dequantisers turn stored tensors into float32; quantisers build the same formats (used by the
exporter and by tests). All scales are powers of two, so dequantisation is exact in float32.

Formats:
* FP8 block: weight `float8_e4m3fn [..., out, in]`, scale `[..., ceil(out/bo), ceil(in/bi)]`,
  `W[r, c] = fp8[r, c] * s[r // bo, c // bi]`.
* MXFP4: weight packed `uint8/int8 [..., out, in/2]` (low nibble = element 2c, high = 2c+1, each an
  E2M1 code), scale `[..., out, ceil(in/32)]`, `W[r, k] = e2m1(code) * s[r, k // 32]`.
* Scales are E8M0 (`float8_e8m0fnu`, or raw `uint8` exponent bytes e meaning 2^(e-127)), or
  floating-point multipliers (HF's fp32 `weight_scale_inv`).
"""

from __future__ import annotations

import torch

from sgl_dspark.kernels.linear.reference import (
    E2M1_VALUES,
    E8M0_BIAS,
    MXFP4_MAX_SCALE_BYTE,
    QuantizedWeight,
)

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
MXFP4_GROUP = 32
# Midpoints between consecutive E2M1 magnitudes (codes i and i+1).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

_SCALE_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FP4_STORAGE_DTYPES = (torch.uint8, torch.int8)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Any supported scale tensor -> float32 multipliers of the same shape.

    `float8_e8m0fnu` and `uint8` hold exponent bytes e (value 2^(e-127); byte 255 is NaN);
    floating dtypes are multipliers already.
    """
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        exponents = scale.to(torch.float32) - E8M0_BIAS
        out = torch.exp2(exponents)
        return torch.where(scale == 255, torch.full_like(out, float("nan")), out)
    if scale.dtype in _SCALE_FLOAT_DTYPES:
        return scale.to(torch.float32)
    raise ValueError(f"unsupported scale dtype {scale.dtype}")


def _expand_block_scale(
    scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]
) -> torch.Tensor:
    expanded = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return expanded.repeat_interleave(block[1], dim=-1)[..., :cols]


def fp8_block_scale_shape(
    weight_shape: torch.Size | tuple[int, ...], block: tuple[int, int]
) -> tuple[int, ...]:
    """Scale shape for an FP8 weight `[..., out, in]` with `block = (bo, bi)`."""
    *lead, rows, cols = weight_shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def mxfp4_scale_shape(
    packed_shape: torch.Size | tuple[int, ...], group: int = MXFP4_GROUP
) -> tuple[int, ...]:
    """Scale shape for a packed MXFP4 weight `[..., out, in/2]` with one scale per `group`
    input channels (32; some checkpoints declare 16)."""
    *lead, rows, packed_cols = packed_shape
    return (*lead, rows, -(-(2 * packed_cols) // group))


def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """FP8 E4M3 `[..., out, in]` with block scales -> float32 `[..., out, in]`."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    expected = fp8_block_scale_shape(weight.shape, block)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
            f"with block {tuple(block)} (expected {expected})"
        )
    rows, cols = weight.shape[-2:]
    multipliers = _expand_block_scale(scale_to_float(scale), rows, cols, block)
    return weight.to(torch.float32) * multipliers


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed uint8/int8 `[..., n]` -> float32 E2M1 values `[..., 2n]` (low nibble first)."""
    if packed.dtype not in _FP4_STORAGE_DTYPES:
        raise ValueError(f"packed MXFP4 weight must be uint8 or int8, got {packed.dtype}")
    raw = packed.view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).long()
    return table[codes].reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, group: int = MXFP4_GROUP
) -> torch.Tensor:
    """MXFP4 packed `[..., out, in/2]` with scales per `group` channels `[..., out, in/group]`
    -> float32."""
    expected = mxfp4_scale_shape(packed.shape, group)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match packed weight "
            f"{tuple(packed.shape)} (expected {expected})"
        )
    values = unpack_e2m1(packed)
    cols = values.shape[-1]
    multipliers = scale_to_float(scale).repeat_interleave(group, dim=-1)[..., :cols]
    return values * multipliers


def _pow2_exponent_covering(amax: torch.Tensor, grid_max: float) -> torch.Tensor:
    """Smallest integer k with amax <= grid_max * 2^k (int32), clamped to the E8M0 range.

    Zero blocks get k = 0. Computed with frexp plus an exact fix-up, so no log2 rounding.
    """
    ratio = amax / grid_max
    mantissa, exponent = torch.frexp(ratio)
    k = torch.where(mantissa == 0.5, exponent - 1, exponent)
    # ratio's division may round; grid_max * 2^k is exact, so fix k against amax directly.
    k = torch.where(amax > torch.ldexp(torch.full_like(amax, grid_max), k), k + 1, k)
    k = torch.where(amax <= torch.ldexp(torch.full_like(amax, grid_max), k - 1), k - 1, k)
    k = torch.where(amax == 0, torch.zeros_like(k), k)
    return k.clamp(-E8M0_BIAS, E8M0_BIAS)


def _exponent_to_e8m0(k: torch.Tensor) -> torch.Tensor:
    return (k + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def _check_finite(w: torch.Tensor, what: str) -> torch.Tensor:
    w32 = w.detach().to(torch.float32)
    if not torch.isfinite(w32).all():
        raise ValueError(f"{what}: input contains NaN or Inf")
    return w32


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float `[..., out, in]` -> (float8_e4m3fn `[..., out, in]`, float8_e8m0fnu block scales).

    Each block's scale is the smallest power of two s with amax / s <= 448, so nothing clips;
    w / s is exact and the cast to E4M3 rounds to nearest, ties to even.
    """
    if weight.dim() < 2:
        raise ValueError(
            f"quantize_fp8_block needs a [..., out, in] tensor, got shape {tuple(weight.shape)}"
        )
    w32 = _check_finite(weight, "quantize_fp8_block")
    *lead, rows, cols = w32.shape
    bo, bi = block
    n_r, n_c = -(-rows // bo), -(-cols // bi)
    padded = torch.zeros(*lead, n_r * bo, n_c * bi, dtype=torch.float32, device=w32.device)
    padded[..., :rows, :cols] = w32
    blocks = padded.reshape(*lead, n_r, bo, n_c, bi)
    amax = blocks.abs().amax(dim=(-3, -1))
    k = _pow2_exponent_covering(amax, FP8_E4M3_MAX)
    multipliers = _expand_block_scale(torch.exp2(k.to(torch.float32)), rows, cols, block)
    q = (w32 / multipliers).to(torch.float8_e4m3fn)
    return q, _exponent_to_e8m0(k)


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Float32 values with |x| <= 6 -> 4-bit E2M1 codes (uint8), round to nearest, ties to even.

    Between codes i and i+1 the tie goes to the even code: down when i is even, up when i is odd.
    """
    magnitude = x.abs()
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for i, midpoint in enumerate(_E2M1_MIDPOINTS):
        above = magnitude > midpoint if i % 2 == 0 else magnitude >= midpoint
        code += above.to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code | sign


def quantize_mxfp4(
    weight: torch.Tensor, group: int = MXFP4_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float `[..., out, in]` (in even) -> (packed int8 `[..., out, in/2]`, e8m0 `[..., out, ceil(in/group)]`).

    Each group of `group` channels (32 by default) gets the smallest power-of-two scale s with amax / s <= 6 (no clipping);
    values round to the E2M1 grid with ties to even. Packed as int8, the dtype of the released
    checkpoints (HF's dequantiser only unpacks int8).
    """
    if weight.dim() < 2 or weight.shape[-1] % 2:
        raise ValueError(
            f"quantize_mxfp4 needs [..., out, in] with even in, got {tuple(weight.shape)}"
        )
    w32 = _check_finite(weight, "quantize_mxfp4")
    *lead, rows, cols = w32.shape
    groups = -(-cols // group)
    padded = torch.zeros(*lead, rows, groups * group, dtype=torch.float32, device=w32.device)
    padded[..., :cols] = w32
    amax = padded.reshape(*lead, rows, groups, group).abs().amax(dim=-1)
    k = _pow2_exponent_covering(amax, FP4_E2M1_MAX)
    multipliers = torch.exp2(k.to(torch.float32)).repeat_interleave(group, dim=-1)[..., :cols]
    codes = round_to_e2m1_codes(w32 / multipliers)
    pairs = codes.reshape(*lead, rows, cols // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)
    return packed, _exponent_to_e8m0(k)


def e8m0_bytes(scale: torch.Tensor, what: str) -> torch.Tensor:
    """Any supported scale tensor -> uint8 E8M0 exponent bytes in 1..254 (the range the kernels
    decode); float multipliers must be powers of two. ValueError naming `what` otherwise."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        out = scale
    elif scale.dtype in _SCALE_FLOAT_DTYPES:
        mantissa, exponent = torch.frexp(scale.to(torch.float32))
        if not bool(((mantissa == 0.5) & (scale > 0)).all()):
            raise ValueError(f"{what}: scales are not all positive powers of two")
        out = (exponent - 1 + E8M0_BIAS).clamp(0, 255).to(torch.uint8)
    else:
        raise ValueError(f"{what}: unsupported scale dtype {scale.dtype}")
    if bool(((out == 0) | (out == 255)).any()):
        raise ValueError(f"{what}: E8M0 scale bytes 0 (2^-127) or 255 (NaN) are not supported")
    return out


def fp8_block_to_runtime(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], what: str = "weight"
) -> QuantizedWeight:
    """FP8 with `block = (rows, cols)` scales -> the runtime layout (`kernels/linear/
    reference.py`: the same blocks, E8M0 bytes). The block's columns must be a power of two of
    at least 16 (a matrix-unit K step)."""
    rows, cols = block
    if cols < 16 or cols & (cols - 1):
        raise ValueError(
            f"{what}: FP8 scale blocks of {cols} input channels are not supported natively "
            "(a power of two >= 16 is); use --weight-format bf16"
        )
    expected = fp8_block_scale_shape(weight.shape, block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{what}: FP8 scale shape {tuple(scale.shape)}, expected {expected}")
    scale_bytes = e8m0_bytes(scale, what).contiguous()
    return QuantizedWeight(weight.contiguous(), scale_bytes, "fp8", cols, rows)


def mxfp4_to_runtime(
    packed: torch.Tensor, scale: torch.Tensor, group: int = MXFP4_GROUP, what: str = "weight"
) -> QuantizedWeight:
    """Packed MXFP4 with per-`group` scales -> the runtime layout. Groups must be a power of two
    of at least 32 (16 E2M1 pairs, a matrix-unit K step per nibble), and scales at most 2
    (E8M0 bytes <= 128, weights |w| <= 12: the kernels' decode folds a 2^126 into the scale,
    `kernels/linear/dequant.py`)."""
    if group < 32 or group & (group - 1):
        raise ValueError(
            f"{what}: MXFP4 scale group {group} is not supported natively (a power of two "
            ">= 32 is); use --weight-format bf16"
        )
    expected = mxfp4_scale_shape(packed.shape, group)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{what}: MXFP4 scale shape {tuple(scale.shape)}, expected {expected}")
    data = packed.view(torch.uint8).contiguous()
    scale_bytes = e8m0_bytes(scale, what).contiguous()
    if bool((scale_bytes > MXFP4_MAX_SCALE_BYTE).any()):
        raise ValueError(
            f"{what}: MXFP4 scales above 2 (E8M0 bytes > {MXFP4_MAX_SCALE_BYTE}) are not "
            "supported natively; use --weight-format bf16"
        )
    return QuantizedWeight(data, scale_bytes, "mxfp4", group)


__all__ = [
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "FP4_E2M1_MAX",
    "MXFP4_GROUP",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "e8m0_bytes",
    "fp8_block_scale_shape",
    "fp8_block_to_runtime",
    "mxfp4_to_runtime",
    "mxfp4_scale_shape",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "round_to_e2m1_codes",
    "scale_to_float",
    "unpack_e2m1",
]
