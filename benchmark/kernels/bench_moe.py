"""Benchmark cases for the MoE kernels: sort, router, route reduce, clamped SwiGLU and the
grouped expert GEMMs.

``CASES`` is a list of dicts with keys:
    name         str
    make_inputs  (M, device) -> dict of keyword arguments, at DeepSeek-V4-Flash decode shapes
    reference    (**inputs) -> output   (unfused torch, graph-capturable)
    launcher     (**inputs) -> output   (the Triton launcher; graph-capturable)
    check        (reference_output, launcher_output) -> None, raises AssertionError on mismatch
    bytes_moved  (M) -> int, the minimal HBM traffic of the fused op (bandwidth floor)
Shapes: H = 4096, E = 384 with the 96 experts of EP rank 1 of 4 local, top-6, routed I = 2048,
shared expert I = 512 per TP rank. M = token rows of the step.

The sort's reference here is a vectorised torch sort (no host syncs, so it can be graph-captured and
compiled); `moe_sort_ref`, the per-expert loop that specifies the op, is what the tests use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
from sgl_dspark.kernels.moe.activation import silu_mul_clamp
from sgl_dspark.kernels.moe.grouped_gemm import fused_moe
from sgl_dspark.kernels.moe.reduce import moe_reduce
from sgl_dspark.kernels.moe.reference import (
    Fp8Activation,
    MoeSortOutput,
    RouterConfig,
    moe_reduce_ref,
    moe_sort_capacity,
    router_topk_ref,
    silu_mul_clamp_ref,
)
from sgl_dspark.kernels.moe.router import make_router_workspace, router_topk
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort
from sgl_dspark.kernels.moe.token_down import moe_token_down_reduce
from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up
from sgl_dspark.srt.layers.moe.experts import TOKEN_PATH_MAX_M

HIDDEN, EXPERTS, LOCAL, TOPK, INTER, SHARED_INTER = 4096, 384, 96, 6, 2048, 512
SPLITS = HIDDEN // 512
BLOCK = 32
ROUTED_SCALE = 1.5


def _gen(m: int) -> torch.Generator:
    return torch.Generator().manual_seed(4321 + m)


def _ep_mask(device: str) -> torch.Tensor:
    mask = torch.zeros(EXPERTS, dtype=torch.int32)
    mask[LOCAL : 2 * LOCAL] = 1
    return mask.to(device)


def _topk_ids(m: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(m, EXPERTS, generator=gen).argsort(dim=1)[:, :TOPK].to(torch.int32)


def _local_rows(m: int) -> int:
    return triton.cdiv(m * TOPK * LOCAL, EXPERTS)  # expected local routes per rank


# ----------------------------------------------------------------------------- moe_sort


def _sort_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    mask = _ep_mask(device)
    return dict(
        topk_ids=_topk_ids(m, gen).to(device),
        topk_weights=torch.rand(m, TOPK, generator=gen).to(device),
        expert_mask=mask,
        plan=prepare_moe_sort(mask),  # host read: once per mask, outside the timed region
        hidden_size=HIDDEN,
    )


def _sort_torch(topk_ids, topk_weights, expert_mask, plan, hidden_size) -> MoeSortOutput:
    """Sync-free torch version of `moe_sort_ref` (same outputs on the valid prefix)."""
    num_tokens, topk = topk_ids.shape
    num_local = plan.num_local
    device = topk_ids.device
    capacity = moe_sort_capacity(num_tokens, topk, expert_mask.numel(), BLOCK)
    is_local = expert_mask.long()
    local_id = torch.cumsum(is_local, 0) - is_local
    flat = topk_ids.reshape(-1).long()
    key = torch.where(is_local[flat] == 1, local_id[flat], torch.full_like(flat, num_local))
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_local]  # bincount syncs
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    starts = torch.cumsum(padded, 0) - padded
    compact_starts = torch.cumsum(counts, 0) - counts
    live = sorted_key < num_local
    safe_key = sorted_key.clamp(max=num_local - 1)
    rank = torch.arange(flat.numel(), device=device) - compact_starts[safe_key]
    dest = torch.where(live, starts[safe_key] + rank, torch.full_like(rank, capacity))
    packed = ((order % topk) << 24) | (order // topk)
    sentinel = (topk << 24) | num_tokens
    sorted_ids = torch.full((capacity + 1,), sentinel, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, dest, packed)
    sorted_weights = torch.zeros(capacity + 1, dtype=torch.float32, device=device)
    sorted_weights.scatter_(0, dest, topk_weights.reshape(-1)[order])
    block_starts = torch.arange(triton.cdiv(capacity, BLOCK), device=device) * BLOCK
    block_expert = torch.searchsorted(torch.cumsum(padded, 0), block_starts, right=True)
    total = padded.sum()
    num_valid = torch.stack([total, torch.full_like(total, num_tokens)]).to(torch.int32)
    moe_buf = torch.zeros(num_tokens, hidden_size, dtype=torch.bfloat16, device=device)
    return MoeSortOutput(
        sorted_ids[:capacity].to(torch.int32),
        sorted_weights[:capacity],
        block_expert.to(torch.int32),
        num_valid,
        moe_buf,
    )


def _sort_launch(topk_ids, topk_weights, expert_mask, plan, hidden_size) -> MoeSortOutput:
    return moe_sort(topk_ids, topk_weights, plan, hidden_size)


def _sort_check(want: MoeSortOutput, got: MoeSortOutput) -> None:
    assert torch.equal(want.num_valid, got.num_valid), "num_valid differs"
    valid = int(want.num_valid[0])
    assert torch.equal(want.sorted_ids[:valid], got.sorted_ids[:valid]), "sorted_ids differ"
    assert torch.equal(want.sorted_weights[:valid], got.sorted_weights[:valid]), "weights differ"
    blocks = valid // BLOCK
    assert torch.equal(want.sorted_expert_ids[:blocks], got.sorted_expert_ids[:blocks])
    assert torch.equal(want.moe_buf, got.moe_buf), "moe_buf not zeroed"


def _sort_bytes(m: int) -> int:
    local = _local_rows(m)
    padded_entries = local + (BLOCK - 1) * min(LOCAL, local)
    return 8 * m * TOPK + 4 * EXPERTS + 8 * padded_entries + 2 * m * HIDDEN


# ----------------------------------------------------------------------------- router_topk


def _route_x_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    return dict(
        config=RouterConfig(TOPK, routed_scaling_factor=ROUTED_SCALE),
        x=torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16).to(device),
        gate_weight=(torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.02)
        .to(torch.bfloat16)
        .to(device),
        correction_bias=(torch.randn(EXPERTS, generator=gen) * 0.1).to(device),
        n_valid=torch.tensor(max(m - 1, 1), dtype=torch.int32, device=device),
        workspace=make_router_workspace(m, EXPERTS, HIDDEN, device),
    )


def _route_partials_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    return dict(
        config=RouterConfig(TOPK, routed_scaling_factor=ROUTED_SCALE, num_shared=1),
        partials=(torch.randn(SPLITS, m, EXPERTS, generator=gen) * 0.5).to(device),
        correction_bias=(torch.randn(EXPERTS, generator=gen) * 0.1).to(device),
        n_valid=torch.tensor(max(m - 1, 1), dtype=torch.int32, device=device),
        logits_out=torch.empty(m, EXPERTS, device=device),
    )


def _route_hash_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    vocab = 129280
    return dict(
        config=RouterConfig(TOPK, routed_scaling_factor=ROUTED_SCALE),
        logits=torch.randn(m, EXPERTS, generator=gen).to(device),
        tid2eid=torch.randint(0, EXPERTS, (vocab, TOPK), generator=gen, dtype=torch.int32).to(
            device
        ),
        input_ids=torch.randint(0, vocab, (m,), generator=gen).to(device),
        n_valid=torch.tensor(m, dtype=torch.int32, device=device),
    )


def _route_hash_x_inputs(m: int, device: str) -> dict[str, Any]:
    """Hash routing as the engine's hash layers call it: gate logits from x inside the launch
    (the GEMV), experts from the token's tid2eid row."""
    inputs = _route_x_inputs(m, device)
    hashed = _route_hash_inputs(m, device)
    del inputs["correction_bias"], inputs["workspace"]
    return {
        **inputs,
        "tid2eid": hashed["tid2eid"],
        "input_ids": hashed["input_ids"],
        "workspace": make_router_workspace(m, EXPERTS, HIDDEN, device),
    }


