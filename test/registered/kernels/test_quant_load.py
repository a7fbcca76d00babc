"""The gather + decode of DeepSeek-V4.1's packed cache rows inside a consumer's loads
(`load_rows_tile`, run here by a kernel that stores the tile it decodes) bit for bit against the
dequantisers of the reference applied to the indexed rows, and against the pool's torch read
(`QuantizedRows.load`): every format and plain rows, int32 and int64 row indices (repeats
included), the demo's and V4.1-Flash's widths and block counts that are not a power of two,
fp32/bf16/fp16 values, stored rows from the reference quantiser (values over many binades, so
scale edges and FP8 subnormals appear) and raw random bytes, masked rows and channels zero and
never read, and outputs poisoned with NaN so that every element is shown written. The E4M3
decode is also checked on all 256 codes against torch's cast."""

from __future__ import annotations

import zlib

import pytest
import torch
import triton
import triton.language as tl
from sgl_dspark.kernels._triton_utils import DTYPE_KIND, interpreted
from sgl_dspark.kernels.quant.load import ROW_FORMATS, e4m3_to_fp32, load_rows_tile
from sgl_dspark.kernels.quant.reference import (
    Fp4Rows,
    Fp8Rows,
    dequantize_fp4_index_ref,
    dequantize_fp4_latent_ref,
    dequantize_fp8_window_ref,
    quantize_fp4_index_ref,
    quantize_fp4_latent_ref,
    quantize_fp8_window_ref,
)
from sgl_dspark.srt.mem_cache.v41_pool import QuantizedRows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ("fp8_window", "fp4_latent", "fp4_index")
BLOCKS = {"fp8_window": 32, "fp4_latent": 16, "fp4_index": 32}
QUANTIZE = {
    "fp8_window": quantize_fp8_window_ref,
    "fp4_latent": quantize_fp4_latent_ref,
    "fp4_index": quantize_fp4_index_ref,
}


def _expected(fmt: str, data: torch.Tensor, scales: torch.Tensor, rows, dtype) -> torch.Tensor:
    """The reference dequantisers on the stored bytes of `rows`."""
    e, s = data[rows], scales[rows]
    if fmt == "fp8_window":
        return dequantize_fp8_window_ref(Fp8Rows(e.view(torch.float8_e4m3fn), s), dtype)
    if fmt == "fp4_latent":
        return dequantize_fp4_latent_ref(Fp4Rows(e, s.view(torch.float8_e4m3fn)), dtype)
    return dequantize_fp4_index_ref(Fp4Rows(e, s), dtype)


