"""The FP8 (e4m3) decode of the W8A16 GEMMs compiled for NVIDIA (`E4M3_SCALED_PTX`,
`kernels/linear/dequant.py`): a code's bits placed in a bf16 (the value times 2^-120) times
2^(e - 7) are bit for bit the reference's dequantised weight, for every code but NaN and every
scale byte up to `FP8_MAX_SCALE_BYTE`.

The interpreter cannot run PTX, so on the CPU the PTX text is executed by the emulator of
`test_fp4_nibble_decode.py` (PTX ISA semantics of the four instructions it uses) on every byte
value in every position of a register. On a GPU the tile test of `test_quantized_gemm.py`
compiles the decode and compares its tiles with the reference, and every FP8 GEMM test runs it.
"""

from __future__ import annotations

import re

import torch
from sgl_dspark.kernels.linear.dequant import E4M3_SCALED_PTX
from sgl_dspark.kernels.linear.reference import E8M0_BIAS, FP8_MAX_SCALE_BYTE
from test_fp4_nibble_decode import _run_ptx

# e4m3fn's NaN codes (exponent and mantissa bits all ones): no checkpoint stores them, and the
# decode gives them a finite value (480 times the scale), not NaN.
NAN_CODES = (0x7F, 0xFF)


def _reference_bits(codes: list[int], scale: list[int]) -> list[int]:
    """bf16 bits of e4m3 codes times 2^(scale - 127), each rounded once from the exact product."""
    values = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    values = values * torch.exp2(torch.tensor(scale, dtype=torch.float64) - E8M0_BIAS)
    return (values.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()


def test_e4m3_ptx_decode_text_gives_the_reference_weights_for_every_byte_and_scale() -> None:
    text = E4M3_SCALED_PTX.value
    ops = set(re.findall(r"^\s*([a-z]+\.[\w.]+)\s", text, re.M))
    assert ops == {"shl.b32", "prmt.b32", "and.b32", "mul.rn.bf16x2"}, ops
    g = torch.Generator().manual_seed(0)
    extremes = [1, 2, FP8_MAX_SCALE_BYTE - 1, FP8_MAX_SCALE_BYTE]
    for position in range(4):
        for byte in range(256):
            if byte in NAN_CODES:
                continue
            codes = torch.randint(0, 0x7F, (4,), generator=g).tolist()
            codes = [
                c | (0x80 if s else 0) for c, s in zip(codes, torch.rand(4, generator=g) < 0.5)
            ]
            codes[position] = byte
            scale = torch.randint(1, FP8_MAX_SCALE_BYTE + 1, (4,), generator=g).tolist()
            scale[(position + 1) % 4] = extremes[byte % 4]
            # The multiplier the kernel passes for scale byte e: 2^(e - 7), as bf16 bits.
            multiplier = [(e + 120) << 7 for e in scale]
            out = _run_ptx(
                text,
                {
                    "$2": sum(b << (8 * i) for i, b in enumerate(codes)),
                    "$3": multiplier[0] | (multiplier[1] << 16),
                    "$4": multiplier[2] | (multiplier[3] << 16),
                },
            )
            halves = [(out[r] >> (16 * h)) & 0xFFFF for r in range(2) for h in range(2)]
            assert halves == _reference_bits(codes, scale), (position, byte, scale)


def test_the_bit_decode_limit_keeps_the_multiplier_a_bf16_number() -> None:
    # 2^(e - 7) as bf16 bits (e + 120) << 7: a finite power of two up to the limit, infinity
    # one byte past it (which the loader refuses).
    def multiplier(e: int) -> float:
        return (
            torch.tensor([(e + 120) << 7], dtype=torch.int32)
            .to(torch.int16)
            .view(torch.bfloat16)
            .item()
        )

    assert multiplier(FP8_MAX_SCALE_BYTE) == 2.0**127
    assert multiplier(FP8_MAX_SCALE_BYTE + 1) == float("inf")
    assert multiplier(1) == 2.0**-6
