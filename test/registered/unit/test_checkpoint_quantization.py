"""FP8 block and MXFP4 checkpoint formats: quantisers and dequantisers against hand-written
references (bit-level decoding, nearest-grid search with ties to even), hand-derived RNE ties,
exact-grid round trips and shapes that are not multiples of the block."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sgl_dspark.srt.model_loader.quantization import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    quantize_fp8_block,
    quantize_mxfp4,
    scale_to_float,
)


# ---- independent references --------------------------------------------------------------
def decode_e4m3(code: int) -> float:
    """E4M3FN byte -> value, from the bit layout s.eeee.mmm (bias 7, no infinities)."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def decode_e2m1(code: int) -> float:
    """E2M1 nibble -> value, from the bit layout s.ee.m (bias 1)."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def grid(decode, n_codes: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct finite grid values and, for each, whether its code is even (mantissa LSB 0)."""
    values, even = {}, {}
    for code in range(n_codes):
        v = decode(code)
        if not math.isnan(v) and v not in values:
            values[v], even[v] = code, code % 2 == 0
    keys = sorted(values)
    return np.array(keys), np.array([even[k] for k in keys])


E4M3_GRID = grid(decode_e4m3, 256)
E2M1_GRID = grid(decode_e2m1, 16)


def round_to_grid_ref(x: np.ndarray, grid_values: np.ndarray, grid_even: np.ndarray) -> np.ndarray:
    """Nearest grid value; between two equally near values, the one with an even code."""
    dist = np.abs(x[..., None] - grid_values)
    best = dist.min(axis=-1, keepdims=True)
    candidates = dist == best
    tie = candidates.sum(-1) > 1
    choice = np.argmax(candidates, axis=-1)
    even_choice = np.argmax(candidates & grid_even, axis=-1)
    return grid_values[np.where(tie, even_choice, choice)]


def pow2_scale_ref(amax: float, grid_max: float) -> float:
    """Smallest power of two s with amax / s <= grid_max (1 for an all-zero block)."""
    if amax == 0:
        return 1.0
    k = math.ceil(math.log2(amax / grid_max))
    while amax > grid_max * 2.0**k:
        k += 1
    while amax <= grid_max * 2.0 ** (k - 1):
        k -= 1
    return 2.0**k


