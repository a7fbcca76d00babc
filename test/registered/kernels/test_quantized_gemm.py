"""GEMMs on weights kept as stored (FP8 block-scaled, MXFP4) against dequantise-then-reference:
the small-M linear and grouped linear (`kernels/linear/quantized.py`), the MoE grouped GEMMs
(stage 1 with the activation, stage 2), the per-token MoE kernels and the shared-expert fold.

The weights are quantised from random floats by the checkpoint quantisers and converted to the
runtime layout as the loader does; the references get the same weights dequantised (exact), so
the only difference is the fp32 summation order: a tolerance (GEMM_TOL / CHAIN_TOL, as the
unquantised kernels). Shapes cover partial scale blocks (N and K not multiples of the block), K
not a multiple of the kernel's K step, rows padded to the 16-row tile (M < 16) and partial column
tiles. Outputs are poisoned with NaN first. On a GPU the per-token and sorted MoE paths must give
the same bits (their products are the same chunked sums).
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.linear.quantized import quantized_grouped_linear, quantized_linear
from sgl_dspark.kernels.linear.reference import (
    QuantizedWeight,
    dequantize_weight_ref,
    small_m_grouped_linear_ref,
    small_m_linear_ref,
)
from sgl_dspark.kernels.moe.grouped_gemm import fused_moe
from sgl_dspark.kernels.moe.reduce import moe_reduce
from sgl_dspark.kernels.moe.reference import (
    fused_moe_ref,
    moe_route_gate_up_ref,
    moe_token_down_reduce_ref,
)
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort
from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up, moe_token_down_reduce
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


# (format, scale block, M, N, K): partial row/column blocks, K past the kernel's K step.
LINEAR_CASES = [
    ("fp8", 128, 1, 200, 300),  # K: a full 128 block + a partial one, N: partial row block
    ("fp8", 128, 16, 40, 1100),  # K > the 512-channel step: a second step, partial
    ("fp8", 32, 5, 33, 96),  # V4.1's 32 x 32 blocks
    ("mxfp4", 32, 3, 24, 160),
    ("mxfp4", 32, 9, 17, 1090),  # two K steps, the last partial
    ("mxfp4", 64, 2, 70, 192),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", LINEAR_CASES)
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


def test_quantized_linear_rows_independent_of_m() -> None:
    """A row's result is the same bits alone or among 16 rows (the tile is always 16 rows)."""
    g = torch.Generator().manual_seed(7)
    w = quantized(torch.randn(48, 256, generator=g) * 0.05, "mxfp4", 32)
    x = torch.randn(16, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    full = quantized_linear(x, w)
    for row in (0, 9, 15):
        assert torch.equal(quantized_linear(x[row : row + 1], w), full[row : row + 1])


@pytest.mark.parametrize("fmt,block", [("fp8", 128), ("fp8", 32), ("mxfp4", 32)])
def test_quantized_grouped_linear(fmt: str, block: int) -> None:
    g = torch.Generator().manual_seed(3)
    groups, rank, k = 4, 40, 160
    # rank 40: FP8 scale blocks of 32 or 128 rows span two groups.
    w = quantized(torch.randn(groups * rank, k, generator=g) * 0.05, fmt, block)
    x = torch.randn(3, groups, k, generator=g).to(torch.bfloat16).to(DEVICE)
    got = quantized_grouped_linear(x, w)
    torch.testing.assert_close(got, small_m_grouped_linear_ref(x, w), **GEMM_TOL[torch.bfloat16])
    rows = w.per_row()
    for i in range(groups):  # each group's bits as its own call on its rows
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
    with pytest.raises(ValueError, match="at most 16 rows"):
        quantized_linear(torch.randn(17, 64, dtype=torch.bfloat16, device=DEVICE), w)


def _experts(
    fmt: str, block: int, e: int, d: int, i: int, g: torch.Generator
) -> tuple[QuantizedWeight, QuantizedWeight]:
    gate_up = torch.randn(e, 2 * i, d, generator=g) * 3 * d**-0.5  # the clamps are hit
    down = torch.randn(e, d, i, generator=g) * i**-0.5
    return quantized(gate_up, fmt, block), quantized(down, fmt, block)


# (format, block, M, topk, E, D, I)
MOE_CASES = [
    ("fp8", 128, 5, 3, 6, 160, 96),  # D, I: partial scale blocks and K steps
    ("fp8", 32, 3, 2, 4, 64, 48),
    ("mxfp4", 32, 6, 2, 5, 96, 64),
    ("mxfp4", 32, 1, 4, 8, 288, 32),  # D = 288: two K steps of stage 1
]


@pytest.mark.parametrize("case", MOE_CASES)
def test_quantized_moe_paths(case: tuple) -> None:
    """Sorted path (grouped stage 1 + stage 2, reduce) and per-token path against the
    references on the dequantised experts, and against each other."""
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

    sort = moe_sort(ids, weights, plan, 0)
    y = fused_moe(x, gate_up, down, sort, topk, limit)
    torch.testing.assert_close(
        y, fused_moe_ref(x, gu_deq, down_deq, ids, mask, limit), **CHAIN_TOL[dtype]
    )
    sorted_out = moe_reduce(y, weights, ids, mask, 1.0, shared)

    table = plan.local_table
    h = moe_route_gate_up(x, gate_up, ids, table, e, limit)
    h_ref = moe_route_gate_up_ref(x, gu_deq, ids, table, e, limit)
    torch.testing.assert_close(h, h_ref, **CHAIN_TOL[dtype])
    out = torch.full((m, d), float("nan"), dtype=dtype, device=DEVICE)
    got = moe_token_down_reduce(h, down, ids, weights, table, e, 1.0, shared, out=out)
    want = moe_token_down_reduce_ref(h, down_deq, ids, weights, table, e, 1.0, shared)
    torch.testing.assert_close(got, want, **CHAIN_TOL[dtype])
    if DEVICE == "cuda":
        assert torch.equal(got.view(torch.int16), sorted_out.view(torch.int16))
    else:
        torch.testing.assert_close(got, sorted_out, **CHAIN_TOL[dtype])


@pytest.mark.parametrize("fmt,block", [("fp8", 32), ("mxfp4", 32)])
def test_shared_expert_folds_into_quantized_stacks(fmt: str, block: int) -> None:
    """The shared expert stored in the routed experts' format folds into their stacks (expert
    E); the folded triton layer equals the torch layer (routed loop + separate shared expert) on
    the same quantised weights."""
    from sgl_dspark.srt.core.kernel_choice import KernelChoice
    from sgl_dspark.srt.layers.moe.experts import RoutedExperts, SharedExpert
    from sgl_dspark.srt.layers.quantized import module_weight, store_quantized

    g = torch.Generator().manual_seed(5)
    e, d, i, m, topk = 4, 64, 32, 3, 2
    gate_up, down = _experts(fmt, block, e, d, i, g)
    shared_gu, shared_down = _experts(fmt, block, 1, d, i, g)
    layers = {}
    for backend in ("torch", "triton"):
        kernels = KernelChoice(backend)
        routed = RoutedExperts(e, d, i, 1.5, kernels).to(DEVICE)
        shared = SharedExpert(d, i, 1.5, kernels).to(DEVICE, torch.bfloat16)
        store_quantized(routed, "gate_up_proj", gate_up)
        store_quantized(routed, "down_proj", down)
        for lin, start in ((shared.gate_proj, 0), (shared.up_proj, i)):
            half = row_slice(shared_gu.expert(0), start, start + i)
            assert isinstance(half, QuantizedWeight)
            store_quantized(lin, "weight", half)
        store_quantized(shared.down_proj, "weight", shared_down.expert(0))
        if backend == "triton":
            routed.fold_shared(shared)
            assert routed.folded
            stacked = module_weight(routed, "gate_up_proj")
            assert isinstance(stacked, QuantizedWeight) and stacked.data.shape[0] == e
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
