"""The fused gather + decode of DeepSeek-V4.1's packed cache rows (`quant_load`) bit for bit
against the dequantisers of the reference applied to the indexed rows, and against the pool's
torch read (`QuantizedRows.load`): every format, rows indexed by 1-D and 2-D tensors (int32 and
int64, repeats included), the demo's and V4.1-Flash's widths and block counts that are not a
power of two, fp32/bf16/fp16 output, stored rows from the reference quantiser (values over many
binades, so scale edges and FP8 subnormals appear) and raw random bytes, and outputs poisoned
with NaN so that every element is shown written. The E4M3 decode is also checked on all 256
codes against torch's cast."""

from __future__ import annotations

import zlib

import pytest
import torch
import triton
import triton.language as tl
from sgl_dspark.kernels.quant.load import e4m3_to_fp32, quant_load, quant_load_pair
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


def _load(fmt, data, scales, rows, dtype):
    out = torch.full((*rows.shape, data.shape[1] * (1 if fmt == "fp8_window" else 2)), float("nan"))
    out = out.to(dtype).to(DEVICE)
    got = quant_load(data.to(DEVICE), scales.to(DEVICE), rows.to(DEVICE), fmt, dtype, out=out)
    assert got is out
    return got.cpu()


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
        # Enough rows for several rows a program (`_rows_per_program`), the last tile partial.
        (32, (1000,), 40),
        (512, (3, 701), 50),
    ],
)
def test_quant_load_matches_reference_bit_for_bit(fmt, dtype, d, shape, cache_rows):
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
def test_quant_load_matches_pool_read(fmt, d):
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
    got = quant_load(cache.data, cache.scales, rows, fmt, torch.bfloat16)
    assert _same_bits(got, want)


@pytest.mark.parametrize(("tokens", "first", "second"), [(1, 16, 5), (3, 7, 4), (4, 1, 0)])
def test_quant_load_into_slices_of_wider_key_rows(tokens, first, second):
    """Two caches' rows (the window's FP8 keys, then a source's FP4 latents) written into the
    two column ranges of one [T, first + second, D] tensor: each range a [T, K, D] view whose
    tokens are (first + second) * D apart. Every element is written once, with the bits of the
    contiguous loads."""
    d, width = 64, first + second
    window = _quantised_cache("fp8_window", 30, d, 21)
    latents = _quantised_cache("fp4_latent", 25, d, 22)
    rows_w = _rows((tokens, first), 30, torch.int64, 3)
    rows_l = _rows((tokens, second), 25, torch.int32, 4)
    keys = torch.full((tokens, width, d), float("nan")).to(torch.bfloat16).to(DEVICE)
    w, lat = keys[:, :first], keys[:, first:]
    if tokens > 1 and second > 0:  # both strided (no latents yet: the window's is the whole)
        assert not w.is_contiguous() and not lat.is_contiguous()
    on = lambda t: t.to(DEVICE)
    assert quant_load(*map(on, window), on(rows_w), "fp8_window", torch.bfloat16, out=w) is w
    assert quant_load(*map(on, latents), on(rows_l), "fp4_latent", torch.bfloat16, out=lat) is lat
    got = keys.cpu()
    assert not got.isnan().any()
    want_w = _expected("fp8_window", *window, rows_w, torch.bfloat16)
    want_l = _expected("fp4_latent", *latents, rows_l.long(), torch.bfloat16)
    assert _same_bits(got[:, :first], want_w) and _same_bits(got[:, first:], want_l)
    spaced = torch.empty(tokens, 3, 2 * d, dtype=torch.bfloat16, device=DEVICE)[..., :d]
    three = on(_rows((tokens, 3), 30, torch.int64, 5))
    with pytest.raises(ValueError, match="out"):  # a token's rows not contiguous
        quant_load(*map(on, window), three, "fp8_window", torch.bfloat16, out=spaced)


@pytest.mark.parametrize(("tokens", "first", "second"), [(1, 16, 5), (3, 7, 4), (4, 1, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_load_pair_is_the_two_loads(tokens, first, second, dtype):
    """`quant_load_pair`: the window's FP8 keys and a source's FP4 latents into the two column
    ranges of one keys tensor in one launch, every element with the bits of its own load (the
    reference's), no element left unwritten; a third format (FP4 index keys) too."""
    d, width = 64, first + second
    window = _quantised_cache("fp8_window", 30, d, 31)
    latents = _quantised_cache("fp4_latent", 25, d, 32)
    rows_w = _rows((tokens, first), 30, torch.int64, 6)
    rows_l = _rows((tokens, second), 25, torch.int32, 7)
    keys = torch.full((tokens, width, d), float("nan")).to(dtype).to(DEVICE)
    on = lambda t: t.to(DEVICE)
    quant_load_pair(
        (*map(on, window), on(rows_w), "fp8_window", keys[:, :first]),
        (*map(on, latents), on(rows_l), "fp4_latent", keys[:, first:]),
        dtype,
    )
    got = keys.cpu()
    assert not got.isnan().any()
    assert _same_bits(got[:, :first], _expected("fp8_window", *window, rows_w, dtype))
    assert _same_bits(got[:, first:], _expected("fp4_latent", *latents, rows_l.long(), dtype))
    index = _raw_cache("fp4_index", 9, 128, 33, dtype)
    rows_i = _rows((tokens, 3), 9, torch.int64, 8)
    out_i = torch.full((tokens, 3, 128), float("nan")).to(dtype).to(DEVICE)
    out_w = torch.full((tokens, first, d), float("nan")).to(dtype).to(DEVICE)
    quant_load_pair(
        (*map(on, index), on(rows_i), "fp4_index", out_i),
        (*map(on, window), on(rows_w), "fp8_window", out_w),
        dtype,
    )
    assert _same_bits(out_i.cpu(), _expected("fp4_index", *index, rows_i, dtype))
    assert _same_bits(out_w.cpu(), _expected("fp8_window", *window, rows_w, dtype))
    with pytest.raises(ValueError, match="out"):  # each load's own checks
        quant_load_pair(
            (*map(on, window), on(rows_w), "fp8_window", out_w[:, :0]),
            (*map(on, index), on(rows_i), "fp4_index", out_i),
            dtype,
        )


def test_quant_load_empty_rows_and_default_output():
    data, scales = _quantised_cache("fp4_index", 4, 128, 7)
    data, scales = data.to(DEVICE), scales.to(DEVICE)
    none = torch.zeros(0, 5, dtype=torch.int64, device=DEVICE)
    empty = quant_load(data, scales, none, "fp4_index", torch.float32)
    assert empty.shape == (0, 5, 128) and empty.device == data.device
    rows = torch.tensor([2, 1], device=DEVICE)
    got = quant_load(data, scales, rows, "fp4_index", torch.float32)
    want = _expected("fp4_index", data, scales, rows, torch.float32)
    assert _same_bits(got, want)


def test_quant_load_rejects_bad_input():
    data, scales = _quantised_cache("fp8_window", 4, 64, 3)
    rows = torch.tensor([1])
    with pytest.raises(ValueError, match="fmt"):
        quant_load(data, scales, rows, "fp6", torch.float32)
    with pytest.raises(ValueError, match="scales"):
        quant_load(data, scales[:, :1], rows, "fp8_window", torch.float32)
    with pytest.raises(ValueError, match="rows"):
        quant_load(data, scales, rows.float(), "fp8_window", torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        quant_load(data, scales, rows, "fp8_window", torch.int32)
    with pytest.raises(ValueError, match="out"):
        quant_load(data, scales, rows, "fp8_window", torch.float32, out=torch.empty(1, 32))


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
