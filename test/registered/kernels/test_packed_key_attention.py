"""Sink attention over keys decoded from packed caches in the attention's own loads
(`packed_key_attention`): bit for bit `window_sparse_attention` over the same keys gathered and
decoded first (the reference dequantisers: the gathered path's keys), where the first source's key count is a multiple of the key tile
(DeepSeek-V4.1's window: 128 keys, tiles of 16 at Dh 512), single pass and split; within the
reference's tolerance (`sink_attention_ref` over the reference dequantisers' keys) everywhere
else: key counts that straddle a tile, one source, plain rows, every packed format, fp32 /
bf16 / fp16, the inverse rope in the epilogue. Invalid keys whose bytes decode to NaN change
nothing; outputs are poisoned with NaN so that every element is shown written."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.attention.packed_keys import KeySource, packed_key_attention
from sgl_dspark.kernels.attention.reference import sink_attention_ref
from sgl_dspark.kernels.attention.splits import tile_shape
from sgl_dspark.kernels.attention.window_sparse import window_sparse_attention
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
from sgl_dspark.kernels.rope.reference import rope_tail_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANTIZE = {
    "fp8_window": quantize_fp8_window_ref,
    "fp4_latent": quantize_fp4_latent_ref,
    "fp4_index": quantize_fp4_index_ref,
}


def _cache(fmt: str, rows: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """(data, scales) of `rows` random rows quantised by the reference (plain: the rows)."""
    x = torch.randn(rows, d, generator=gen) * torch.exp2(
        torch.randint(-3, 3, (rows, 1), generator=gen)
    )
    if fmt == "plain":
        return x.to(dtype).to(DEVICE), None
    elements, scales = QUANTIZE[fmt](x)
    return elements.view(torch.uint8).to(DEVICE), scales.view(torch.uint8).to(DEVICE)


def _decoded(src: KeySource, dtype: torch.dtype) -> torch.Tensor:
    """The reference dequantisers on the source's rows `[T, N, Dh]`."""
    rows = src.rows.long().cpu()
    e = src.data.cpu()[rows]
    if src.fmt == "plain":
        return e
    s = src.scales.cpu()[rows]
    if src.fmt == "fp8_window":
        return dequantize_fp8_window_ref(Fp8Rows(e.view(torch.float8_e4m3fn), s), dtype)
    if src.fmt == "fp4_latent":
        return dequantize_fp4_latent_ref(Fp4Rows(e, s.view(torch.float8_e4m3fn)), dtype)
    return dequantize_fp4_index_ref(Fp4Rows(e, s), dtype)


def _source(fmt, tokens, n, cache_rows, d, dtype, gen, index_dtype=torch.int64) -> KeySource:
    data, scales = _cache(fmt, cache_rows, d, dtype, gen)
    rows = torch.randint(0, cache_rows, (tokens, n), generator=gen)
    valid = torch.rand(tokens, n, generator=gen) < 0.8
    if n:
        valid[0, 0] = True
        valid[-1, -1] = False
    return KeySource(data, scales, fmt, rows.to(index_dtype).to(DEVICE), valid.to(DEVICE))


def _attend(q, sources, sinks, scale, **kw):
    out = torch.full_like(q, float("nan"))
    got = packed_key_attention(q, sources, sinks, scale, out=out, **kw)
    assert got is out and not got.isnan().any()
    return got.cpu()


def _reference(q, sources, sinks, scale, dtype):
    """`sink_attention_ref` in float64 over the reference dequantisers' keys (the values of
    q's dtype the kernel decodes), so the tolerance measures the kernel's own rounding."""
    keys = torch.cat([_decoded(s, dtype) for s in sources], dim=1).double()
    valid = torch.cat([s.valid.cpu() for s in sources], dim=1)
    return sink_attention_ref(q.cpu().double(), keys, valid, sinks.cpu().double(), scale)


