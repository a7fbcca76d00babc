"""The small-M quantised linear with K split over programs (`kernels/linear/quantized.py`): a
narrow launch of few column blocks (V4.1-Flash's x projection: 1792 columns, 112 blocks) cuts K
into parts, each part's fp32 sums stored as partials, the last part of a tile to arrive adding
them in part order.

Checked: which shapes split; the result against dequantise-then-reference (bf16 and fp32, FP8
and MXFP4, a last part shorter than the others, rows past one 16-row tile, grouped launches);
the sum's order bit for bit (fp32 activations: the split result is exactly the sum, in part
order, of unsplit calls on each part's channels); a row's bits independent of M; the arrival
counters left zero for the next launch. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import pytest
import torch
import triton
from sgl_dspark.kernels.linear import quantized as quantized_module
from sgl_dspark.kernels.linear.quantized import quantized_grouped_linear, quantized_linear
from sgl_dspark.kernels.linear.reference import (
    QuantizedWeight,
    small_m_grouped_linear_ref,
    small_m_linear_ref,
)
from sgl_dspark.srt.layers.quantized import row_slice
from test_moe_grouped_gemm import GEMM_TOL, pytestmark  # noqa: F401
from test_quantized_gemm import DEVICE, quantized


def _k_slice(w: QuantizedWeight, begin: int, end: int) -> QuantizedWeight:
    """Input channels [begin, end) of `w [N, K]` (begin a multiple of its scale group) as a
    weight of its own, contiguous."""
    per_byte = 2 if w.fmt == "mxfp4" else 1
    data = w.data[:, begin // per_byte : -(-end // per_byte)]
    scale = w.scale[:, begin // w.group : -(-end // w.group)]
    return w._replace(data=data.contiguous(), scale=scale.contiguous())


def _parts(n: int, k: int, fmt: str, groups: int = 1) -> int:
    meta = quantized_module._quantized_meta(fmt, n, k, groups)
    return quantized_module._k_parts(k, meta["K_PARTS"], meta["BLOCK_K"], 32)[0]


def test_which_launches_split() -> None:
    """Only narrow launches of fewer column blocks than a GPU's SMs split, into parts of at
    least two K steps; the shape depends on (N, K) and the groups, never on M."""
    assert _parts(1792, 5120, "fp8") == 3  # V4.1-Flash's x projection: 112 blocks -> 336
    assert _parts(5120, 8192, "fp8") == 1  # its o_b: 320 blocks
    assert _parts(1024, 4096, "fp8", groups=8) == 1  # the grouped o_a: 512 blocks
    assert _parts(32768, 1280, "fp8") == 1  # q_b: the wide class
    assert _parts(64, 8192, "mxfp4") == 8  # 4 blocks, 16 steps: 2 steps a part
    assert _parts(48, 1536, "fp8") == 1  # 3 steps: one part of at least two
    assert quantized_module._k_parts(2000, 2, 512, 32) == (2, 1024)  # the last part 976


# (format, scale block, M, N, K): parts of whole K steps, the last one shorter (K 2000, 2600),
# MXFP4 rows as words (K % 32 == 0) and as bytes (K 2600: 1300 bytes a row), FP8 blocks of
# 128 rows spanning column blocks, M past one 16-row tile.
SPLIT_CASES = [
    ("fp8", 32, 1, 40, 2048),
    ("fp8", 128, 5, 40, 2000),
    ("fp8", 32, 17, 24, 3072),
    ("mxfp4", 32, 3, 40, 2048),
    ("mxfp4", 32, 1, 33, 2600),
    ("mxfp4", 32, 20, 16, 2000),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_split_matches_dequantised_reference(case: tuple, dtype: torch.dtype) -> None:
    fmt, block, m, n, k = case
    assert _parts(n, k, fmt) > 1
    g = torch.Generator().manual_seed(SPLIT_CASES.index(case))
    w = quantized(torch.randn(n, k, generator=g) * 0.05, fmt, block)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    got = quantized_linear(x, w, out=out)
    assert got is out and not torch.isnan(got).any()
    torch.testing.assert_close(got, small_m_linear_ref(x, w), **GEMM_TOL[dtype])


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_parts_are_summed_in_part_order(case: tuple) -> None:
    """fp32 activations (fp32 products and output, nothing rounded): the split result is bit
    for bit the sum, first part first, of unsplit calls on each part's channels (each a call of
    at most two K steps, which does not split)."""
    fmt, block, m, n, k = case
    g = torch.Generator().manual_seed(100 + SPLIT_CASES.index(case))
    w = quantized(torch.randn(n, k, generator=g) * 0.05, fmt, block)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    meta = quantized_module._quantized_meta(fmt, n, k)
    parts, part_len = quantized_module._k_parts(k, meta["K_PARTS"], meta["BLOCK_K"], w.group)
    assert parts > 1
    want = torch.zeros(m, n, device=DEVICE)
    for p in range(parts):
        begin, end = p * part_len, min(k, (p + 1) * part_len)
        assert _parts(n, end - begin, fmt) == 1
        want = want + quantized_linear(x[:, begin:end].contiguous(), _k_slice(w, begin, end))
    assert torch.equal(quantized_linear(x, w), want)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_split_rows_independent_of_m_and_counters_left_zero(fmt: str) -> None:
    """A row's bits are the same at every M (the parts depend on (N, K) only), and every launch
    leaves its arrival counters zero, so the next launch (or graph replay) starts armed."""
    g = torch.Generator().manual_seed(21)
    n, k = 40, 2048
    w = quantized(torch.randn(n, k, generator=g) * 0.05, fmt, 32)
    x = torch.randn(20, k, generator=g).to(torch.bfloat16).to(DEVICE)
    full = quantized_linear(x, w)
    for m in (1, 2, 7, 16, 17):
        assert torch.equal(quantized_linear(x[:m], w), full[:m]), m
    assert torch.equal(quantized_linear(x[11:12], w), full[11:12])
    assert torch.equal(quantized_linear(x, w), full)  # again, on the re-armed counters
    made = quantized_module._K_SPLIT_COUNTERS_MADE
    assert made and all(int(c.count_nonzero()) == 0 for c in made)


def test_counters_are_kept_per_stream_and_grow_without_freeing() -> None:
    """One set of counters per (device, stream), grown by a new set when a launch needs more;
    every set made stays alive (a captured graph may hold its address)."""
    device = torch.device(DEVICE)
    small = quantized_module._k_split_counters(device, 16)
    assert small.dtype == torch.int32 and int(small.count_nonzero()) == 0
    assert quantized_module._k_split_counters(device, 16) is small
    grown = quantized_module._k_split_counters(device, small.numel() + 1)
    assert grown is not small and grown.numel() > small.numel()
    made = quantized_module._K_SPLIT_COUNTERS_MADE
    assert any(c is small for c in made) and any(c is grown for c in made)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_split_grouped_linear_groups_as_their_own_calls(fmt: str) -> None:
    g = torch.Generator().manual_seed(5)
    groups, rank, k = 3, 40, 2048
    assert _parts(rank, k, fmt, groups) > 1
    w = quantized(torch.randn(groups * rank, k, generator=g) * 0.05, fmt, 32)
    x = torch.randn(4, groups, k, generator=g).to(torch.bfloat16).to(DEVICE)
    got = quantized_grouped_linear(x, w)
    torch.testing.assert_close(got, small_m_grouped_linear_ref(x, w), **GEMM_TOL[torch.bfloat16])
    rows = w.per_row()
    for i in range(groups):
        single = row_slice(rows, i * rank, (i + 1) * rank)
        assert isinstance(single, QuantizedWeight)
        assert triton.cdiv(rank, 16) * groups < quantized_module._K_SPLIT_BELOW
        assert torch.equal(got[:, i], quantized_linear(x[:, i].contiguous(), single))
