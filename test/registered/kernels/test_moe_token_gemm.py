"""Per-route stage 1 (activation epilogue) and per-token stage 2 (route-reduce epilogue) vs their
references and
vs the sorted path they replace at small M (`fused_moe` -> `moe_reduce`).

Tolerances: against the references (torch's matmul) a tolerance, as `test_moe_grouped_gemm.py`: bf16
products round once, so a single GEMM differs by <= 1 bf16 ulp; through the activation and the
reduce a few ulps (2^-6). Against the sorted path the products are the same chunked dot sums: on
CUDA the bits must be equal (the engine picks the path by token count, and graph tests compare
tokens); the CPU interpreter's dot is numpy's fp32 matmul, whose sums depend on the tile shape, so
there a product may differ by an fp32 rounding, i.e. one bf16 ulp after rounding (CHAIN_TOL).
Outputs are poisoned with NaN before each run; rows of remote routes must keep their poison.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.moe.grouped_gemm import fused_moe, moe_grouped_gemm
from sgl_dspark.kernels.moe.reduce import moe_reduce
from sgl_dspark.kernels.moe.reference import moe_route_gate_up_ref, moe_token_down_reduce_ref
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort
from sgl_dspark.kernels.moe.token_down import moe_token_down_reduce
from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up

# The grouped GEMMs' tolerance class and interpreter warning filters (the same kernels' maths).
from test_moe_grouped_gemm import CHAIN_TOL, pytestmark  # noqa: E402, F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = DEVICE == "cuda"


def _mask(kind: str, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "all_local":
        return torch.ones(num_experts, dtype=torch.int32)
    if kind == "none_local":
        return torch.zeros(num_experts, dtype=torch.int32)
    mask = (torch.rand(num_experts, generator=gen) < 0.5).to(torch.int32)
    mask[0] = 1
    return mask


def _case(
    num_tokens: int,
    topk: int,
    num_experts: int,
    hidden: int,
    inter: int,
    mask_kind: str,
    routing: str,
    dtype: torch.dtype,
    seed: int,
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mask = _mask(mask_kind, num_experts, gen)
    plan = prepare_moe_sort(mask.to(DEVICE))
    num_local = max(plan.num_local, 1)  # weights for one expert even when none is local
    if routing == "fills":  # ids -1 and E: out of range, remote
        ids = torch.randint(-1, num_experts + 1, (num_tokens, topk), generator=gen)
    elif routing == "repeat":  # a token's slots on one expert (duplicate ids are summed)
        ids = torch.randint(0, num_experts, (num_tokens, 1), generator=gen).expand(-1, topk)
    else:
        ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :topk]
    weights = torch.rand(num_tokens, topk, generator=gen)
    weights[torch.rand(num_tokens, topk, generator=gen) < 0.1] = 0.0

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)

    return dict(
        x=randn(num_tokens, hidden),
        gate_up=randn(num_local, 2 * inter, hidden, scale=3 * hidden**-0.5),  # clamps hit
        down=randn(num_local, hidden, inter, scale=inter**-0.5),
        shared=randn(num_tokens, hidden),
        ids=ids.to(torch.int32).contiguous().to(DEVICE),
        weights=weights.to(DEVICE),
        mask=mask.to(DEVICE),
        plan=plan,
        num_local=plan.num_local,
    )


def _is_local(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    known = (ids >= 0) & (ids < mask.numel())
    return known & (mask.long()[ids.long().clamp(0, mask.numel() - 1)] == 1)


def _sorted_path(
    c: dict, limit: float | None, routed_scale: float, shared: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the per-token path replaces: (stage 1's rows, the reduce's output) through `moe_sort`."""
    topk = c["ids"].shape[1]
    sort = moe_sort(c["ids"], c["weights"], c["plan"], 0)
    y = fused_moe(c["x"], c["gate_up"], c["down"], sort, topk, limit)
    out = moe_reduce(y, c["weights"], c["ids"], c["mask"], routed_scale, shared)
    # Stage 1 alone, to compare h: the grouped GEMM with the activation epilogue, as fused_moe
    # runs it.
    routes = c["ids"].numel()
    h = torch.full(
        (routes, c["gate_up"].shape[1] // 2), float("nan"), dtype=c["x"].dtype, device=DEVICE
    )
    moe_grouped_gemm(
        c["x"],
        c["gate_up"],
        sort.sorted_ids,
        sort.sorted_expert_ids,
        sort.num_valid,
        topk,
        out=h,
        out_swiglu=True,
        swiglu_limit=limit,
    )
    return h, out


def _assert_close_or_equal(got: torch.Tensor, want: torch.Tensor, exact: bool, tol: dict) -> None:
    if exact:
        bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits)), "bits differ from the sorted path"
    else:
        torch.testing.assert_close(got, want, **tol)


