"""The V4.1 QAT fake-quantisers: hand-checked cases (expected values worked out by hand in the
comments) for both the engine's and the test reference's implementations, agreement of the two
(written independently) on random inputs of many magnitudes, and lossless packed storage."""

from __future__ import annotations

import pytest
import torch
import v41_reference as ref
from sgl_dspark.srt.quantization import fake_quant as fq

P = 2.0  # powers of two below, spelled out


def _block(values: list[float], size: int) -> torch.Tensor:
    """One quantisation block: `values`, then zeros (which never set the block's amax)."""
    return torch.tensor(values + [0.0] * (size - len(values)), dtype=torch.float32)


# (values, expected) per quantiser; block = 32 (FP8 window, FP4 index) or 16 (FP4 latent).
WINDOW_CASES = [
    # amax 450 -> scale pow2ceil(450/448) = 2; 450/2 = 225 -> E4M3 224 (step 16 in [128, 256));
    # 4.25/2 = 2.125 is a tie between 2 and 2.25 -> even mantissa 2; 3*2^-9/2 = 1.5 subnormal
    # steps of 2^-9 -> tie -> 2 steps = 2^-8; times 2.
    ([450.0, 4.25, 3 * P**-9], [448.0, 4.0, P**-7]),
    # amax 100 -> 100/448 = 0.223 -> scale 0.25; 400 lies between 384 and 416 (step 32): tie ->
    # even mantissa 384 -> 96; 3.3/0.25 = 13.2 -> 13 (step 1) -> 3.25.
    ([100.0, 3.3], [96.0, 3.25]),
    # amax 448 -> 448 * fp32(1/448) == 1.0 exactly -> scale 1; 1.0625 ties 1.0 / 1.125 -> 1.0.
    ([448.0, 1.0625], [448.0, 1.0]),
    # amax below the 1e-4 floor: scale pow2ceil(1e-4 / 448 = 2.23e-7) = 2^-22; 1e-5 / 2^-22 =
    # 41.94 -> 40 (step 4 in [32, 64)).
    ([1e-5], [40 * P**-22]),
    ([-450.0, -4.25], [-448.0, -4.0]),
]
LATENT_CASES = [
    # amax 7 -> scale E4M3(7/6 = 1.1667) = 1.125 (step 0.125); 7/1.125 = 6.22 -> clamp 6;
    # 2.8125/1.125 = 2.5 -> tie 2|3 -> 2; 0.5625/1.125 = 0.5; 1.4/1.125 = 1.244 -> 1.
    ([7.0, 2.8125, 0.5625, 1.4], [6.75, 2.25, 0.5625, 1.125]),
    # amax 0.7 -> 0.11667 -> E4M3 step 2^-7 in [2^-4, 2^-3): 14.93 steps -> 15 -> 0.1171875;
    # 0.7 / s = 5.97 -> 6; 0.2 / s = 1.707 -> 1.5 (below the 1.75 midpoint).
    ([0.7, 0.2], [0.703125, 0.17578125]),
    # amax below the 6 * 2^-9 floor -> scale 2^-9 (E4M3's smallest subnormal); 0.001 / 2^-9 =
    # 0.512 -> 0.5.
    ([0.001], [P**-10]),
    # amax 3000 -> 3000/6 = 500 -> the scale is capped at 448; 3000/448 = 6.7 -> clamp 6.
    ([3000.0, 448.0], [2688.0, 448.0]),
]
INDEX_CASES = [
    # amax 6.5 -> scale pow2ceil(6.5/6) = 2; 3.25 -> 3; 2.5 -> tie 2|3 -> 2.
    ([6.5, 5.0], [6.0, 4.0]),
    # amax 1 -> pow2ceil(1/6) = 0.25; 4 -> 4; 1.04 -> 1; 0.96 -> 1; -1.2 -> -1; -0.4 -> -0.5.
    ([1.0, 0.26, 0.24, -0.3, -0.1], [1.0, 0.25, 0.25, -0.25, -0.125]),
    # amax 4 -> scale 1; -0.2 rounds to zero and comes out as +0.0.
    ([4.0, -0.2], [4.0, 0.0]),
    # amax below the 6 * 2^-126 floor -> scale 2^-126; 3e-38 / 2^-126 = 2.55 -> 3, 5e-38 -> 4.25
    # -> 4.
    ([3e-38, 5e-38], [3 * P**-126, 4 * P**-126]),
]
QUANTISERS = {
    "window": (WINDOW_CASES, 32, fq.fake_quant_fp8_window, ref.fq8_window),
    "latent": (LATENT_CASES, 16, fq.fake_quant_fp4_latent, ref.fq4_latent),
    "index": (INDEX_CASES, 32, fq.fake_quant_fp4_index, ref.fq4_index),
}