def _inputs(tokens, heads, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(tokens, heads, d, generator=gen) * 2).to(dtype).to(DEVICE)
    sinks = (torch.randn(heads, generator=gen) * 3).to(DEVICE)
    return q, sinks, gen


@pytest.mark.parametrize(
    ("tokens", "heads", "d", "n_window", "n_latent", "splits"),
    [
        (2, 4, 64, 64, 37, 1),  # a tile of 64 keys at Dh 64
        (3, 16, 64, 128, 100, 3),
        (1, 5, 128, 64, 0, 2),  # a source with no keys this step
        (1, 16, 512, 32, 40, 4),  # V4.1-Flash's head width: tiles of 16 keys
        (2, 2, 512, 16, 9, 1),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_bits_as_the_gathered_keys(tokens, heads, d, n_window, n_latent, splits, dtype):
    """Window FP8 keys then FP4 latents: the bits of `window_sparse_attention` over the same
    keys decoded into one tensor first (what the engine ran before the decode moved into the
    attention's loads)."""
    q, sinks, gen = _inputs(tokens, heads, d, dtype, 11 + d + n_window)
    window = _source("fp8_window", tokens, n_window, 40, d, dtype, gen)
    latents = _source("fp4_latent", tokens, n_latent, 30, d, dtype, gen, torch.int32)
    assert n_window % tile_shape(heads, d).block_n == 0
    keys = torch.cat([_decoded(s, dtype) for s in (window, latents)], dim=1).to(DEVICE)
    valid = torch.cat((window.valid, latents.valid), dim=1)
    rows = torch.arange(keys.shape[0] * keys.shape[1], device=DEVICE).view(keys.shape[:2])
    zeros = torch.zeros(tokens, dtype=torch.int64, device=DEVICE)
    pool = keys.reshape(-1, d)
    scale = d**-0.5
    for inverse_rope in (None, _rope_tables(tokens, 16, gen)):
        want = window_sparse_attention(
            q,
            pool,
            zeros,
            zeros,
            zeros.view(-1, 1)[:1],
            0,
            sinks,
            scale,
            pool,
            valid,
            extra_slots=rows,
            inverse_rope=inverse_rope,
            num_splits=splits,
        )
        got = _attend(
            q, [window, latents], sinks, scale, num_splits=splits, inverse_rope=inverse_rope
        )
        assert _same_bits(got, want.cpu())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and equal bits (torch.equal takes -0.0 for +0.0)."""
    as_int = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a, b) and torch.equal(a.view(as_int), b.view(as_int))


def _rope_tables(tokens: int, rope_dim: int, gen: torch.Generator):
    angle = torch.rand(tokens, rope_dim // 2, generator=gen) * 6.0
    return angle.cos().to(DEVICE), angle.sin().to(DEVICE)


@pytest.mark.parametrize(
    ("fmts", "counts", "d"),
    [
        (("fp8_window", "fp4_latent"), (5, 70), 64),  # a tile across the two sources
        (("fp8_window", "fp4_latent"), (128, 512), 512),  # V4.1-Flash's key counts
        (("fp8_window",), (23,), 96),  # one source (a window-only layer); Dh not a power of 2
        (("fp4_index", "plain"), (17, 6), 128),
        (("plain", "fp8_window"), (3, 40), 32),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_matches_the_reference(fmts, counts, d, dtype, splits):
    tokens, heads = 3, 6
    q, sinks, gen = _inputs(tokens, heads, d, dtype, 100 + d + counts[0])
    sources = [_source(f, tokens, n, 50, d, dtype, gen) for f, n in zip(fmts, counts)]
    scale = d**-0.5
    got = _attend(q, sources, sinks, scale, num_splits=splits)
    want = _reference(q, sources, sinks, scale, dtype)
    # fp32: the online softmax's reordered sums; 16-bit: the probabilities and the output
    # rounded to q's dtype (as `window_sparse_attention` against its exact reference).
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    cos, sin = _rope_tables(tokens, 16, gen)
    rotated = _attend(q, sources, sinks, scale, num_splits=splits, inverse_rope=(cos, sin))
    # the epilogue rotates the kernel's own rounded output (`rope_tail`'s bits)
    assert torch.equal(rotated, rope_tail_ref(got, cos.cpu(), sin.cpu(), inverse=True))


def test_invalid_keys_are_never_read():
    """Invalid keys pointed at a row whose bytes decode to NaN, or past the cache: the same
    bits as with them pointed at ordinary rows (a masked key is a zero key, as the gathered
    path loads it, and its logit is -inf)."""
    tokens, heads, d, dtype = 2, 4, 64, torch.float32
    q, sinks, gen = _inputs(tokens, heads, d, dtype, 5)
    window = _source("fp8_window", tokens, 20, 10, d, dtype, gen)
    latents = _source("fp4_latent", tokens, 12, 10, d, dtype, gen)
    want = _attend(q, [window, latents], sinks, 0.1)
    exact = _reference(q, [window, latents], sinks, 0.1, dtype)
    torch.testing.assert_close(want.double(), exact, rtol=1e-5, atol=1e-5)
    window.data[9] = 0x7F  # E4M3 NaN codes
    latents.scales[9] = 0x7F  # E4M3 NaN scales
    for bad_row in (9, 10**9):
        moved = [
            s._replace(rows=torch.where(s.valid, s.rows.clamp(max=8), bad_row).to(s.rows.dtype))
            for s in (window, latents)
        ]
        clamped = [s._replace(rows=s.rows.clamp(max=8)) for s in (window, latents)]
        assert _same_bits(_attend(q, moved, sinks, 0.1), _attend(q, clamped, sinks, 0.1))


def test_a_token_alone_has_its_bits_in_the_batch():
    """One pass (`num_splits=1`, the batch-invariant mode): a token's output never depends on
    the batch it is in."""
    tokens, heads, d, dtype = 4, 8, 64, torch.bfloat16
    q, sinks, gen = _inputs(tokens, heads, d, dtype, 9)
    sources = [
        _source("fp8_window", tokens, 64, 30, d, dtype, gen),
        _source("fp4_latent", tokens, 33, 30, d, dtype, gen),
    ]
    full = _attend(q, sources, sinks, 0.2, num_splits=1)
    for t in range(tokens):
        alone = [s._replace(rows=s.rows[t : t + 1], valid=s.valid[t : t + 1]) for s in sources]
        assert torch.equal(_attend(q[t : t + 1], alone, sinks, 0.2, num_splits=1), full[t : t + 1])


def test_empty_batch_and_bad_input_named():
    q, sinks, gen = _inputs(2, 4, 64, torch.float32, 3)
    src = _source("fp8_window", 2, 8, 10, 64, torch.float32, gen)
    empty = packed_key_attention(
        q[:0], [src._replace(rows=src.rows[:0], valid=src.valid[:0])], sinks, 1.0
    )
    assert empty.shape == (0, 4, 64)
    bad = {
        "sources": dict(sources=[]),
        "sources\\[0\\].rows": dict(sources=[src._replace(rows=src.rows.float())]),
        "sources\\[0\\].valid": dict(sources=[src._replace(valid=src.valid[:, :3])]),
        "sources\\[0\\].fmt": dict(sources=[src._replace(fmt="fp6")]),
        "sources\\[0\\].scales": dict(sources=[src._replace(scales=src.scales[:, :1])]),
        "sources\\[0\\].data": dict(sources=[src._replace(data=src.data[:, :32])]),
        "sinks": dict(sinks=sinks[:3]),
        "num_splits": dict(num_splits=0),
    }
    for needle, kw in bad.items():
        args = dict(sources=[src], sinks=sinks, num_splits=None) | kw
        with pytest.raises(ValueError, match=needle):
            packed_key_attention(
                q, args["sources"], args["sinks"], 1.0, num_splits=args["num_splits"]
            )
