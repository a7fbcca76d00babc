"""The fused rotate + quantise + store of DeepSeek-V4.1's cache rows (`quant_store`) against its
reference (`quant_store_ref`), bit for bit: every format, rope or none, fp32/bf16/fp16 rows,
strided inputs, widths whose block count is not a power of two, values spread over many binades
(scale edges, FP8 subnormals, E2M1 ties) and rows left poisoned where nothing is written. The
reference's own values are checked by hand in `models/test_v41_fake_quant.py`; here the E4M3
rounding of the kernel is also checked against torch's cast on every code boundary. The
quantisers' values after a rotation (`fake_quant_rows`: V4.1's index queries) equal the
reference's rope then fake quantisation, bit for bit, on [N, D] and [N, H, D] rows and on a
column slice of a fused output."""

from __future__ import annotations

import zlib

import pytest
import torch
import triton
import triton.language as tl
from sgl_dspark.kernels.quant.reference import (
    fake_quant_fp4_index_ref,
    fake_quant_fp8_window_ref,
    quant_store_ref,
)
from sgl_dspark.kernels.quant.store import e4m3_round, fake_quant_rows, quant_store
from sgl_dspark.kernels.rope.reference import rope_tail_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = 0xAB
FORMATS = ("fp8_window", "fp4_latent", "fp4_index")


def _widths(fmt: str, d: int) -> tuple[int, int]:
    block = {"fp8_window": 32, "fp4_latent": 16, "fp4_index": 32}[fmt]
    return (d if fmt == "fp8_window" else d // 2), d // block


def _inputs(n: int, d: int, dtype: torch.dtype, seed: int, rope_dim: int):
    g = torch.Generator().manual_seed(seed)
    # Per-row and per-channel magnitudes over ~30 binades: tiny blocks hit the scale floors.
    mag = torch.exp2(torch.randint(-24, 8, (n, 1), generator=g).float())
    mag = mag * torch.exp2(torch.randint(-6, 3, (1, d), generator=g).float())
    x = torch.randn(n, d, generator=g) * mag
    x[0, : min(d, 8)] = torch.tensor([0.0, -0.0, 1.0, -6.0, 0.25, -0.75, 2.5, 5.0])[: min(d, 8)]
    x = x.to(dtype)
    cos = sin = None
    if rope_dim:
        angles = torch.rand(n, rope_dim // 2, generator=g, dtype=torch.float64) * 100
        cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    return x, cos, sin


def _run(fn, x, rows, fmt, cos, sin, cache_rows):
    width, n_scales = _widths(fmt, x.shape[1])
    data = torch.full((cache_rows, width), POISON, dtype=torch.uint8, device=x.device)
    scales = torch.full((cache_rows, n_scales), POISON, dtype=torch.uint8, device=x.device)
    fn(x, rows, data, scales, fmt, cos, sin)
    return data.cpu(), scales.cpu()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("n", "d", "rope_dim"),
    [(1, 32, 0), (5, 64, 16), (7, 96, 32), (3, 128, 64), (4, 160, 0), (2, 512, 64)],
)
def test_quant_store_matches_reference_bit_for_bit(fmt, dtype, n, d, rope_dim):
    seed = zlib.crc32(f"{fmt}{dtype}{n}{d}{rope_dim}".encode()) % 10000
    x, cos, sin = _inputs(n, d, dtype, seed, rope_dim)
    rows = torch.randperm(3 * n + 2, generator=torch.Generator().manual_seed(seed))[:n]
    dev = [t.to(DEVICE) if t is not None else None for t in (x, rows, cos, sin)]
    got = _run(quant_store, dev[0], dev[1], fmt, dev[2], dev[3], 3 * n + 2)
    want = _run(quant_store_ref, x, rows, fmt, cos, sin, 3 * n + 2)
    assert torch.equal(got[0], want[0]), "elements"
    assert torch.equal(got[1], want[1]), "scales"
    untouched = torch.ones(3 * n + 2, dtype=torch.bool)
    untouched[rows] = False
    assert (got[0][untouched] == POISON).all() and (got[1][untouched] == POISON).all()


def test_strided_rows_and_cache_rows():
    """x a column slice of a wider projection output (row stride > D)."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 200, generator=g).to(torch.bfloat16)
    x = wide[:, 40:104]
    rows = torch.tensor([9, 0, 4, 7, 2, 11])
    angles = torch.rand(6, 8, generator=g)
    cos, sin = torch.cos(angles), torch.sin(angles)
    for fmt in FORMATS:
        got = _run(
            quant_store,
            x.to(DEVICE),
            rows.to(DEVICE),
            fmt,
            cos.to(DEVICE),
            sin.to(DEVICE),
            12,
        )
        want = _run(quant_store_ref, x.contiguous(), rows, fmt, cos, sin, 12)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), fmt


@triton.jit
def _e4m3_kernel(x_ptr, code_ptr, value_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    code, value = e4m3_round(tl.load(x_ptr + offs, mask=m, other=0.0))
    tl.store(code_ptr + offs, code, mask=m)
    tl.store(value_ptr + offs, value, mask=m)


def test_e4m3_rounding_equals_torch_cast_on_every_boundary():
    """Every E4M3 code value, the midpoints between neighbours (ties) and one fp32 ulp either
    side of them, against torch's round-to-nearest-even cast."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # 0 .. 448 (0x7F is NaN)
    values = codes.view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    around = torch.cat([mids.nextafter(torch.zeros_like(mids)), mids.nextafter(mids + 1)])
    x = torch.cat([values, mids, around]).clamp(max=448.0)
    n = x.numel()
    code = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    value = torch.full((n,), float("nan"), device=DEVICE)
    _e4m3_kernel[(triton.cdiv(n, 128),)](x.to(DEVICE), code, value, n, BLOCK=128)
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(code.cpu(), want.view(torch.uint8).to(torch.int32))
    assert torch.equal(value.cpu(), want.float())


def test_bad_arguments_name_the_field():
    x = torch.randn(2, 48)
    rows = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="block"):
        quant_store(x, rows, torch.zeros(2, 48, dtype=torch.uint8), torch.zeros(2, 1), "fp8_window")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="scales"):
        quant_store(x, rows, torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 4), "fp4_latent")
    with pytest.raises(ValueError, match="fmt"):
        quant_store(x, rows, torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 2), "fp6")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "d", "rope_dim"), [(1, 32, 0), (6, 96, 32), (3, 512, 64)])
