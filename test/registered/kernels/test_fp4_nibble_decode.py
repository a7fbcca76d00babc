"""The MXFP4 decode of the W4A16 GEMMs (`kernels/linear/dequant.py`): a K step's stored bytes
become its even channels (low nibbles) and its odd channels (high nibbles), each times its
group's scale, bit for bit the reference's dequantised weight.

Two decoders give those bits: the portable one (shifts, masks and multiplies per element; the
CPU interpreter, AMD) and, compiled for NVIDIA, inline PTX (`E2M1_SCALED_PTX`). The interpreter
cannot run PTX, so on the CPU the PTX text itself is executed by a small emulator of the four
instructions it uses (PTX ISA semantics of `shl.b32`, `and.b32`, `prmt.b32` in its default mode
and `mul.rn.bf16x2`) on every byte value in every position of a register, with every scale byte
the decode accepts, against the reference's dequantised values. On a GPU both decoders run in a
kernel and must match the reference.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl
from sgl_dspark.kernels.linear.dequant import (
    E2M1_SCALED_PTX,
    fp4_half_tiles,
    quantized_scales,
)
from sgl_dspark.kernels.linear.reference import (
    MXFP4_MAX_SCALE_BYTE,
    QuantizedWeight,
    dequantize_weight_ref,
    e2m1_values_ref,
    e8m0_to_float_ref,
)
from sgl_dspark.kernels.linear.weight_loads import fp4_rows_aligned

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MASK32 = 0xFFFFFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """`prmt.b32 d, a, b, selector` (default mode): result byte i is byte (s & 7) of the eight
    bytes {b, a} (a's bytes 0..3, then b's), or that byte's sign replicated when s & 8 (s: the
    selector's nibble i)."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = pool[s & 7]
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _mul_bf16x2(a: int, b: int) -> int:
    """`mul.rn.bf16x2`: each 16-bit half's bf16 product, rounded to nearest even."""
    halves = torch.tensor([[a & 0xFFFF, a >> 16], [b & 0xFFFF, b >> 16]], dtype=torch.int32)
    x, y = halves.to(torch.int16).view(torch.bfloat16).float()
    bits = (x * y).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(bits[0]) | (int(bits[1]) << 16)


def _run_ptx(text: str, inputs: dict[str, int]) -> list[int]:
    """Execute the decode's PTX on its input registers ($4, $5, $6): its outputs $0..$3."""
    regs = dict(inputs)

    def value(operand: str) -> int:
        operand = operand.strip()
        if operand in regs:
            return regs[operand]
        return int(operand, 0) & MASK32

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [x.strip() for x in rest.split(",")]
        if op == "shl.b32":
            regs[dst] = (value(src[0]) << value(src[1])) & MASK32
        elif op == "and.b32":
            regs[dst] = value(src[0]) & value(src[1])
        elif op == "prmt.b32":
            regs[dst] = _prmt(value(src[0]), value(src[1]), value(src[2]))
        elif op == "mul.rn.bf16x2":
            regs[dst] = _mul_bf16x2(value(src[0]), value(src[1]))
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
    return [regs[f"${i}"] for i in range(4)]


