"""Expert stacks with one expert in another format (`MixedExperts`: V4.1's FP8 shared expert beside
its MXFP4 routed experts) through the per-token and the sorted MoE paths.

The references get one stack of every expert dequantised (exact), the extra expert last, so the
only difference is the fp32 summation order: CHAIN_TOL, as for a quantised stack of one format.
Against each other the two paths form every product with the same K steps (the extra expert's
with its own format's), so on a GPU they give the same bits; the CPU interpreter's dot is
numpy's matmul, whose sums depend on the tile shape, so there within CHAIN_TOL. Outputs are
poisoned with NaN first. (The layer that folds a shared expert of another format is tested
with the same-format fold, `test_quantized_gemm.py`.)
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.linear.reference import QuantizedWeight, dequantize_weight_ref
from sgl_dspark.kernels.moe.grouped_gemm import fused_moe
from sgl_dspark.kernels.moe.reduce import moe_reduce
from sgl_dspark.kernels.moe.reference import (
    MixedExperts,
    fused_moe_ref,
    moe_route_gate_up_ref,
    moe_token_down_reduce_ref,
)
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort
from sgl_dspark.kernels.moe.token_down import moe_token_down_reduce
from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up
from test_moe_grouped_gemm import CHAIN_TOL, pytestmark  # noqa: F401
from test_quantized_gemm import DEVICE, _experts, _same_bits

DTYPE = torch.bfloat16


def _stacks(
    routed_fmt: str, extra_fmt: str, e: int, d: int, i: int, g: torch.Generator
) -> tuple[MixedExperts, MixedExperts, torch.Tensor, torch.Tensor]:
    """(gate_up, down) as `MixedExperts` of e routed experts in `routed_fmt` and one extra in
    `extra_fmt` ("bf16": unquantised), and the same e + 1 experts dequantised as one stack."""
    gate_up, down = _experts(routed_fmt, 32, e, d, i, g)
    if extra_fmt == "bf16":
        x_gate_up = (torch.randn(1, 2 * i, d, generator=g) * 3 * d**-0.5).to(DTYPE).to(DEVICE)
        x_down = (torch.randn(1, d, i, generator=g) * i**-0.5).to(DTYPE).to(DEVICE)
    else:
        x_gate_up, x_down = _experts(extra_fmt, 32, 1, d, i, g)

    def dense(w: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        return dequantize_weight_ref(w, DTYPE) if isinstance(w, QuantizedWeight) else w

    return (
        MixedExperts(gate_up, x_gate_up),
        MixedExperts(down, x_down),
        torch.cat((dense(gate_up), dense(x_gate_up))),
        torch.cat((dense(down), dense(x_down))),
    )


# (routed format, extra format, M, topk routed, E routed, D, I). The extra expert is the last
# slot of every token (the router's appended shared column), except with "no_extra" routing
# and "shared_rolled" (token t's at slot t mod topk + 1).
MIXED_CASES = [
    ("mxfp4", "fp8", 1, 2, 4, 96, 64, "shared_last"),
    ("mxfp4", "fp8", 2, 3, 5, 288, 40, "shared_last"),  # D: two K steps; I: partial tiles
    ("fp8", "mxfp4", 1, 2, 3, 160, 48, "shared_last"),
    ("mxfp4", "bf16", 3, 2, 4, 64, 32, "shared_last"),
    ("mxfp4", "fp8", 2, 2, 4, 64, 32, "no_extra"),  # no token routed to the extra expert
    ("mxfp4", "fp8", 18, 2, 4, 32, 32, "shared_last"),  # the extra's routes span two blocks
    ("mxfp4", "fp8", 3, 3, 5, 64, 32, "remote"),  # routed experts 1 and 3 on another rank
    ("mxfp4", "fp8", 4, 3, 5, 96, 64, "shared_rolled"),  # the extra expert at every slot
]


def _routes(m: int, topk: int, e: int, routing: str, g: torch.Generator):
    ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :topk]
    weights = torch.rand(m, topk, generator=g)
    if routing in ("shared_last", "shared_rolled"):
        ids = torch.cat((ids, torch.full((m, 1), e)), dim=1)
        weights = torch.cat((weights, torch.ones(m, 1)), dim=1)
    if routing == "shared_rolled":  # token t's slots rolled so that its extra slot is slot t
        ids, weights = (
            torch.stack([row.roll(t + 1) for t, row in enumerate(v)]) for v in (ids, weights)
        )
    return ids.to(torch.int32).contiguous().to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize("case", MIXED_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("before_down", [False, True])
def test_mixed_stacks_match_refs_and_paths(case: tuple, before_down: bool) -> None:
    """Both paths against the references on the dequantised stack, and against each other;
    with the route weight before the down projection (DeepSeek-V4.1) too."""
    routed_fmt, extra_fmt, m, topk, e, d, i, routing = case
    g = torch.Generator().manual_seed(300 + MIXED_CASES.index(case))
    mask = torch.ones(e + 1, dtype=torch.int32)
    if routing == "remote":  # the stack holds the local routed experts only, as on an EP rank
        mask[1:e:2] = 0
    n_loc = int(mask.sum())
    gate_up, down, gu_ref, down_ref = _stacks(routed_fmt, extra_fmt, n_loc - 1, d, i, g)
    ids, weights = _routes(m, topk, e, "shared_last" if routing == "remote" else routing, g)
    slots = ids.shape[1]
    x = torch.randn(m, d, generator=g).to(DTYPE).to(DEVICE)
    mask = mask.to(DEVICE)
    plan = prepare_moe_sort(mask)
    table, limit = plan.local_table, 1.5
    act_w = weights if before_down else None
    # Weighted before the down projection, the routes sum with unit weights: None for the
    # kernels (no tensor read), ones for the references.
    reduce_w = None if before_down else weights
    ref_w = torch.ones_like(weights) if before_down else weights

    poison = torch.full((ids.numel(), i), float("nan"), dtype=DTYPE, device=DEVICE)
    h = moe_route_gate_up(x, gate_up, ids, table, n_loc, limit, poison.clone(), act_w)
    h_ref = moe_route_gate_up_ref(x, gu_ref, ids, table, n_loc, limit, poison.clone(), act_w)
    local = (mask[ids.long()] == 1).reshape(-1)
    assert torch.isnan(h[~local]).all()  # remote routes' rows are left as they were
    torch.testing.assert_close(h[local], h_ref[local], **CHAIN_TOL[DTYPE])
    out = torch.full((m, d), float("nan"), dtype=DTYPE, device=DEVICE)
    got = moe_token_down_reduce(h, down, ids, reduce_w, table, n_loc, out=out)
    want = moe_token_down_reduce_ref(h, down_ref, ids, ref_w, table, n_loc)
    torch.testing.assert_close(got, want, **CHAIN_TOL[DTYPE])

    want_y = fused_moe_ref(x, gu_ref, down_ref, ids, mask, limit, act_w)
    for block_size in (16, 32):
        sort = moe_sort(ids, weights, plan, 0, block_size=block_size)
        y = torch.full((m, slots, d), float("nan"), dtype=DTYPE, device=DEVICE)
        y = fused_moe(
            x, gate_up, down, sort, slots, limit, block_size, y, weight_before_down=before_down
        )
        routed = local.view(m, slots)
        assert torch.isnan(y[~routed]).all()
        torch.testing.assert_close(y[routed], want_y[routed], **CHAIN_TOL[DTYPE])
        _same_bits(got, moe_reduce(y, reduce_w, ids, mask, 1.0, None), DTYPE)


def test_mixed_stacks_are_checked() -> None:
    g = torch.Generator().manual_seed(9)
    gate_up, down, _, _ = _stacks("mxfp4", "fp8", 3, 64, 32, g)
    x = torch.randn(1, 64, generator=g).to(DTYPE).to(DEVICE)
    ids, _ = _routes(1, 2, 3, "shared_last", g)
    table = prepare_moe_sort(torch.ones(5, dtype=torch.int32, device=DEVICE)).local_table
    wrong_rows = gate_up._replace(extra=down.extra)  # [1, D, I]: not the stack's 2I rows
    with pytest.raises(ValueError, match="gate_up_proj.extra"):
        moe_route_gate_up(x, wrong_rows, ids, table, 4, 1.5)
    # Local ids past the extra expert's would have no weight.
    with pytest.raises(ValueError, match=r"gate_up_proj.stack must .* \[>= 4 experts"):
        moe_route_gate_up(x, gate_up, ids, table, 5, 1.5)