def _route_check(want: Any, got: Any) -> None:
    """Ids exact except where two experts' selection values are within the score transcendentals'
    error (exp2/log2 lowerings, and bf16-GEMV summation order for the x source); weights ~1e-4."""
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-4, atol=1e-6)
    differs = (got.ids != want.ids).any(dim=1)
    assert int(differs.sum()) <= max(1, got.ids.shape[0] // 32), "too many rows with other ids"


def _route_x_bytes(m: int) -> int:
    return 2 * m * HIDDEN + 2 * EXPERTS * HIDDEN + 4 * EXPERTS + 8 * m * TOPK


def _route_partials_bytes(m: int) -> int:
    return 4 * SPLITS * m * EXPERTS + 4 * m * EXPERTS + 4 * EXPERTS + 8 * m * (TOPK + 1)


def _route_hash_bytes(m: int) -> int:
    return 4 * m * EXPERTS + 8 * m + 4 * m * TOPK + 8 * m * TOPK


# ----------------------------------------------------------------------------- moe_reduce


def _reduce_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    return dict(
        y=torch.randn(m, TOPK, HIDDEN, generator=gen).to(torch.bfloat16).to(device),
        topk_weights=torch.rand(m, TOPK, generator=gen).to(device),
        topk_ids=_topk_ids(m, gen).to(device),
        expert_mask=_ep_mask(device),
        routed_scale=ROUTED_SCALE,
        shared=torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16).to(device),
    )