def _reference_bits(packed: list[int], scale: list[int]) -> tuple[list[int], list[int]]:
    """bf16 bits of the dequantised low-nibble and high-nibble values of code bytes, byte i
    scaled by E8M0 byte scale[i]."""
    values = e2m1_values_ref(torch.tensor(packed, dtype=torch.uint8))
    values = values * e8m0_to_float_ref(torch.tensor(scale, dtype=torch.uint8)).repeat_interleave(2)
    bits = (values.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    return bits[0::2], bits[1::2]


def test_ptx_decode_text_gives_the_reference_weights_for_every_byte_and_scale() -> None:
    text = E2M1_SCALED_PTX.value
    ops = set(re.findall(r"^\s*([a-z]+\.[\w.]+)\s", text, re.M))
    assert ops == {"shl.b32", "prmt.b32", "and.b32", "mul.rn.bf16x2"}, ops
    g = torch.Generator().manual_seed(0)
    for position in range(4):
        for byte in range(256):
            codes = torch.randint(0, 256, (4,), generator=g).tolist()
            codes[position] = byte
            # The multiplier the kernel passes for scale byte e: 2^(e - 1), as bf16 bits.
            scale = torch.randint(1, MXFP4_MAX_SCALE_BYTE + 1, (4,), generator=g).tolist()
            multiplier = [(e + 126) << 7 for e in scale]
            out = _run_ptx(
                text,
                {
                    "$4": sum(b << (8 * i) for i, b in enumerate(codes)),
                    "$5": multiplier[0] | (multiplier[1] << 16),
                    "$6": multiplier[2] | (multiplier[3] << 16),
                },
            )
            halves = [(out[r] >> (16 * h)) & 0xFFFF for r in range(4) for h in range(2)]
            want_lo, want_hi = _reference_bits(codes, scale)
            assert halves[:4] == want_lo, (position, byte, scale)  # $0, $1: low nibbles
            assert halves[4:] == want_hi, (position, byte, scale)  # $2, $3: high nibbles


@triton.jit
def _half_tiles_kernel(
    w_ptr,
    s_ptr,
    even_ptr,
    odd_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_on,
    GROUP: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDE: tl.constexpr,
    PTX: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # Program (column block, K step): the GEMMs' even and odd half tiles, stored as they are.
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    k0 = tl.program_id(1) * BLOCK_K
    w_rows = w_ptr + n.to(tl.int64) * stride_wn
    e = quantized_scales(s_ptr + n.to(tl.int64) * stride_sn, n_ok, k0, K, GROUP, BLOCK_K)
    even, odd = fp4_half_tiles(w_rows, n_ok, e, k0, K, BN, BLOCK_K, GROUP, WIDE, PTX, ALIGNED)
    j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    out = n.to(tl.int64)[:, None] * stride_on + j[None, :]
    ok = n_ok[:, None] & (j < K // 2)[None, :]
    tl.store(even_ptr + out, even, mask=ok)
    tl.store(odd_ptr + out, odd, mask=ok)


# (scale group, N, K, BN, BLOCK_K): groups per step > 1, = 1 and < 1, partial groups and steps,
# rows of whole 16-byte units (K a multiple of 32) and not, a scale per channel pair.
HALF_TILE_CASES = [
    (32, 24, 256, 16, 256),
    (32, 17, 100, 16, 64),
    (32, 9, 48, 16, 32),
    (64, 20, 192, 16, 32),
    (32, 16, 74, 32, 64),
    (2, 16, 96, 16, 64),
]


@pytest.mark.parametrize("case", HALF_TILE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_half_tiles_are_the_reference_even_and_odd_channels(case: tuple) -> None:
    """Every code, scale bytes up to the decode's limit (128): the half tiles equal the
    reference's dequantised weight's even and odd channels bit for bit; fp32 tiles everywhere,
    bf16 tiles (portable and PTX decode) compiled on a GPU."""
    group, n, k, bn, block_k = case
    g = torch.Generator().manual_seed(HALF_TILE_CASES.index(case))
    data = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(100, 129, (n, -(-k // group)), generator=g).to(torch.uint8)
    w = QuantizedWeight(data.to(DEVICE), scale.to(DEVICE), "mxfp4", group, 1)
    variants = [(True, False)]
    if DEVICE == "cuda":
        variants += [(False, False), (False, True)]
    for wide, ptx in variants:
        dtype = torch.float32 if wide else torch.bfloat16
        want = dequantize_weight_ref(w, dtype)
        half = k // 2
        even = torch.full((n, half), float("nan"), dtype=dtype, device=DEVICE)
        odd = torch.full((n, half), float("nan"), dtype=dtype, device=DEVICE)
        _half_tiles_kernel[(triton.cdiv(n, bn), triton.cdiv(k, block_k))](
            w.data,
            w.scale,
            even,
            odd,
            n,
            k,
            w.data.stride(0),
            w.scale.stride(0),
            even.stride(0),
            GROUP=group,
            BN=bn,
            BLOCK_K=block_k,
            WIDE=wide,
            PTX=ptx,
            ALIGNED=fp4_rows_aligned(w),
        )
        bits = torch.int32 if wide else torch.int16
        assert torch.equal(even.view(bits), want[:, 0::2].view(bits)), (wide, ptx)
        assert torch.equal(odd.view(bits), want[:, 1::2].view(bits)), (wide, ptx)