def _quantised_cache(
    fmt: str, n: int, d: int, seed: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Per-row and per-channel magnitudes over ~30 binades: tiny blocks hit the scale floors.
    mag = torch.exp2(torch.randint(-24, 8, (n, 1), generator=g).float())
    mag = mag * torch.exp2(torch.randint(-6, 3, (1, d), generator=g).float())
    x = torch.randn(n, d, generator=g) * mag
    x[0, :8] = torch.tensor([0.0, -0.0, 1.0, -6.0, 0.25, -0.75, 2.5, 5.0])
    elements, scales = QUANTIZE[fmt](x)
    return elements.view(torch.uint8).contiguous(), scales.view(torch.uint8).contiguous()


def _raw_cache(
    fmt: str, n: int, d: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes: every E2M1 pair; every E4M3 code but the NaNs (NaN != NaN); exponent
    bytes up to 254 (overflowing products included; 255 would make inf * 0) and E4M3 scales
    that are positive and not NaN. Exponent bytes from 0 (zero and fp32-subnormal products)
    for fp32/fp16 output; from 10 for bf16, whose subnormals the interpreter's bf16 cast
    does not round as the native one does (no quantised row reaches them)."""
    low = 10 if dtype == torch.bfloat16 else 0
    g = torch.Generator().manual_seed(seed)
    width = d if fmt == "fp8_window" else d // 2
    data = torch.randint(0, 256, (n, width), generator=g, dtype=torch.uint8)
    if fmt == "fp8_window":
        nan = (data & 0x7F) == 0x7F
        data[nan] = data[nan] - 1
    if fmt == "fp4_latent":
        scales = torch.randint(1, 0x7F, (n, d // 16), generator=g, dtype=torch.uint8)
    else:
        scales = torch.randint(low, 255, (n, d // 32), generator=g, dtype=torch.uint8)
        scales[:, 0] = torch.randint(low, low + 12, (n,), generator=g, dtype=torch.uint8)
    return data, scales


def _rows(shape: tuple[int, ...], cache_rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    rows = torch.randint(0, cache_rows, shape, generator=g)
    rows.view(-1)[: min(2, rows.numel())] = torch.tensor([cache_rows - 1, 0])[: rows.numel()]
    return rows.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and equal bits (torch.equal takes -0.0 for +0.0)."""
    as_int = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a, b) and torch.equal(a.view(as_int), b.view(as_int))


@triton.jit
def _tile_kernel(
    data_ptr,
    data_stride,
    scales_ptr,
    scales_stride,
    rows_ptr,
    n,
    out_ptr,
    D: tl.constexpr,
    DP: tl.constexpr,
    ROWS: tl.constexpr,
    FMT: tl.constexpr,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    offs = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = offs < n
    rows = tl.load(rows_ptr + offs, mask=row_ok, other=0).to(tl.int64)
    dims = tl.arange(0, DP)
    dim_ok = dims < D
    v = load_rows_tile(
        data_ptr,
        data_stride,
        scales_ptr,
        scales_stride,
        rows,
        row_ok,
        dims,
        dim_ok,
        FMT,
        BLOCK,
        KIND,
        ON_BITS,
    )
    out = out_ptr + offs.to(tl.int64)[:, None] * D + dims[None, :]
    tl.store(out, v, mask=row_ok[:, None] & dim_ok[None, :])


def _load(fmt, data, scales, rows, dtype, rows_a_program=8):
    """`rows` (any shape) of the cache decoded by `load_rows_tile`, `[*rows.shape, D]`."""
    d = data.shape[1] * (1 if fmt in ("fp8_window", "plain") else 2)
    flat = rows.reshape(-1).to(DEVICE)
    out = torch.full((flat.numel(), d), float("nan")).to(dtype).to(DEVICE)
    on = data.to(DEVICE)
    scales = on if scales is None else scales.to(DEVICE)
    _tile_kernel[(triton.cdiv(flat.numel(), rows_a_program),)](
        on,
        on.stride(0),
        scales,
        scales.stride(0) if fmt != "plain" else 0,
        flat,
        flat.numel(),
        out,
        D=d,
        DP=triton.next_power_of_2(d),
        ROWS=rows_a_program,
        FMT=ROW_FORMATS[fmt],
        BLOCK=BLOCKS.get(fmt, 1),
        KIND=DTYPE_KIND[dtype],
        ON_BITS=interpreted(_tile_kernel),
    )
    return out.view(*rows.shape, d).cpu()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("d", "shape", "cache_rows"),
    [
        (32, (1,), 3),  # the demo's widths
        (32, (5, 7), 40),
        (512, (3,), 50),  # V4.1-Flash's window and latent rows
        (512, (2, 9), 17),
        (128, (13,), 64),  # V4.1-Flash's index keys
        (96, (4, 3), 11),  # block counts not a power of two
        (160, (37,), 9),
        # Many programs, the last tile partial.
        (32, (1000,), 40),
        (512, (3, 71), 50),
    ],
)
def test_load_rows_tile_matches_reference_bit_for_bit(fmt, dtype, d, shape, cache_rows):
    seed = zlib.crc32(f"{fmt}{dtype}{d}{shape}".encode()) % 10000
    for make in (_quantised_cache, _raw_cache):
        data, scales = make(fmt, cache_rows, d, seed, dtype)
        for index_dtype in (torch.int64, torch.int32):
            rows = _rows(shape, cache_rows, index_dtype, seed)
            got = _load(fmt, data, scales, rows, dtype)
            want = _expected(fmt, data, scales, rows.long(), dtype)
            assert got.shape == (*shape, d) and got.dtype == dtype
            assert not got.isnan().any()  # the poison is gone everywhere
            assert _same_bits(got, want), (make.__name__, index_dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("d", [32, 512])
def test_load_rows_tile_matches_pool_read(fmt, d):
    """The pool's torch read of rows it stored itself, and the kernel on the same bytes."""
    cache = QuantizedRows(20, d, fmt, torch.bfloat16, DEVICE)
    g = torch.Generator().manual_seed(d)
    cache.store(
        torch.arange(3, 17, device=DEVICE), (torch.randn(14, d, generator=g) * 3.0).to(DEVICE)
    )
    assert cache.scales is not None
    rows = torch.tensor([[16, 3, 3], [9, 12, 5]], device=DEVICE)
    want = cache.load(rows)
    assert want.abs().sum() > 0
    assert _same_bits(_load(fmt, cache.data, cache.scales, rows, torch.bfloat16), want.cpu())


@pytest.mark.parametrize("fmt", [*FORMATS, "plain"])
def test_masked_rows_and_channels_are_zero_and_never_read(fmt):
    """Rows past the cache and channels past D masked: zero values (not the NaN that raw 0x7F
    bytes decode to), nothing read; plain rows load as they are."""
    d, n = 64, 6
    if fmt == "plain":
        data, scales = torch.randn(n, d).to(torch.bfloat16), None
    else:
        data, scales = _quantised_cache(fmt, n, d, 4)
        scales[:] = 0x7F  # NaN as an E4M3 scale, 2^0 as an exponent byte
        data[:] = 0x7F  # NaN as an E4M3 code
    data, on_scales = data.to(DEVICE), None if scales is None else scales.to(DEVICE)
    rows = torch.tensor([2, 5, 10**9, 0, -7], device=DEVICE)
    row_ok = torch.tensor([True, True, False, True, False], device=DEVICE)
    out = torch.full((5, 128), float("nan"), device=DEVICE)
    _masked_kernel[(1,)](
        data,
        data.stride(0),
        data if on_scales is None else on_scales,
        0 if on_scales is None else on_scales.stride(0),
        rows,
        row_ok.view(torch.uint8),
        out,
        D=d,
        FMT=ROW_FORMATS[fmt],
        BLOCK=BLOCKS.get(fmt, 1),
        KIND=DTYPE_KIND[torch.float32],
        ON_BITS=interpreted(_masked_kernel),
    )
    got = out.cpu()
    assert torch.equal(got[~row_ok.cpu()], torch.zeros(2, 128))
    assert torch.equal(got[:, d:], torch.zeros(5, 128 - d))
    read = got[row_ok.cpu(), :d]
    if fmt == "plain":
        assert torch.equal(read, data.cpu()[[2, 5, 0]].float())
    elif fmt == "fp4_index":  # 0x7F: low nibble -6, high nibble 6, exponent byte 2^0
        assert torch.equal(read, torch.tensor([-6.0, 6.0]).repeat(d // 2).expand(3, d))
    else:  # the unmasked rows read their bytes: NaN codes, or NaN scales
        assert read.isnan().all()


@triton.jit
def _masked_kernel(
    data_ptr,
    data_stride,
    scales_ptr,
    scales_stride,
    rows_ptr,
    ok_ptr,
    out_ptr,
    D: tl.constexpr,
    FMT: tl.constexpr,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    offs = tl.arange(0, 8)
    row_ok = tl.load(ok_ptr + offs, mask=offs < 5, other=0) != 0
    rows = tl.load(rows_ptr + offs, mask=row_ok, other=0).to(tl.int64)
    dims = tl.arange(0, 128)
    v = load_rows_tile(
        data_ptr,
        data_stride,
        scales_ptr,
        scales_stride,
        rows,
        row_ok,
        dims,
        dims < D,
        FMT,
        BLOCK,
        KIND,
        ON_BITS,
    )
    tl.store(out_ptr + offs[:, None] * 128 + dims[None, :], v, mask=(offs < 5)[:, None])


@triton.jit
def _decode_kernel(codes_ptr, out_ptr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, e4m3_to_fp32(tl.load(codes_ptr + offs)))


def test_e4m3_decode_matches_torch_on_every_code():
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    got = torch.empty(256, device=DEVICE)
    _decode_kernel[(1,)](codes, got)
    want = codes.view(torch.float8_e4m3fn).float()
    nan = want.isnan()
    assert nan.sum() == 2 and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])  # -0.0 kept