def _check_equal(want: torch.Tensor, got: torch.Tensor) -> None:
    assert torch.equal(want, got), "outputs differ"


def _reduce_bytes(m: int) -> int:
    return 2 * _local_rows(m) * HIDDEN + 2 * 2 * m * HIDDEN + 8 * m * TOPK + 4 * EXPERTS


# ----------------------------------------------------------------------------- silu_mul_clamp


def _act_shared_inputs(m: int, device: str) -> dict[str, Any]:
    gate_up = torch.randn(m, 2 * SHARED_INTER, generator=_gen(m)) * 4
    return dict(gate_up=gate_up.to(torch.bfloat16).to(device), limit=10.0)


def _act_routed_inputs(m: int, device: str) -> dict[str, Any]:
    gate_up = torch.randn(_local_rows(m), 2 * INTER, generator=_gen(m)) * 4
    return dict(
        gate_up=gate_up.to(torch.bfloat16).to(device),
        limit=10.0,
        out_format="fp8_group",
        scale_ue8m0=True,
    )


def _act_check(want: Any, got: Any) -> None:
    """A tolerance (exp2 lowering): ≤ 0.1% of bf16 outputs / fp8 codes differ, bf16 by one ulp."""
    if isinstance(want, Fp8Activation):
        same = got.q.float() == want.q.float()
        assert same.float().mean() >= 0.999, "fp8 codes differ"
        torch.testing.assert_close(got.scale, want.scale, rtol=2**-7, atol=0)
        return
    flips = got != want
    assert flips.float().mean() <= 1e-3, "too many bf16 flips"
    ulp = torch.finfo(torch.bfloat16).eps * want[flips].float().abs()
    assert ((got[flips].float() - want[flips].float()).abs() <= ulp * 1.01).all()


def _act_shared_bytes(m: int) -> int:
    return m * (2 * SHARED_INTER * 2 + SHARED_INTER * 2)