CASES = [
    # M, topk, E, D, I, mask, routing
    (1, 6, 64, 64, 32, "all_local", "topk"),
    (1, 2, 8, 160, 48, "random", "topk"),  # D = 160: two K chunks of stage 1, a partial D tile
    (4, 6, 16, 96, 40, "random", "fills"),  # I = 40: partial tiles of both stages
    (7, 3, 8, 128, 272, "all_local", "repeat"),  # I = 272: three K chunks of stage 2
    (16, 4, 12, 48, 16, "random", "topk"),
    (3, 2, 6, 32, 32, "none_local", "topk"),  # every route remote: out = shared
    (5, 1, 4, 64, 64, "all_local", "topk"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_stages_match_refs_and_sorted_path(case: tuple, dtype: torch.dtype) -> None:
    num_tokens, topk, num_experts, hidden, inter, mask_kind, routing = case
    c = _case(*case, dtype=dtype, seed=10 * CASES.index(case) + int(dtype == torch.float32))
    limit, scale = 1.5, 1.25
    ids, table, n_loc = c["ids"], c["plan"].local_table, c["num_local"]
    local = _is_local(ids, c["mask"]).reshape(-1)

    poison = torch.full((ids.numel(), inter), float("nan"), dtype=dtype, device=DEVICE)
    h = moe_route_gate_up(c["x"], c["gate_up"], ids, table, n_loc, limit, h=poison.clone())
    h_ref = moe_route_gate_up_ref(c["x"], c["gate_up"], ids, table, n_loc, limit, h=poison.clone())
    assert torch.isnan(h[~local]).all(), "a remote route's row was written"
    assert not torch.isnan(h[local]).any(), "a local route's row was not written"
    torch.testing.assert_close(h[local], h_ref[local], **CHAIN_TOL[dtype])

    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=DEVICE)
    got = moe_token_down_reduce(
        h, c["down"], ids, c["weights"], table, n_loc, scale, c["shared"], out=out
    )
    assert got is out and not torch.isnan(got).any()
    want = moe_token_down_reduce_ref(
        h, c["down"], ids, c["weights"], table, n_loc, scale, c["shared"]
    )
    torch.testing.assert_close(got, want, **CHAIN_TOL[dtype])

    h_sorted, out_sorted = _sorted_path(c, limit, scale, c["shared"])
    _assert_close_or_equal(h[local], h_sorted[local], EXACT, CHAIN_TOL[dtype])
    _assert_close_or_equal(got, out_sorted, EXACT, CHAIN_TOL[dtype])
    if mask_kind == "none_local":
        assert torch.equal(got, c["shared"]), "no local route: out must be the shared expert"


@pytest.mark.parametrize("shared,scale", [(False, 1.0), (True, 1.0), (False, 1.5)])
def test_down_reduce_options(shared: bool, scale: float) -> None:
    """Without the shared add, with and without the routed scale: the reduce tail's branches."""
    c = _case(5, 3, 8, 64, 48, "random", "topk", torch.bfloat16, seed=11)
    ids, table, n_loc = c["ids"], c["plan"].local_table, c["num_local"]
    h = moe_route_gate_up(c["x"], c["gate_up"], ids, table, n_loc, None)
    args = (h, c["down"], ids, c["weights"], table, n_loc, scale, c["shared"] if shared else None)
    got = moe_token_down_reduce(*args)
    torch.testing.assert_close(got, moe_token_down_reduce_ref(*args), **CHAIN_TOL[torch.bfloat16])
    _, out_sorted = _sorted_path(c, None, scale, c["shared"] if shared else None)
    _assert_close_or_equal(got, out_sorted, EXACT, CHAIN_TOL[torch.bfloat16])


def test_rows_do_not_depend_on_m() -> None:
    """A token's output and its routes' h rows are the same bits whatever tokens share the call
    (one program per route / token; nothing sums across tokens)."""
    c = _case(9, 4, 16, 96, 64, "random", "topk", torch.bfloat16, seed=3)
    ids, table, n_loc = c["ids"], c["plan"].local_table, c["num_local"]
    h = moe_route_gate_up(c["x"], c["gate_up"], ids, table, n_loc, 2.0)
    out = moe_token_down_reduce(h, c["down"], ids, c["weights"], table, n_loc, 1.0, c["shared"])
    for lo, hi in ((0, 1), (3, 7), (8, 9)):
        h_part = moe_route_gate_up(
            c["x"][lo:hi], c["gate_up"], ids[lo:hi].contiguous(), table, n_loc, 2.0
        )
        routes = slice(lo * 4, hi * 4)
        local = _is_local(ids[lo:hi], c["mask"]).reshape(-1)
        assert torch.equal(h_part[local], h[routes][local])
        part = moe_token_down_reduce(
            h[routes].contiguous(),
            c["down"],
            ids[lo:hi].contiguous(),
            c["weights"][lo:hi].contiguous(),
            table,
            n_loc,
            1.0,
            c["shared"][lo:hi].contiguous(),
        )
        assert torch.equal(part, out[lo:hi])


def test_remote_rows_of_h_are_never_read() -> None:
    """NaN in remote routes' h rows (what stage 1 leaves there) must not reach the output."""
    c = _case(4, 4, 8, 64, 32, "random", "fills", torch.bfloat16, seed=5)
    ids, table, n_loc = c["ids"], c["plan"].local_table, c["num_local"]
    h = moe_route_gate_up(c["x"], c["gate_up"], ids, table, n_loc, 2.0)
    local = _is_local(ids, c["mask"]).reshape(-1)
    assert (~local).any() and local.any()
    h[~local] = float("nan")
    got = moe_token_down_reduce(h, c["down"], ids, c["weights"], table, n_loc, 1.0, c["shared"])
    assert not torch.isnan(got).any()
    h[~local] = 7.0
    assert torch.equal(
        got, moe_token_down_reduce(h, c["down"], ids, c["weights"], table, n_loc, 1.0, c["shared"])
    )


def test_hand_derived() -> None:
    """Experts 0 and 2 local (local ids 0, 1); token 0 -> (2, 1), token 1 -> (0, 2); no clamp
    reached. The down weights pick single h columns, so the sums are exact."""
    mask = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    plan = prepare_moe_sort(mask)
    ids = torch.tensor([[2, 1], [0, 2]], dtype=torch.int32, device=DEVICE)
    h = torch.zeros(4, 16, device=DEVICE)
    h[:, 0] = torch.tensor([1.0, 99.0, 2.0, -3.0], device=DEVICE)  # route 1 is remote
    down = torch.zeros(2, 16, 16, device=DEVICE)
    down[0, 5, 0] = 2.0  # local 0 (expert 0): out column 5 = 2 * h[:, 0]
    down[1, 7, 0] = -1.0  # local 1 (expert 2): out column 7 = -h[:, 0]
    weights = torch.tensor([[0.5, 4.0], [0.25, 2.0]], device=DEVICE)
    shared = torch.ones(2, 16, device=DEVICE)
    out = moe_token_down_reduce(
        h, down, ids, weights, plan.local_table, plan.num_local, 2.0, shared
    )
    want = torch.ones(2, 16)
    want[0, 7] += 2.0 * (0.5 * -1.0)  # token 0: slot 0 = expert 2 on h row 0; slot 1 remote
    want[1, 5] += 2.0 * (0.25 * 2.0 * 2.0)  # token 1: slot 0 = expert 0 on h row 2
    want[1, 7] += 2.0 * (2.0 * 3.0)  # slot 1 = expert 2 on h row 3
    assert torch.equal(out.cpu(), want)


def test_empty_and_bad_arguments() -> None:
    c = _case(2, 2, 4, 32, 16, "all_local", "topk", torch.bfloat16, seed=1)
    ids, table, n_loc = c["ids"], c["plan"].local_table, c["num_local"]
    h = moe_route_gate_up(c["x"][:0], c["gate_up"], ids[:0], table, n_loc, 1.0)
    assert h.shape == (0, 16)
    assert moe_token_down_reduce(h, c["down"], ids[:0], c["weights"][:0], table, n_loc).shape == (
        0,
        32,
    )
    with pytest.raises(ValueError, match="ids"):
        moe_route_gate_up(c["x"], c["gate_up"], ids.long(), table, n_loc, 1.0)
    with pytest.raises(ValueError, match="gate_up_proj"):
        moe_route_gate_up(c["x"], c["gate_up"].float(), ids, table, n_loc, 1.0)
    with pytest.raises(ValueError, match="limit"):
        moe_route_gate_up(c["x"], c["gate_up"], ids, table, n_loc, 0.0)
    with pytest.raises(ValueError, match="num_local"):
        moe_route_gate_up(c["x"], c["gate_up"], ids, table, 9, 1.0)
    h = moe_route_gate_up(c["x"], c["gate_up"], ids, table, n_loc, 1.0)
    with pytest.raises(ValueError, match="weights"):
        moe_token_down_reduce(h, c["down"], ids, c["weights"].double(), table, n_loc)
    with pytest.raises(ValueError, match="shared"):
        moe_token_down_reduce(h, c["down"], ids, c["weights"], table, n_loc, 1.0, c["shared"][:1])
    with pytest.raises(ValueError, match="h has"):
        moe_token_down_reduce(h[:3], c["down"], ids, c["weights"], table, n_loc)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]])