def fp8_dequant_ref(
    q: torch.Tensor, scale_bytes: torch.Tensor, block: tuple[int, int]
) -> np.ndarray:
    codes = q.view(torch.uint8).numpy()
    exps = scale_bytes.view(torch.uint8).numpy().astype(np.int64)
    out = np.empty(codes.shape, dtype=np.float64)
    for idx in np.ndindex(codes.shape):
        *lead, r, c = idx
        e = exps[(*lead, r // block[0], c // block[1])]
        out[idx] = decode_e4m3(int(codes[idx])) * 2.0 ** (int(e) - 127)
    return out


def mxfp4_dequant_ref(packed: torch.Tensor, scale_bytes: torch.Tensor) -> np.ndarray:
    raw = packed.view(torch.uint8).numpy()
    exps = scale_bytes.view(torch.uint8).numpy().astype(np.int64)
    out = np.empty((*raw.shape[:-1], 2 * raw.shape[-1]), dtype=np.float64)
    for idx in np.ndindex(out.shape):
        *lead, r, k = idx
        byte = int(raw[(*lead, r, k // 2)])
        nibble = byte & 0xF if k % 2 == 0 else byte >> 4
        out[idx] = decode_e2m1(nibble) * 2.0 ** (int(exps[(*lead, r, k // 32)]) - 127)
    return out


def quant_ref(w: np.ndarray, group_shape: tuple[int, int], grid_max: float, grid_) -> np.ndarray:
    """Reference quantise->dequantise for [..., out, in] with (rows, cols) groups."""
    out = np.empty_like(w)
    rows, cols = w.shape[-2:]
    for lead in np.ndindex(w.shape[:-2]):
        for r0 in range(0, rows, group_shape[0]):
            for c0 in range(0, cols, group_shape[1]):
                sl = (*lead, slice(r0, r0 + group_shape[0]), slice(c0, c0 + group_shape[1]))
                s = pow2_scale_ref(float(np.abs(w[sl]).max()), grid_max)
                out[sl] = round_to_grid_ref(w[sl] / s, *grid_) * s
    return out


# ---- tests -------------------------------------------------------------------------------
FP8_SHAPES = [(128, 128), (200, 72), (1, 5), (130, 300), (3, 140, 260)]
MXFP4_SHAPES = [(4, 64), (5, 40), (1, 2), (2, 3, 96)]


@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_block_matches_reference(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    block = (128, 128)
    # Mixed magnitudes across blocks so different blocks get different scales.
    w = torch.randn(shape, generator=gen) * torch.exp2(
        torch.randint(-12, 6, shape, generator=gen) / 4
    )
    q, scale = quantize_fp8_block(w, block)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    deq = dequantize_fp8_block(q, scale, block)
    np.testing.assert_array_equal(deq.numpy(), fp8_dequant_ref(q, scale, block))
    expected = quant_ref(w.double().numpy(), block, 448.0, E4M3_GRID)
    np.testing.assert_array_equal(deq.double().numpy(), expected)


@pytest.mark.parametrize("block", [(32, 32), (16, 64)])
def test_fp8_other_block_sizes(block: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(block[0] * 1000 + block[1])
    w = torch.randn(70, 100, generator=gen) * 3
    q, scale = quantize_fp8_block(w, block)
    deq = dequantize_fp8_block(q, scale, block)
    np.testing.assert_array_equal(
        deq.double().numpy(), quant_ref(w.double().numpy(), block, 448.0, E4M3_GRID)
    )


@pytest.mark.parametrize("shape", MXFP4_SHAPES)
def test_mxfp4_matches_reference(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(7 + sum(shape))
    w = torch.randn(shape, generator=gen) * torch.exp2(
        torch.randint(-8, 8, shape, generator=gen) / 3
    )
    packed, scale = quantize_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (*shape[:-1], -(-shape[-1] // 32))
    deq = dequantize_mxfp4(packed, scale)
    np.testing.assert_array_equal(deq.numpy(), mxfp4_dequant_ref(packed, scale))
    np.testing.assert_array_equal(
        deq.double().numpy(), quant_ref(w.double().numpy(), (1, 32), 6.0, E2M1_GRID)
    )


def test_fp8_exact_grid_round_trips_exactly() -> None:
    gen = torch.Generator().manual_seed(3)
    values = torch.tensor(E4M3_GRID[0], dtype=torch.float32)
    rows, cols = 256, 384
    w = values[torch.randint(len(values), (rows, cols), generator=gen)]
    w[::128, ::128] = 448.0  # each block's amax is the grid max -> block scale before 2^k is 1
    exps = torch.randint(-20, 20, (2, 3), generator=gen)
    w = w * torch.exp2(exps.float()).repeat_interleave(128, 0).repeat_interleave(128, 1)
    q, scale = quantize_fp8_block(w)
    assert torch.equal(scale.view(torch.uint8).long(), exps + 127)
    assert torch.equal(dequantize_fp8_block(q, scale, (128, 128)), w)


def test_mxfp4_exact_grid_round_trips_exactly() -> None:
    gen = torch.Generator().manual_seed(4)
    values = torch.tensor(E2M1_GRID[0], dtype=torch.float32)
    w = values[torch.randint(len(values), (6, 128), generator=gen)]
    w[:, ::32] = -6.0
    exps = torch.randint(-10, 10, (6, 4), generator=gen)
    w = w * torch.exp2(exps.float()).repeat_interleave(32, 1)
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(scale.view(torch.uint8).long(), exps + 127)
    assert torch.equal(dequantize_mxfp4(packed, scale), w)


def test_fp8_ties_round_to_even() -> None:
    # One block whose amax is 448 -> scale 1. E4M3 spacing is 1/8 in [1, 2), 2^-9 for subnormals.
    ties = {
        1.0625: 1.0,
        1.1875: 1.25,
        1.3125: 1.25,
        -1.0625: -1.0,
        2.0**-10: 0.0,
        3 * 2.0**-10: 2 * 2.0**-9,
        5 * 2.0**-10: 2 * 2.0**-9,
        17.0: 16.0,
        19.0: 20.0,
    }
    w = torch.tensor([[448.0, *ties]], dtype=torch.float32)
    q, scale = quantize_fp8_block(w)
    assert scale.view(torch.uint8).item() == 127
    got = dequantize_fp8_block(q, scale, (128, 128))[0, 1:].tolist()
    assert got == list(ties.values())


def test_mxfp4_ties_round_to_even() -> None:
    # Group amax 6 -> scale 1. Midpoints go to the code with mantissa bit 0.
    ties = {
        0.25: 0.0,
        0.75: 1.0,
        1.25: 1.0,
        1.75: 2.0,
        2.5: 2.0,
        3.5: 4.0,
        5.0: 4.0,
        -0.75: -1.0,
        -2.5: -2.0,
        0.3: 0.5,
        5.1: 6.0,
    }
    w = torch.tensor([[6.0, *ties]], dtype=torch.float32)
    packed, scale = quantize_mxfp4(w)
    assert scale.view(torch.uint8).item() == 127
    got = dequantize_mxfp4(packed, scale)[0, 1:].tolist()
    assert got == list(ties.values())


def test_mxfp4_nibble_order() -> None:
    # byte 0x71: low nibble 1 (0.5) is element 0, high nibble 7 (6.0) is element 1.
    packed = torch.tensor([[0x71, 0xA8]], dtype=torch.uint8)
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    assert dequantize_mxfp4(packed, scale).tolist() == [[1.0, 12.0, -0.0, -2.0]]


def test_scale_storage_forms_agree() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(150, 260, generator=gen)
    q, scale = quantize_fp8_block(w)
    as_bytes = scale.view(torch.uint8)
    as_multiplier = scale_to_float(scale)
    assert torch.equal(as_multiplier, torch.exp2(as_bytes.float() - 127))
    ref = dequantize_fp8_block(q, scale, (128, 128))
    for form in (as_bytes, as_multiplier):
        assert torch.equal(dequantize_fp8_block(q, form, (128, 128)), ref)
    nan_scale = torch.tensor([255], dtype=torch.uint8)
    assert torch.isnan(scale_to_float(nan_scale)).all()


def test_zero_block_and_bf16_input() -> None:
    w = torch.zeros(130, 10)
    w[129, 3] = -0.3
    q, scale = quantize_fp8_block(w.bfloat16())
    assert scale.view(torch.uint8)[0, 0].item() == 127  # all-zero block: scale 1
    deq = dequantize_fp8_block(q, scale, (128, 128))
    expected = quant_ref(w.bfloat16().double().numpy(), (128, 128), 448.0, E4M3_GRID)
    np.testing.assert_array_equal(deq.double().numpy(), expected)


def test_quantiser_and_dequantiser_errors() -> None:
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_fp8_block(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="even"):
        quantize_mxfp4(torch.ones(2, 3))
    q, scale = quantize_fp8_block(torch.randn(200, 200))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8_block(q, scale[:1], (128, 128))
    packed, s4 = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_mxfp4(packed, s4[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8_block(q.to(torch.float8_e5m2), scale, (128, 128))