def _act_routed_bytes(m: int) -> int:
    rows = _local_rows(m)
    return rows * (2 * INTER * 2 + INTER + 4 * INTER // 128)


# ----------------------------------------------------------------------------- grouped expert GEMMs


@functools.lru_cache(maxsize=1)
def _expert_weights(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The 96 local experts' bf16 weights (4.8 GB), made once on the device, shared by every M."""
    gen = torch.Generator(device=device).manual_seed(99)
    gate_up = torch.randn(
        LOCAL, 2 * INTER, HIDDEN, generator=gen, device=device, dtype=torch.bfloat16
    ) * (3 * HIDDEN**-0.5)  # |gate/up| ~ 3: clamps hit
    down = (
        torch.randn(LOCAL, HIDDEN, INTER, generator=gen, device=device, dtype=torch.bfloat16)
        * INTER**-0.5
    )
    return gate_up, down


def _experts_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    mask = _ep_mask(device)
    topk_ids = _topk_ids(m, gen).to(device)
    gate_up, down = _expert_weights(device)
    # The sort runs here, outside the timed region: it has its own case above.
    weights = torch.rand(m, TOPK, generator=gen).to(device)
    sort = moe_sort(topk_ids, weights, prepare_moe_sort(mask), 0)
    return dict(
        x=torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16).to(device),
        gate_up_proj=gate_up,
        down_proj=down,
        sort=sort,
        topk_ids=topk_ids,
        expert_mask=mask,
        limit=10.0,
    )


def _experts_torch(x, gate_up_proj, down_proj, sort, topk_ids, expert_mask, limit) -> torch.Tensor:
    """Sync-free torch: every local expert over all M rows (dense, 64x the routed FLOPs at EP4),
    then each route picks its expert's row; NaN for remote routes (rows fused_moe leaves alone)."""
    num_tokens = x.shape[0]
    ids = topk_ids.long()
    is_local = expert_mask.long()
    local_ids = (torch.cumsum(is_local, 0) - is_local)[ids].clamp(max=LOCAL - 1)
    gate_up = torch.matmul(x, gate_up_proj.transpose(1, 2))  # [E_loc, M, 2I], fp32 accumulate
    h = silu_mul_clamp_ref(gate_up.reshape(-1, 2 * INTER), limit)
    y_all = torch.matmul(h.reshape(LOCAL, num_tokens, INTER), down_proj.transpose(1, 2))
    y = y_all[local_ids, torch.arange(num_tokens, device=x.device)[:, None]]  # [M, topk, H]
    return torch.where((is_local[ids] == 1)[..., None], y, float("nan"))


def _experts_launch(x, gate_up_proj, down_proj, sort, topk_ids, expert_mask, limit) -> torch.Tensor:
    return fused_moe(x, gate_up_proj, down_proj, sort, TOPK, limit)


def _experts_check(want: torch.Tensor, got: torch.Tensor) -> None:
    """bf16, a tolerance: GEMM summation order and the activation's exp2 flip single bf16 ulps;
    local routes only."""
    local = ~torch.isnan(want).any(dim=-1)
    assert not torch.isnan(got[local]).any(), "a local route was not written"
    torch.testing.assert_close(got[local], want[local], rtol=2**-6, atol=2**-6)


def _experts_bytes(m: int) -> int:
    routes = _local_rows(m)
    experts_hit = LOCAL * (1.0 - (1.0 - 1.0 / LOCAL) ** routes)  # expected distinct local experts
    weights = experts_hit * 3 * INTER * HIDDEN * 2
    activations = 2 * m * HIDDEN + routes * (2 * INTER + INTER) * 2 * 2 + routes * HIDDEN * 2
    return int(weights + activations)


# ------------------------------------------------------------- moe_token_down_reduce


def _token_experts_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    mask = _ep_mask(device)
    topk_ids = _topk_ids(m, gen).to(device)
    gate_up, down = _expert_weights(device)
    plan = prepare_moe_sort(mask)
    return dict(
        x=torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16).to(device),
        gate_up_proj=gate_up,
        down_proj=down,
        topk_ids=topk_ids,
        topk_weights=torch.rand(m, TOPK, generator=gen).to(device),
        shared=torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16).to(device),
        expert_mask=mask,
        sort_plan=plan,
        limit=10.0,
    )


def _token_experts_torch(
    x, gate_up_proj, down_proj, topk_ids, topk_weights, shared, expert_mask, sort_plan, limit
) -> torch.Tensor:
    """The unfused chain: sync-free dense experts (`_experts_torch`), then `moe_reduce_ref`."""
    y = _experts_torch(x, gate_up_proj, down_proj, None, topk_ids, expert_mask, limit)
    return moe_reduce_ref(y, topk_weights, topk_ids, expert_mask, ROUTED_SCALE, shared)