def test_weight_before_down_matches_ref_and_sorted_path(case: tuple) -> None:
    """DeepSeek-V4.1: stage 1 scales each route's activation by its weight (rounded as stored);
    stage 2 then sums the routes with unit weights, as the sorted path does."""
    dtype = torch.bfloat16
    c = _case(*case, dtype=dtype, seed=7 * CASES.index(case) + 1)
    num_tokens, topk, hidden = c["ids"].shape[0], c["ids"].shape[1], c["x"].shape[1]
    ids, table, n_loc, w = c["ids"], c["plan"].local_table, c["num_local"], c["weights"]
    local = _is_local(ids, c["mask"]).reshape(-1)
    inter = c["gate_up"].shape[1] // 2
    poison = torch.full((ids.numel(), inter), float("nan"), dtype=dtype, device=DEVICE)
    h = moe_route_gate_up(c["x"], c["gate_up"], ids, table, n_loc, 1.5, poison.clone(), w)
    h_ref = moe_route_gate_up_ref(c["x"], c["gate_up"], ids, table, n_loc, 1.5, poison.clone(), w)
    assert torch.isnan(h[~local]).all()
    torch.testing.assert_close(h[local], h_ref[local], **CHAIN_TOL[dtype])
    ones = torch.ones_like(w)
    got = moe_token_down_reduce(h, c["down"], ids, ones, table, n_loc, 1.0, c["shared"])
    sort = moe_sort(ids, w, c["plan"], 0)
    y = fused_moe(c["x"], c["gate_up"], c["down"], sort, topk, 1.5, weight_before_down=True)
    out_sorted = moe_reduce(y, ones, ids, c["mask"], 1.0, c["shared"])
    assert got.shape == (num_tokens, hidden)
    _assert_close_or_equal(got, out_sorted, EXACT, CHAIN_TOL[dtype])
    # Unit weights passed as None (what the engine passes): no tensor of ones read, same bits.
    unit = moe_token_down_reduce(h, c["down"], ids, None, table, n_loc, 1.0, c["shared"])
    assert torch.equal(unit.view(torch.int16), got.view(torch.int16))
    unit_sorted = moe_reduce(y, None, ids, c["mask"], 1.0, c["shared"])
    assert torch.equal(unit_sorted.view(torch.int16), out_sorted.view(torch.int16))