def test_quant_store_values_matches_reference(x_dtype, out_dtype, n, d, rope_dim):
    """The draft's window rows: the FP8 quantiser's values in a float cache, bit for bit
    (-0.0 included), rows not written left poisoned."""
    from sgl_dspark.kernels.quant.reference import quant_store_values_ref
    from sgl_dspark.kernels.quant.store import quant_store_values

    seed = zlib.crc32(f"values{x_dtype}{out_dtype}{n}{d}{rope_dim}".encode()) % 10000
    x, cos, sin = _inputs(n, d, x_dtype, seed, rope_dim)
    if out_dtype == torch.float16:
        x = (x.float() / 1e3).to(x_dtype)  # stay inside fp16's exponent range
    rows = torch.randperm(2 * n + 1, generator=torch.Generator().manual_seed(seed))[:n]
    want = torch.full((2 * n + 1, d), float("nan"), dtype=out_dtype)
    quant_store_values_ref(x, rows, want, cos, sin)
    got = torch.full((2 * n + 1, d), float("nan"), dtype=out_dtype, device=DEVICE)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, rows, cos, sin)]
    quant_store_values(dev[0], dev[1], got, dev[2], dev[3])
    bits = torch.int32 if out_dtype == torch.float32 else torch.int16
    assert torch.equal(got.cpu().view(bits), want.view(bits))


