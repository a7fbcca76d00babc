"""GEMMs on weights kept as stored (FP8 block-scaled, MXFP4) against dequantise-then-reference:
the in-kernel dequantised tile itself (`kernels/linear/dequant.py`), the small-M linear and
grouped linear (`kernels/linear/quantized.py`), the MoE grouped GEMMs (stage 1 with the
activation, stage 2, sorted in 16- and 32-row blocks), the per-token MoE kernels and the
shared-expert fold.

The dequantised tile in channel order (`quantized_tile`: the FP8 GEMMs' and the one-pass
dequantisation's) must be the reference's dequantised weight bit for bit (every code, every scale
in range, partial scale groups and K steps, both MXFP4 read paths); the MXFP4 GEMMs' even and odd
half tiles are checked the same way in `test_fp4_nibble_decode.py`. The GEMMs use weights
quantised from random floats by the checkpoint quantisers and converted to the runtime layout as
the loader does; the references get the same weights dequantised (exact), so the only difference
is the fp32 summation order: a tolerance (GEMM_TOL / CHAIN_TOL, as the unquantised kernels).
Shapes cover partial scale blocks (N and K not multiples of the block), K not a multiple of the
kernel's K step or of 32 (MXFP4 rows read byte by byte), rows padded to the 16-row tile (M from
1 to 16) and partial column tiles. Outputs are poisoned with NaN first. A row's bits do not
depend on M; on a GPU the per-token and sorted MoE paths give the same bits (their products are
the same K-step sums).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from sgl_dspark.kernels.linear.dequant import (
    quantized_scales,
    quantized_tile,
)
from sgl_dspark.kernels.linear.quantized import quantized_grouped_linear, quantized_linear
from sgl_dspark.kernels.linear.reference import (
    QuantizedWeight,
    dequantize_weight_ref,
    small_m_grouped_linear_ref,
    small_m_linear_ref,
)
from sgl_dspark.kernels.linear.weight_loads import (
    scale_alignment,
    scales_loaded_ahead,
    stored_rows,
)
from sgl_dspark.kernels.moe.expert_weights import EXPERT_WARPS, expert_split_k
from sgl_dspark.kernels.moe.grouped_gemm import fused_moe
from sgl_dspark.kernels.moe.reduce import moe_reduce
from sgl_dspark.kernels.moe.reference import (
    fused_moe_ref,
    moe_route_gate_up_ref,
    moe_token_down_reduce_ref,
)
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort, sort_block_size
from sgl_dspark.kernels.moe.token_down import moe_token_down_reduce
from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up
from sgl_dspark.srt.layers.quantized import row_slice
from sgl_dspark.srt.model_loader.quantization import (
    fp8_block_to_runtime,
    mxfp4_to_runtime,
    quantize_fp8_block,
    quantize_mxfp4,
)
from test_moe_grouped_gemm import CHAIN_TOL, GEMM_TOL, pytestmark  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def quantized(w: torch.Tensor, fmt: str, block: int) -> QuantizedWeight:
    """`w [..., N, K]` quantised as a checkpoint stores it, in the runtime layout, on DEVICE.
    fp8: `block x block` scale blocks; mxfp4: scale groups of `block` channels."""
    if fmt == "fp8":
        q, s = quantize_fp8_block(w, (block, block))
        qw = fp8_block_to_runtime(q, s, (block, block))
    else:
        qw = mxfp4_to_runtime(*quantize_mxfp4(w, block), block)
    return qw._replace(data=qw.data.to(DEVICE), scale=qw.scale.to(DEVICE))


def random_stored(fmt: str, block: int, n: int, k: int, g: torch.Generator, lo: int, hi: int):
    """A `QuantizedWeight [N, K]` of uniformly random stored codes (every E2M1 code, every E4M3
    code but NaN, subnormals and negative zero included) and scale bytes in [lo, hi], on
    DEVICE: FP8 with block x block scale blocks, MXFP4 with per-row groups of `block`."""
    if fmt == "fp8":
        codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
        codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes).to(torch.uint8)
        data, rows = codes.view(torch.float8_e4m3fn), block
    else:
        data, rows = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8), 1
    scale = torch.randint(lo, hi + 1, (-(-n // rows), -(-k // block)), generator=g)
    return QuantizedWeight(data.to(DEVICE), scale.to(torch.uint8).to(DEVICE), fmt, block, rows)


@triton.jit
def _dequantized_tiles_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_on,
    FP4: tl.constexpr,
    WORDS: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDE: tl.constexpr,
):
    # Program (column block, K step): the GEMMs' dequantised tile, stored as is.
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    k0 = tl.program_id(1) * BLOCK_K
    w_rows = w_ptr + n.to(tl.int64) * stride_wn
    s_rows = s_ptr + (n // SCALE_ROWS).to(tl.int64) * stride_sn
    e = quantized_scales(s_rows, n_ok, k0, K, GROUP, BLOCK_K)
    tile = quantized_tile(w_rows, n_ok, e, k0, K, FP4, WORDS, GROUP, BN, BLOCK_K, WIDE)
    k = k0 + tl.arange(0, BLOCK_K)
    out = out_ptr + n.to(tl.int64)[:, None] * stride_on + k[None, :]
    tl.store(out, tile, mask=n_ok[:, None] & (k < K)[None, :])


def dequantized_tiles(w: QuantizedWeight, bn: int, block_k: int, wide: bool) -> torch.Tensor:
    """Every tile `quantized_tile` gives for `w [N, K]`, assembled: [N, K] fp32 (wide) or bf16."""
    n, k = w.shape
    data, words = stored_rows(w)
    out = torch.full((n, k), float("nan"), device=DEVICE)
    out = out if wide else out.to(torch.bfloat16)
    _dequantized_tiles_kernel[(triton.cdiv(n, bn), triton.cdiv(k, block_k))](
        data,
        w.scale,
        out,
        n,
        k,
        data.stride(0),
        w.scale.stride(0),
        out.stride(0),
        FP4=w.fmt == "mxfp4",
        WORDS=words,
        GROUP=w.group,
        SCALE_ROWS=w.block_rows,
        BN=bn,
        BLOCK_K=block_k,
        WIDE=wide,
    )
    return out


# (format, scale block, N, K, BN, BLOCK_K): groups per step > 1, = 1 and < 1 (a step inside a
# group), partial groups and steps, MXFP4 rows as words (K % 32 == 0) and as bytes.
TILE_CASES = [
    ("fp8", 128, 40, 300, 16, 256),
    ("fp8", 128, 40, 300, 16, 64),
    ("fp8", 32, 33, 100, 16, 256),
    ("fp8", 32, 70, 64, 32, 32),
    ("mxfp4", 32, 24, 256, 16, 256),
    ("mxfp4", 32, 17, 100, 16, 64),
    ("mxfp4", 32, 9, 48, 16, 16),
    ("mxfp4", 32, 16, 96, 32, 32),
    ("mxfp4", 64, 20, 192, 16, 256),
]


@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_dequantized_tile_is_the_reference_weight(case: tuple) -> None:
    """The tile every quantised GEMM multiplies equals `dequantize_weight_ref` bit for bit (fp32
    tiles: fp32 activations and the interpreter; bf16 tiles, compiled only: the matrix unit's
    operands), on random codes with scales whose products stay normal numbers."""
    fmt, block, n, k, bn, block_k = case
    g = torch.Generator().manual_seed(TILE_CASES.index(case))
    # MXFP4 scale bytes up to the kernels' limit; FP8 over a wide range.
    lo, hi = (100, 128) if fmt == "mxfp4" else (90, 150)
    w = random_stored(fmt, block, n, k, g, lo, hi)
    assert stored_rows(w)[1] == (fmt == "mxfp4" and k % 32 == 0)
    for wide in (True, False) if DEVICE == "cuda" else (True,):
        dtype = torch.float32 if wide else torch.bfloat16
        got = dequantized_tiles(w, bn, block_k, wide)
        want = dequantize_weight_ref(w, dtype)
        bits = torch.int32 if wide else torch.int16
        assert torch.equal(got.view(bits), want.view(bits)), (wide, (got != want).sum())


def test_mxfp4_scales_above_two_are_refused_natively() -> None:
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    scale = torch.full((4, 2), 127, dtype=torch.uint8)
    assert mxfp4_to_runtime(packed, scale, 32).scale.max() == 127
    scale[2, 1] = 129  # 2^2: weights up to 24
    with pytest.raises(ValueError, match="experts.w1: MXFP4 scales above 2"):
        mxfp4_to_runtime(packed, scale, 32, "experts.w1")


# (format, scale block, M, N, K): partial row/column blocks, K past the kernel's K step.
LINEAR_CASES = [
    ("fp8", 128, 1, 200, 300),  # K: a full 128 block + a partial one, N: partial row block
    ("fp8", 128, 16, 40, 1100),  # K past several 256-channel steps, the last partial
    ("fp8", 128, 7, 130, 512),
    ("fp8", 128, 2, 8300, 128),  # N > 8192: the wide column blocks
    ("fp8", 32, 5, 33, 96),  # V4.1's 32 x 32 blocks
    ("fp8", 32, 12, 64, 288),
    ("mxfp4", 32, 3, 24, 160),  # rows as words (K % 32 == 0)
    ("mxfp4", 32, 16, 48, 512),
    ("mxfp4", 32, 9, 17, 1090),  # rows as bytes, two K steps, the last partial
    ("mxfp4", 32, 4, 40, 100),  # K not a multiple of 8: a partial last word
    ("mxfp4", 64, 2, 70, 192),
    ("mxfp4", 32, 1, 8200, 64),  # N > 8192
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: "-".join(map(str, c)))
def test_quantized_linear_matches_dequantised_reference(case: tuple, dtype: torch.dtype) -> None:
    fmt, block, m, n, k = case
    g = torch.Generator().manual_seed(LINEAR_CASES.index(case))
    w = quantized(torch.randn(n, k, generator=g) * 0.05, fmt, block)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    got = quantized_linear(x, w, out=out)
    assert got is out and not torch.isnan(got).any()
    torch.testing.assert_close(got, small_m_linear_ref(x, w), **GEMM_TOL[dtype])
    # The same weights dequantised once (the `--weight-format bf16` path's weights).
    want = small_m_linear_ref(x, dequantize_weight_ref(w, dtype))
    torch.testing.assert_close(got, want, **GEMM_TOL[dtype])


@pytest.mark.parametrize(
    "fmt,block,k", [("fp8", 128, 320), ("fp8", 32, 256), ("mxfp4", 32, 256), ("mxfp4", 32, 120)]
)
def test_quantized_linear_rows_independent_of_m(fmt: str, block: int, k: int) -> None:
    """A row's result is the same bits for every M from 1 to 16 (the tile is always 16 rows and
    the launch shape depends on (N, K) only): a DSpark verify gives each token the bits of a
    one-token step."""
    g = torch.Generator().manual_seed(7)
    w = quantized(torch.randn(48, k, generator=g) * 0.05, fmt, block)
    x = torch.randn(16, k, generator=g).to(torch.bfloat16).to(DEVICE)
    full = quantized_linear(x, w)
    for m in range(1, 16):
        assert torch.equal(quantized_linear(x[:m], w), full[:m]), m
    assert torch.equal(quantized_linear(x[9:10], w), full[9:10])


@pytest.mark.parametrize(
    "fmt,block,k,m",
    [("fp8", 128, 160, 3), ("fp8", 32, 160, 16), ("mxfp4", 32, 160, 1), ("mxfp4", 32, 136, 5)],
)
def test_quantized_grouped_linear(fmt: str, block: int, k: int, m: int) -> None:
    g = torch.Generator().manual_seed(3)
    groups, rank = 4, 40
    # rank 40: FP8 scale blocks of 32 or 128 rows span two groups; K 136: MXFP4 rows as bytes.
    w = quantized(torch.randn(groups * rank, k, generator=g) * 0.05, fmt, block)
    x = torch.randn(m, groups, k, generator=g).to(torch.bfloat16).to(DEVICE)
    got = quantized_grouped_linear(x, w)
    torch.testing.assert_close(got, small_m_grouped_linear_ref(x, w), **GEMM_TOL[torch.bfloat16])
    rows = w.per_row()
    for i in range(groups):  # each group's bits as its own call on its rows
        single = row_slice(rows, i * rank, (i + 1) * rank)
        assert isinstance(single, QuantizedWeight)
        assert torch.equal(got[:, i], quantized_linear(x[:, i].contiguous(), single))


@pytest.mark.parametrize("fmt,block,k", [("fp8", 32, 704), ("fp8", 128, 1024), ("mxfp4", 32, 704)])
def test_wider_column_blocks_change_no_bit(fmt: str, block: int, k: int, monkeypatch) -> None:
    """More 16-column programs than three an SM take 32-column blocks; a group's columns are
    then the same bits as its own call in 16-column blocks (the column block does not enter a
    sum's order)."""
    import sgl_dspark.kernels.linear.quantized as quantized_module

    meta = quantized_module._quantized_meta
    assert meta("fp8", 1024, 4096, groups=8, sms=132)["BLOCK_N"] == 32  # V4.1's o_a: 512
    assert meta("fp8", 1024, 4096, groups=8, sms=256)["BLOCK_N"] == 16  # fits three an SM
    assert meta("fp8", 5120, 8192, groups=1, sms=132)["BLOCK_N"] == 16  # V4.1's o_b: 320
    g = torch.Generator().manual_seed(11)
    groups, rank = 4, 48
    w = quantized(torch.randn(groups * rank, k, generator=g) * 0.05, fmt, block)
    x = torch.randn(6, groups, k, generator=g).to(torch.bfloat16).to(DEVICE)
    # On "one multiprocessor" the grouped launch (12 blocks of 16) goes beyond three, each
    # group alone (3 blocks) does not.
    monkeypatch.setattr(quantized_module, "sm_count", lambda device: 1)
    assert meta("fp8", rank, k, groups, 1)["BLOCK_N"] == 32
    assert meta("fp8", rank, k, 1, 1)["BLOCK_N"] == 16
    got = quantized_grouped_linear(x, w)
    torch.testing.assert_close(got, small_m_grouped_linear_ref(x, w), **GEMM_TOL[torch.bfloat16])
    rows = w.per_row()
    for i in range(groups):
        single = row_slice(rows, i * rank, (i + 1) * rank)
        assert isinstance(single, QuantizedWeight)
        assert torch.equal(got[:, i], quantized_linear(x[:, i].contiguous(), single))


def test_quantized_linear_bad_arguments() -> None:
    w = quantized(torch.randn(32, 64) * 0.05, "fp8", 32)
    x = torch.randn(2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="expected K=32 channels, got 64"):
        quantized_linear(torch.randn(2, 32, dtype=torch.bfloat16, device=DEVICE), w)
    with pytest.raises(ValueError, match="scale must be uint8"):
        quantized_linear(x, w._replace(scale=w.scale[:, :1]))
    with pytest.raises(ValueError, match="data must be"):
        quantized_linear(x, w._replace(data=w.data.view(torch.uint8)))


@pytest.mark.parametrize("row_blocks", [1, 2])
@pytest.mark.parametrize(
    "fmt,block,k", [("fp8", 32, 96), ("mxfp4", 32, 96), ("fp8", 128, 300), ("mxfp4", 32, 136)]
)
def test_rows_past_one_tile_run_as_calls_of_their_own(
    fmt: str, block: int, k: int, row_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any M runs (16-row blocks, one or two a program above 16 rows; two are both multiplied by
    each dequantised weight tile): every row has the bits of a one-row call, so a row's result
    never depends on the batch (`--enable-deterministic-inference`). K 300 / 136: a partial last
    K step, MXFP4 rows read as bytes."""
    import sgl_dspark.kernels.linear.quantized as quantized_module

    monkeypatch.setattr(quantized_module, "_ROW_BLOCKS_ABOVE_TILE", row_blocks)
    assert quantized_module._quantized_meta(fmt, 40, k, m=37)["ROW_BLOCKS"] == row_blocks
    assert quantized_module._quantized_meta(fmt, 40, k, m=16)["ROW_BLOCKS"] == 1
    g = torch.Generator().manual_seed(7)
    w = quantized(torch.randn(40, k, generator=g) * 0.05, fmt, block)
    x = torch.randn(37, k, generator=g).to(torch.bfloat16).to(DEVICE)
    out = torch.full((37, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = quantized_linear(x, w, out=out)
    assert got is out and not got.isnan().any()  # every row block written
    want = small_m_linear_ref(x, dequantize_weight_ref(w, torch.bfloat16))
    torch.testing.assert_close(got, want, **GEMM_TOL[torch.bfloat16])
    for b in range(0, 37, 16):  # a block's bits as a call of its own
        assert torch.equal(got[b : b + 16], quantized_linear(x[b : b + 16], w))
    # and a row's as a one-row call (bf16: exact in the interpreter)
    for r in (0, 15, 16, 31, 32, 36):
        assert torch.equal(got[r : r + 1], quantized_linear(x[r : r + 1], w))
    assert torch.equal(quantized_linear(x[5:25], w), got[5:25])  # a pair with a partial block


@pytest.mark.parametrize("fmt,block", [("fp8", 32), ("mxfp4", 32)])
def test_grouped_rows_past_one_tile_run_as_calls_of_their_own(
    fmt: str, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grouped linear above 16 rows with two row blocks a program: each row block's bits
    as a call of its own."""
    import sgl_dspark.kernels.linear.quantized as quantized_module

    monkeypatch.setattr(quantized_module, "_ROW_BLOCKS_ABOVE_TILE", 2)
    g = torch.Generator().manual_seed(13)
    groups, rank, k = 3, 24, 128
    w = quantized(torch.randn(groups * rank, k, generator=g) * 0.05, fmt, block)
    x = torch.randn(40, groups, k, generator=g).to(torch.bfloat16).to(DEVICE)
    got = quantized_grouped_linear(x, w)
    torch.testing.assert_close(got, small_m_grouped_linear_ref(x, w), **GEMM_TOL[torch.bfloat16])
    for b in range(0, 40, 16):
        assert torch.equal(got[b : b + 16], quantized_grouped_linear(x[b : b + 16], w))


def _experts(
    fmt: str, block: int, e: int, d: int, i: int, g: torch.Generator
) -> tuple[QuantizedWeight, QuantizedWeight]:
    gate_up = torch.randn(e, 2 * i, d, generator=g) * 3 * d**-0.5  # the clamps are hit
    down = torch.randn(e, d, i, generator=g) * i**-0.5
    return quantized(gate_up, fmt, block), quantized(down, fmt, block)


# (format, block, M, topk, E, D, I). MXFP4 stage 1 splits its K steps four ways (K step 128 or
# 256), its stage 2 does not (K step 32 or 64: dots of 16 or 32 channels), so both kinds of
# expert product are compared across the paths.
MOE_CASES = [
    ("fp8", 128, 5, 3, 6, 160, 96),  # D, I: partial scale blocks and K steps
    ("fp8", 32, 3, 2, 4, 64, 48),
    ("fp8", 32, 16, 6, 8, 96, 64),
    ("mxfp4", 32, 6, 2, 5, 96, 64),
    ("mxfp4", 32, 1, 4, 8, 288, 32),  # D = 288: two K steps of stage 1
    ("mxfp4", 32, 12, 3, 6, 72, 40),  # D, I: rows as bytes (not multiples of 32)
]


@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_quantized_moe_paths(case: tuple) -> None:
    """Sorted path (grouped stage 1 + stage 2, reduce; 16- and 32-row blocks) and per-token
    path against the references on the dequantised experts, and against each other."""
    fmt, block, m, topk, e, d, i = case
    g = torch.Generator().manual_seed(100 + MOE_CASES.index(case))
    gate_up, down = _experts(fmt, block, e, d, i, g)
    dtype = torch.bfloat16
    gu_deq, down_deq = dequantize_weight_ref(gate_up, dtype), dequantize_weight_ref(down, dtype)
    x = torch.randn(m, d, generator=g).to(dtype).to(DEVICE)
    ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :topk].to(torch.int32).to(DEVICE)
    weights = torch.rand(m, topk, generator=g).to(DEVICE)
    shared = torch.randn(m, d, generator=g).to(dtype).to(DEVICE)
    mask = torch.ones(e, dtype=torch.int32, device=DEVICE)
    plan = prepare_moe_sort(mask)
    limit = 1.5
    want_y = fused_moe_ref(x, gu_deq, down_deq, ids, mask, limit)

    sorted_out = {}
    for block_size in (16, 32):
        sort = moe_sort(ids, weights, plan, 0, block_size=block_size)
        y = torch.full((m, topk, d), float("nan"), dtype=dtype, device=DEVICE)
        y = fused_moe(x, gate_up, down, sort, topk, limit, block_size=block_size, out=y)
        torch.testing.assert_close(y, want_y, **CHAIN_TOL[dtype])
        sorted_out[block_size] = moe_reduce(y, weights, ids, mask, 1.0, shared)
    # The block size (the grouped GEMMs' M tile) changes no bit on a GPU.
    _same_bits(sorted_out[16], sorted_out[32], dtype)

    table = plan.local_table
    h = moe_route_gate_up(x, gate_up, ids, table, e, limit)
    h_ref = moe_route_gate_up_ref(x, gu_deq, ids, table, e, limit)
    torch.testing.assert_close(h, h_ref, **CHAIN_TOL[dtype])
    out = torch.full((m, d), float("nan"), dtype=dtype, device=DEVICE)
    got = moe_token_down_reduce(h, down, ids, weights, table, e, 1.0, shared, out=out)
    want = moe_token_down_reduce_ref(h, down_deq, ids, weights, table, e, 1.0, shared)
    torch.testing.assert_close(got, want, **CHAIN_TOL[dtype])
    _same_bits(got, sorted_out[32], dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal bits on a GPU; within CHAIN_TOL under the interpreter (numpy's matmul sums depend
    on the tile shape)."""
    if DEVICE == "cuda":
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    else:
        torch.testing.assert_close(a, b, **CHAIN_TOL[dtype])


def test_scales_loaded_ahead_rule() -> None:
    """The rule of `scales_loaded_ahead`, case by case (the compiler's side of it is checked by
    `gpu_targets_check.check_k_loops`): ahead for a step of 8 or more groups spread at fewer
    than 4 bytes a thread, never otherwise."""
    g = torch.Generator().manual_seed(3)
    fp8_32 = quantized(torch.randn(64, 512, generator=g), "fp8", 32)
    fp8_128 = quantized(torch.randn(256, 512, generator=g), "fp8", 128)
    fp4 = quantized(torch.randn(64, 512, generator=g), "mxfp4", 32)
    # The narrow linears: 16 columns x 16 groups over 4 warps, 2 bytes a thread.
    assert scales_loaded_ahead(fp8_32, 16, 512, 4)
    assert scales_loaded_ahead(fp4, 16, 512, 4)
    assert not scales_loaded_ahead(fp8_32, 16, 512, 1)  # one warp: 8 bytes a thread
    # 32 columns x 8 groups: 2 bytes a thread; 64 columns (the per-token stage 1): 4.
    assert scales_loaded_ahead(fp4, 32, 256, 4)
    assert not scales_loaded_ahead(fp4, 64, 256, 4)
    assert not scales_loaded_ahead(fp8_32, 64, 256, 4)
    # Fewer than 8 groups a step.
    assert not scales_loaded_ahead(fp8_128, 16, 512, 4)
    assert not scales_loaded_ahead(fp4, 16, 128, 4)


def test_scale_alignment_divides_every_row_address() -> None:
    """SCALE_ALIGN tells the compiler every scale row's address is a multiple of it (a wrong
    one would make misaligned copies on a GPU): the largest power of two up to 16 dividing the
    base address and the outer strides, by hand for each layout."""

    def weight(scale: torch.Tensor) -> QuantizedWeight:
        n, groups = scale.shape[-2:]
        data = torch.zeros(*scale.shape[:-2], n, groups * 16, dtype=torch.uint8)
        return QuantizedWeight(data, scale, "mxfp4", 32)

    base = torch.zeros(4096, dtype=torch.uint8)
    assert base.data_ptr() % 16 == 0
    assert scale_alignment(weight(base[: 8 * 160].view(8, 160))) == 16  # K 5120
    assert scale_alignment(weight(base[: 8 * 72].view(8, 72))) == 8  # K 2304
    assert scale_alignment(weight(base[: 8 * 40].view(8, 40))) == 8  # K 1280
    assert scale_alignment(weight(base[: 8 * 100].view(8, 100))) == 4
    assert scale_alignment(weight(base[: 8 * 18].view(8, 18))) == 2
    assert scale_alignment(weight(base[1 : 1 + 8 * 160].view(8, 160))) == 1  # odd base
    # A stack of experts: the expert stride counts too (3 rows of 72 bytes: 216, 8-aligned).
    assert scale_alignment(weight(base[: 2 * 3 * 72].view(2, 3, 72))) == 8
    assert scale_alignment(weight(base[: 2 * 3 * 36].view(2, 3, 36))) == 4


SCALE_AHEAD_CASES = [  # (format, block, M, N, K): K steps even and bounded, a partial last group
    ("fp8", 32, 1, 48, 1024),
    ("fp8", 32, 2, 40, 800),
    ("mxfp4", 32, 1, 34, 1024),
    ("mxfp4", 32, 1, 24, 736),  # the experts' down: rows of 184 bytes, read byte by byte
]


@pytest.mark.parametrize("case", SCALE_AHEAD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_scales_loaded_ahead_change_no_bit(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bits with the scale bytes loaded a step ahead and in their step, for the
    linear and both per-token MoE stages (a step's scales are the same bytes either way; the
    read ahead past the last step is masked off)."""
    from sgl_dspark.kernels.linear import quantized as linear_module
    from sgl_dspark.kernels.moe import expert_weights

    fmt, block, m, n, k = case
    g = torch.Generator().manual_seed(40 + SCALE_AHEAD_CASES.index(case))
    w = quantized(torch.randn(n, k, generator=g) * 0.05, fmt, block)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    gate_up, down = _experts(fmt, block, 3, k, k // 2, g)
    ids = torch.tensor([[0, 2]] * m, dtype=torch.int32, device=DEVICE)
    table = prepare_moe_sort(torch.ones(3, dtype=torch.int32, device=DEVICE)).local_table
    weights = torch.rand(m, 2, generator=g).to(DEVICE)

    def run(ahead: bool) -> list[torch.Tensor]:
        def rule(*_: object) -> bool:
            return ahead

        monkeypatch.setattr(linear_module, "scales_loaded_ahead", rule)
        monkeypatch.setattr(expert_weights, "scales_loaded_ahead", rule)
        h = moe_route_gate_up(x, gate_up, ids, table, 3, 1.5)
        out = moe_token_down_reduce(h, down, ids, weights, table, 3)
        return [quantized_linear(x, w), h, out]

    for ahead, step in zip(run(True), run(False)):
        assert not torch.isnan(ahead).any()
        assert torch.equal(ahead, step)


def test_expert_split_k_gives_each_warp_a_whole_matrix_step() -> None:
    g = torch.Generator().manual_seed(7)
    fp8 = quantized(torch.randn(2, 32, 64, generator=g), "fp8", 32)
    fp4 = quantized(torch.randn(2, 32, 64, generator=g), "mxfp4", 32)
    # MXFP4: 4 warps x 16 channels of each of the two dots, a K step of at least 128.
    assert [expert_split_k(k, fp4) for k in (32, 64, 128, 256)] == [1, 1, 4, 4]
    assert [expert_split_k(k, fp8) for k in (16, 64, 256)] == [1, 1, 1]
    assert expert_split_k(256, torch.empty(2, 32, 64, dtype=torch.bfloat16)) == 1
    assert EXPERT_WARPS == 4


def test_per_token_path_limits_by_expert_format() -> None:
    from sgl_dspark.srt.layers.moe.experts import token_path_max_m

    g = torch.Generator().manual_seed(3)
    limits = {"fp8": 1, "mxfp4": 2}
    for fmt, limit in limits.items():
        assert token_path_max_m(quantized(torch.randn(2, 32, 64, generator=g), fmt, 32)) == limit
    assert token_path_max_m(torch.empty(2, 32, 64, dtype=torch.bfloat16)) == 4


def test_sort_block_size_is_16_at_decode_sizes() -> None:
    # 16 while the routes average at most 16 per local expert (97: 96 routed + the shared).
    assert sort_block_size(1, 7, 97) == 16
    assert sort_block_size(221, 7, 97) == 16  # 1547 routes
    assert sort_block_size(222, 7, 97) == 32  # 1554 routes
    assert sort_block_size(4, 6, 0) == 32


@pytest.mark.parametrize(
    "fmt,shared_fmt,m,before_down",
    [
        ("fp8", "fp8", 1, False),
        ("mxfp4", "mxfp4", 2, False),
        ("mxfp4", "mxfp4", 5, False),
        ("mxfp4", "fp8", 1, False),
        ("mxfp4", "fp8", 2, True),
        ("mxfp4", "fp8", 4, True),
    ],
)
def test_shared_expert_folds_into_quantized_stacks(
    fmt: str, shared_fmt: str, m: int, before_down: bool
) -> None:
    """The shared expert folds into the routed experts' stacks (expert E): stored in their format
    and scale group it is stacked with them; in another (V4.1: FP8 beside MXFP4) it is their
    extra expert, the routed stacks not copied. The folded triton layer equals the torch layer
    (routed loop + separate shared expert) on the same quantised weights: per-token path (FP8
    M = 1, MXFP4 M <= 2) and sorted path (MXFP4 M = 4, 5), with the route weight before the down
    projection (V4.1) too. The per-token path's stage 2 leaves the layer's arrival counters
    zero and keeps them from call to call (a captured graph holds their address)."""
    from sgl_dspark.srt.core.kernel_choice import KernelChoice
    from sgl_dspark.srt.layers.moe.experts import (
        QUANTIZED_TOKEN_PATH_MAX_M,
        RoutedExperts,
        SharedExpert,
    )
    from sgl_dspark.srt.layers.quantized import module_weight, store_quantized, weight_ptr

    g = torch.Generator().manual_seed(5 + m)
    e, d, i, topk = 4, 64, 32, 2
    gate_up, down = _experts(fmt, 32, e, d, i, g)
    shared_gu, shared_down = _experts(shared_fmt, 32, 1, d, i, g)
    layers = {}
    for backend in ("torch", "triton"):
        kernels = KernelChoice(backend)
        routed = RoutedExperts(e, d, i, 1.5, kernels, weight_before_down=before_down).to(DEVICE)
        shared = SharedExpert(d, i, 1.5, kernels).to(DEVICE, torch.bfloat16)
        store_quantized(routed, "gate_up_proj", gate_up)
        store_quantized(routed, "down_proj", down)
        for lin, start in ((shared.gate_proj, 0), (shared.up_proj, i)):
            half = row_slice(shared_gu.expert(0), start, start + i)
            assert isinstance(half, QuantizedWeight)
            store_quantized(lin, "weight", half)
        store_quantized(shared.down_proj, "weight", shared_down.expert(0))
        if backend == "triton":
            before = weight_ptr(module_weight(routed, "gate_up_proj"))
            routed.fold_shared(shared)
            assert routed.folded
            stacked = module_weight(routed, "gate_up_proj")
            assert isinstance(stacked, QuantizedWeight) and stacked.data.shape[0] == e
            # Of another format the shared expert is an extra: the routed stacks stay put.
            assert (weight_ptr(stacked) == before) == (shared_fmt != fmt)
        layers[backend] = (routed, shared)
    x = torch.randn(m, d, generator=g).to(torch.bfloat16).to(DEVICE)
    ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :topk].to(DEVICE)
    weights = torch.rand(m, topk, generator=g).to(DEVICE)
    routed_t, shared_t = layers["torch"]
    want = routed_t(x, ids, weights.to(x.dtype)) + shared_t(x)
    routed_f, _ = layers["triton"]
    ids_f = torch.cat((ids, torch.full((m, 1), e, device=DEVICE)), dim=1).to(torch.int32)
    weights_f = torch.cat((weights, torch.ones(m, 1, device=DEVICE)), dim=1)
    got = routed_f.forward_folded(x, ids_f, weights_f)
    torch.testing.assert_close(got, want, rtol=2**-5, atol=2**-5)
    arrivals = routed_f._arrivals
    if fmt == "mxfp4" and m <= QUANTIZED_TOKEN_PATH_MAX_M[fmt]:  # stage 2 in slot groups
        assert arrivals is not None and torch.count_nonzero(arrivals) == 0
        again = routed_f.forward_folded(x, ids_f, weights_f)
        assert routed_f._arrivals is arrivals
        assert torch.equal(again.view(torch.int16), got.view(torch.int16))
    else:  # FP8 stacks reduce in one program a tile; the sorted path has no counters
        assert arrivals is None
