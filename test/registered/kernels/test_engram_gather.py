"""Engram's embedding gather (`engram_gather`) against its reference, bit for bit: ids read in
place from contiguous, column-sliced and transposed 2-D views, fp32/bf16 tables, row widths that
are not powers of two, an output poisoned before the launch; FP8 tables kept as released (every
E4M3 code but NaN, exponent bytes across the range, scale groups of 32 and 16, a partial last
group) decoded to fp32/bf16/fp16 against dequantising the whole table first; on a GPU, tables in
page-locked host memory; bad arguments name the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sgl_dspark.kernels.engram.gather import engram_gather, engram_gather_hashed
from sgl_dspark.kernels.engram.reference import engram_gather_ref
from sgl_dspark.kernels.linear.reference import QuantizedWeight, dequantize_weight_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(kind: str, t: int, k: int, v: int, g: torch.Generator) -> torch.Tensor:
    if kind == "contiguous":
        return torch.randint(0, v, (t, k), generator=g)
    if kind == "column_slice":  # ids of one n-gram order, inside a wider row
        return torch.randint(0, v, (t, k + 5), generator=g)[:, 2 : 2 + k]
    return torch.randint(0, v, (k, t), generator=g).t()  # transposed: token stride 1


@pytest.mark.parametrize("kind", ["contiguous", "column_slice", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "k", "v", "e"), [(1, 1, 7, 16), (5, 4, 50, 32), (9, 12, 300, 24)])
def test_gather_matches_reference(kind, dtype, t, k, v, e):
    g = torch.Generator().manual_seed(t * 131 + k * 7 + e)
    table = torch.randn(v, e, generator=g).to(dtype)
    ids = _ids(kind, t, k, v, g)
    assert kind == "contiguous" or min(t, k) == 1 or not ids.is_contiguous()
    for index_dtype in (torch.int64, torch.int32):
        want = engram_gather_ref(table, ids)
        out = torch.full((t, k * e), float("nan"), dtype=dtype, device=DEVICE)
        got = engram_gather(table.to(DEVICE), ids.to(index_dtype).to(DEVICE), out=out)
        assert got is out
        assert torch.equal(got.cpu(), want)


def _fp8_table(v: int, e: int, group: int, g: torch.Generator) -> QuantizedWeight:
    """Random E4M3 codes (no NaN code) with exponent bytes spread over 100..150."""
    codes = torch.randint(0, 256, (v, e), generator=g)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
    scale = torch.randint(100, 151, (v, -(-e // group)), generator=g).to(torch.uint8)
    return QuantizedWeight(codes.view(torch.float8_e4m3fn), scale, "fp8", group)


def _on(device: str, w: QuantizedWeight) -> QuantizedWeight:
    return w._replace(data=w.data.to(device), scale=w.scale.to(device))


@pytest.mark.parametrize("kind", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("t", "k", "v", "e", "group"),
    [(1, 1, 9, 32, 32), (4, 6, 70, 64, 32), (7, 24, 500, 256, 32), (3, 5, 40, 48, 16)],
)
def test_fp8_table_rows_decode_as_the_dequantised_table(kind, dtype, t, k, v, e, group):
    g = torch.Generator().manual_seed(t * 977 + k * 31 + e + group)
    table = _fp8_table(v, e, group, g)
    ids = _ids(kind, t, k, v, g)
    # The spec twice: the selected rows dequantised, and rows of the whole table dequantised.
    want = engram_gather_ref(table, ids, dtype)
    assert torch.equal(want, dequantize_weight_ref(table, dtype)[ids].flatten(1))
    out = torch.full((t, k * e), float("nan"), dtype=dtype, device=DEVICE)
    got = engram_gather(_on(DEVICE, table), ids.to(DEVICE), out=out, dtype=dtype)
    assert got is out
    assert torch.equal(got.cpu(), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs a GPU")
@pytest.mark.parametrize("packed", [False, True])
def test_page_locked_host_table_is_read_in_place(packed):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 300, (5, 24), generator=g)
    if packed:
        table = _fp8_table(300, 256, 32, g)
        host = table._replace(data=table.data.pin_memory(), scale=table.scale.pin_memory())
        want = engram_gather_ref(table, ids, torch.bfloat16)
    else:
        table = torch.randn(300, 256, generator=g).to(torch.bfloat16)
        host = table.pin_memory()
        want = engram_gather_ref(table, ids)
    got = engram_gather(host, ids.cuda(), dtype=torch.bfloat16 if packed else None)
    assert got.is_cuda
    assert torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="page-locked"):
        engram_gather(torch.randn(300, 256), ids.cuda())


def test_bad_arguments_name_the_field():
    table = torch.randn(10, 8)
    with pytest.raises(ValueError, match="ids"):
        engram_gather(table, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="out"):
        engram_gather(table, torch.zeros(3, 2, dtype=torch.int64), out=torch.empty(3, 8))
    with pytest.raises(ValueError, match="dtype"):
        engram_gather(table, torch.zeros(3, 2, dtype=torch.int64), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    fp8 = _fp8_table(10, 64, 32, g)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="table"):  # two rows per scale row
        engram_gather(fp8._replace(scale=fp8.scale[:5], block_rows=2), ids)
    with pytest.raises(ValueError, match="table"):  # MXFP4 tables are not a released format
        packed = torch.zeros(10, 32, dtype=torch.uint8)
        engram_gather(QuantizedWeight(packed, fp8.scale, "mxfp4", 32), ids)
    with pytest.raises(ValueError, match="dtype"):
        engram_gather(fp8, ids, dtype=torch.int32)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("t", "n", "heads", "e"), [(1, 3, 8, 32), (5, 2, 3, 16), (3, 4, 5, 64)])
def test_hashed_gather_is_the_hash_then_the_gather(packed, t, n, heads, e):
    """`engram_gather_hashed` hashes the rows from the compressed history in the kernel: the
    layer's `EngramHash` then the reference gather, bit for bit, on histories whose products
    overflow int64 (XOR of wrapped products, negative before the remainder)."""
    from sgl_dspark.srt.layers.engram import EngramHash

    g = torch.Generator().manual_seed(t * 100 + n * 10 + heads)
    primes = torch.randint(50, 400, (n - 1, heads), generator=g)
    offsets = torch.cat((torch.zeros(1, dtype=torch.int64), primes.flatten().cumsum(0)[:-1]))
    constants = SimpleNamespace(  # what EngramHash reads of an Engram config
        multipliers=[torch.randint(1, 1 << 62, (n,), generator=g).tolist()],
        primes=[primes.tolist()],
        offsets=lambda index: offsets.tolist(),
    )
    hashing = EngramHash(constants, 0).to(DEVICE)  # type: ignore[arg-type]
    compressed = torch.randint(0, 1 << 40, (t, n), generator=g)
    compressed[0, 0] = (1 << 62) + 12345  # its product wraps
    compressed = compressed.to(DEVICE)
    v = int(primes.sum())
    dense = torch.randn(v, e, generator=g)
    table = _on(DEVICE, _fp8_table(v, e, 32 if e >= 32 else 16, g)) if packed else dense
    table = table if packed else table.to(DEVICE)
    rows = hashing(compressed)
    assert (rows >= 0).all() and (rows < v).all()
    want = engram_gather_ref(table, rows, torch.float32 if not packed else torch.bfloat16)
    got = engram_gather_hashed(
        table,
        compressed,
        hashing.multipliers,
        hashing.primes,
        hashing.offsets,
        torch.float32 if not packed else torch.bfloat16,
    )
    assert got.shape == (t, (n - 1) * heads * e) and torch.equal(got, want)
    with pytest.raises(ValueError, match="primes"):
        engram_gather_hashed(
            table, compressed, hashing.multipliers, hashing.primes.flatten(), hashing.offsets
        )