def test_draft_rope_stores_with_the_window_quantiser_equal_torch():
    """The rope family's stores with `quant="fp8_window"` (the DSpark draft of a V4.1 target):
    the Triton binding (one fused launch for the KV rows) gives the torch binding's bits, into
    the pool and as returned rows, next to the query heads' rope."""
    from sgl_dspark.srt.core.kernel_choice import KernelChoice
    from sgl_dspark.srt.layers.rotary import rope_q_kv_impl, rope_store_impl

    g = torch.Generator().manual_seed(11)
    kv = (torch.randn(5, 64, generator=g) * 3).to(torch.bfloat16)
    q = torch.randn(5, 4, 64, generator=g).to(torch.bfloat16)
    angles = torch.rand(5, 8, generator=g) * 50
    cos, sin = torch.cos(angles), torch.sin(angles)
    slots = torch.tensor([7, 2, 11, 0, 5])
    outs = {}
    for backend in ("torch", "triton"):
        kernels = KernelChoice(backend)
        dev = [t.to(DEVICE) for t in (q, kv, cos, sin, slots)]
        pool = torch.full((12, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        rope_store_impl(kernels)(dev[1], dev[2], dev[3], pool, dev[4], quant="fp8_window")
        q_out, rows = rope_q_kv_impl(kernels)(dev[0], dev[1], dev[2], dev[3], kv_quant="fp8_window")
        outs[backend] = [t.cpu().view(torch.int16) for t in (pool, q_out, rows)]
    for got, want in zip(outs["triton"], outs["torch"]):
        assert torch.equal(got, want)


FAKE_REFS = {"fp8_window": fake_quant_fp8_window_ref, "fp4_index": fake_quant_fp4_index_ref}


@pytest.mark.parametrize("fmt", ["fp8_window", "fp4_index"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("n", "heads", "d", "rope_dim"),
    [(1, 1, 32, 0), (3, 4, 64, 16), (5, 2, 96, 32), (2, 8, 128, 64), (4, 0, 160, 0)],
)
def test_fake_quant_rows_matches_rope_then_fake_quant(fmt, dtype, n, heads, d, rope_dim):
    """[N, H, D] rows (heads 0: [N, D]) rotated with their token's cos / sin, then the
    quantiser's values, against the reference's two steps."""
    seed = zlib.crc32(f"fake{fmt}{dtype}{n}{heads}{d}{rope_dim}".encode()) % 10000
    x, cos, sin = _inputs(n * max(heads, 1), d, dtype, seed, 0)
    x = x.view(n, heads, d) if heads else x
    if rope_dim:
        _, cos, sin = _inputs(n, 2, torch.float32, seed + 1, rope_dim)
    rotated = rope_tail_ref(x, cos, sin) if rope_dim else x
    want = FAKE_REFS[fmt](rotated)
    on = lambda t: None if t is None else t.to(DEVICE)
    got = fake_quant_rows(x.to(DEVICE), fmt, on(cos), on(sin))
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(
        got.cpu().view(torch.uint8 if dtype != torch.float32 else torch.int32),
        want.view(torch.uint8 if dtype != torch.float32 else torch.int32),
    )


def test_fake_quant_rows_reads_a_column_slice_of_a_fused_output():
    """The index queries are a column slice of the joint q_b projection's output: token
    stride wider than the heads, read in place."""
    g = torch.Generator().manual_seed(5)
    n, heads, d = 3, 4, 64
    fused = (torch.randn(n, 40 + heads * d, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    x = fused[:, 40:].view(n, heads, d)
    assert not x.is_contiguous()
    angles = torch.rand(n, 8, generator=g, dtype=torch.float64) * 50
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    want = fake_quant_fp4_index_ref(rope_tail_ref(x.cpu(), cos, sin))
    got = fake_quant_rows(x, "fp4_index", cos.to(DEVICE), sin.to(DEVICE))
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_fake_quant_rows_leaves_rows_it_cannot_block_rotated_only():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2, 48, generator=g).to(torch.bfloat16)  # 48: not a multiple of 32
    angles = torch.rand(3, 8, generator=g, dtype=torch.float64)
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    got = fake_quant_rows(x.to(DEVICE), "fp4_index", cos.to(DEVICE), sin.to(DEVICE))
    assert torch.equal(got.cpu(), fake_quant_fp4_index_ref(rope_tail_ref(x, cos, sin)))
    with pytest.raises(ValueError, match="fmt"):
        fake_quant_rows(x, "fp4_latent")