def _token_experts_launch(
    x, gate_up_proj, down_proj, topk_ids, topk_weights, shared, expert_mask, sort_plan, limit
) -> torch.Tensor:
    """As `RoutedExperts` dispatches: the reduce as the per-token stage 2's epilogue up to
    TOKEN_PATH_MAX_M tokens, above that `moe_sort` -> grouped GEMMs -> `moe_reduce`."""
    if x.shape[0] <= TOKEN_PATH_MAX_M:
        table, num_local = sort_plan.local_table, sort_plan.num_local
        h = moe_route_gate_up(x, gate_up_proj, topk_ids, table, num_local, limit)
        return moe_token_down_reduce(
            h, down_proj, topk_ids, topk_weights, table, num_local, ROUTED_SCALE, shared
        )
    sort = moe_sort(topk_ids, topk_weights, sort_plan, 0)
    y = fused_moe(x, gate_up_proj, down_proj, sort, TOPK, limit)
    return moe_reduce(y, topk_weights, topk_ids, expert_mask, ROUTED_SCALE, shared)


def _token_experts_check(want: torch.Tensor, got: torch.Tensor) -> None:
    """bf16, a tolerance as the grouped case (GEMM order, the activation's exp2), through the
    weighted sum."""
    torch.testing.assert_close(got, want, rtol=2**-5, atol=2**-5)


def _token_experts_bytes(m: int) -> int:
    # The floor is the sorted path's traffic (each hit expert read once; this path reads it once
    # per route, mostly from L2 when routes share it) plus shared in and out.
    return _experts_bytes(m) + 2 * 2 * m * HIDDEN


CASES: list[dict[str, Any]] = [
    dict(
        name="moe_sort (EP4, 96 local)",
        make_inputs=_sort_inputs,
        reference=_sort_torch,
        launcher=_sort_launch,
        check=_sort_check,
        bytes_moved=_sort_bytes,
    ),
    dict(
        name="router_topk from x (GEMV fused)",
        make_inputs=_route_x_inputs,
        reference=router_topk_ref,
        launcher=router_topk,
        check=_route_check,
        bytes_moved=_route_x_bytes,
    ),
    dict(
        name="router_topk from split-K partials",
        make_inputs=_route_partials_inputs,
        reference=router_topk_ref,
        launcher=router_topk,
        check=_route_check,
        bytes_moved=_route_partials_bytes,
    ),
    dict(
        name="router_topk hash",
        make_inputs=_route_hash_inputs,
        reference=router_topk_ref,
        launcher=router_topk,
        check=_route_check,
        bytes_moved=_route_hash_bytes,
    ),
    dict(
        name="router_topk hash from x (GEMV fused)",
        make_inputs=_route_hash_x_inputs,
        reference=router_topk_ref,
        launcher=router_topk,
        check=_route_check,
        bytes_moved=lambda m: _route_x_bytes(m) - 4 * EXPERTS + 4 * m * TOPK,
    ),
    dict(
        name="moe_reduce (slot-ordered)",
        make_inputs=_reduce_inputs,
        reference=moe_reduce_ref,
        launcher=moe_reduce,
        check=_check_equal,
        bytes_moved=_reduce_bytes,
    ),
    dict(
        name="silu_mul_clamp shared (I=512, bf16)",
        make_inputs=_act_shared_inputs,
        reference=silu_mul_clamp_ref,
        launcher=silu_mul_clamp,
        check=_act_check,
        bytes_moved=_act_shared_bytes,
    ),
    dict(
        name="silu_mul_clamp routed (I=2048, fp8 group)",
        make_inputs=_act_routed_inputs,
        reference=silu_mul_clamp_ref,
        launcher=silu_mul_clamp,
        check=_act_check,
        bytes_moved=_act_routed_bytes,
    ),
    dict(
        name="fused_moe stage 1 with the activation epilogue + stage 2 (EP4, 96 local, bf16)",
        make_inputs=_experts_inputs,
        reference=_experts_torch,
        launcher=_experts_launch,
        check=_experts_check,
        bytes_moved=_experts_bytes,
    ),
    dict(
        name="moe_token_down_reduce: routed experts + reduce + scale + shared as the engine "
        "dispatches (per-token kernels up to 4 tokens; EP4, 96 local, bf16)",
        make_inputs=_token_experts_inputs,
        reference=_token_experts_torch,
        launcher=_token_experts_launch,
        check=_token_experts_check,
        bytes_moved=_token_experts_bytes,
    ),
]