@pytest.mark.parametrize("impl", ["engine", "reference"])
@pytest.mark.parametrize("name", list(QUANTISERS))
def test_hand_checked_cases(name, impl):
    cases, size, engine_fn, ref_fn = QUANTISERS[name]
    fn = engine_fn if impl == "engine" else ref_fn
    for values, expected in cases:
        out = fn(_block(values, size)[None])[0]
        want = _block(expected, size)
        assert torch.equal(out, want), (values, out[: len(values)].tolist(), expected)
        assert not torch.signbit(out[want == 0]).any(), "zeros come out as +0.0"


@pytest.mark.parametrize("name", list(QUANTISERS))
def test_dimensions_not_a_multiple_of_the_block_are_left_alone(name):
    _, size, engine_fn, ref_fn = QUANTISERS[name]
    x = torch.randn(3, size + 8)
    assert torch.equal(engine_fn(x), x) and torch.equal(ref_fn(x), x)


@pytest.mark.parametrize("name", list(QUANTISERS))
def test_engine_equals_the_independent_reference_on_random_blocks(name):
    _, size, engine_fn, ref_fn = QUANTISERS[name]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 4 * size, generator=g)
    # per-row magnitudes from 1e-9 to 1e4, so scales span subnormal to large
    x = x * torch.logspace(-9, 4, 512)[:, None]
    assert torch.equal(engine_fn(x), ref_fn(x))


def test_packed_storage_is_compact_and_lossless():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g) * 3
    w = fq.quantize_fp8_window(x)
    assert w.codes.dtype == torch.float8_e4m3fn and w.exponents.shape == (64, 4)
    assert torch.equal(fq.dequantize_fp8_window(w, torch.float32), fq.fake_quant_fp8_window(x))
    lat = fq.quantize_fp4_latent(x)
    assert lat.packed.shape == (64, 64) and lat.packed.dtype == torch.uint8
    assert lat.scales.shape == (64, 8) and lat.scales.dtype == torch.float8_e4m3fn
    assert torch.equal(fq.dequantize_fp4_latent(lat, torch.float32), ref.fq4_latent(x))
    idx = fq.quantize_fp4_index(x)
    assert idx.packed.shape == (64, 64) and idx.scales.shape == (64, 4)
    assert torch.equal(fq.dequantize_fp4_index(idx, torch.float32), ref.fq4_index(x))
    # bf16 activations: every fake-quantised value is exact in bf16, so storing the packed form
    # and reading it back in bf16 equals the bf16 fake-quant.
    xb = x.bfloat16()
    for quant, dequant, fake in (
        (fq.quantize_fp8_window, fq.dequantize_fp8_window, fq.fake_quant_fp8_window),
        (fq.quantize_fp4_latent, fq.dequantize_fp4_latent, fq.fake_quant_fp4_latent),
        (fq.quantize_fp4_index, fq.dequantize_fp4_index, fq.fake_quant_fp4_index),
    ):
        assert torch.equal(dequant(quant(xb), torch.bfloat16), fake(xb))
        assert torch.equal(fake(xb).float(), dequant(quant(xb.float()), torch.float32))
