"""Small-M expert-parallel MoE sort (`moe_sort`) vs `moe_sort_ref` (every valid output bit-equal)."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.moe.reference import MoeSortOutput, moe_sort_capacity, moe_sort_ref
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter converts scalar loop bounds through a numpy call that numpy 1.25+ deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
BLOCK = 32
INT_POISON = -123456  # never a packed id: packed ids are non-negative


def _make_mask(kind: str, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "all_local":
        mask = torch.ones(num_experts, dtype=torch.int32)
    elif kind == "none_local":
        mask = torch.zeros(num_experts, dtype=torch.int32)
    elif kind == "single":
        mask = torch.zeros(num_experts, dtype=torch.int32)
        mask[int(torch.randint(num_experts, (1,), generator=gen))] = 1
    elif kind == "ep_slice":  # contiguous EP shard: rank 1 of 4
        mask = torch.zeros(num_experts, dtype=torch.int32)
        mask[num_experts // 4 : num_experts // 2] = 1
    else:  # random
        mask = (torch.rand(num_experts, generator=gen) < 0.3).to(torch.int32)
    return mask.to(DEVICE)


def _make_routes(
    num_tokens: int, topk: int, num_experts: int, routing: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    if routing == "skewed":  # a few hot experts: counts past 32, several blocks per expert
        hot = torch.randint(num_experts, (3,), generator=gen)
        ids = hot[torch.randint(3, (num_tokens, topk), generator=gen)]
    else:  # distinct experts per token, like a real top-k
        ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :topk]
    weights = torch.rand(num_tokens, topk, generator=gen) + 0.01
    return ids.to(torch.int32).to(DEVICE), weights.to(DEVICE)


def _assert_same(got: MoeSortOutput, ref: MoeSortOutput) -> None:
    assert torch.equal(got.num_valid, ref.num_valid), (got.num_valid, ref.num_valid)
    valid = int(ref.num_valid[0])
    for name in ("sorted_ids", "sorted_weights", "sorted_expert_ids", "moe_buf"):
        assert getattr(got, name).shape == getattr(ref, name).shape, name
    assert torch.equal(got.sorted_ids[:valid], ref.sorted_ids[:valid])
    assert torch.equal(got.sorted_weights[:valid], ref.sorted_weights[:valid])
    assert torch.equal(
        got.sorted_expert_ids[: valid // BLOCK], ref.sorted_expert_ids[: valid // BLOCK]
    )
    assert got.moe_buf.dtype == ref.moe_buf.dtype
    assert torch.equal(got.moe_buf, ref.moe_buf)


def _poisoned_like(ref: MoeSortOutput) -> MoeSortOutput:
    """Output buffers full of junk, so a kernel that skips a write cannot pass."""
    return MoeSortOutput(
        *(torch.full_like(t, float("nan") if t.is_floating_point() else INT_POISON) for t in ref)
    )


def _run(ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, hidden: int) -> None:
    ref = moe_sort_ref(ids, weights, mask, hidden)
    out = _poisoned_like(ref)
    got = moe_sort(ids, weights, prepare_moe_sort(mask), hidden, out=out)
    assert got is out
    _assert_same(got, ref)


@pytest.mark.parametrize(
    "num_tokens,mask_kind",
    [(m, kind) for m in (0, 1, 4, 24, 37, 128) for kind in ("ep_slice", "none_local", "single")]
    # ~115 programs: slow in the interpreter, so fewer sizes (all-local runs at smaller E below).
    + [(4, "random"), (37, "random")],
)
def test_dsv4_shapes(num_tokens: int, mask_kind: str) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 31 + len(mask_kind))
    mask = _make_mask(mask_kind, 384, gen)
    for routing in ("uniform", "skewed"):
        ids, weights = _make_routes(num_tokens, 6, 384, routing, gen)
        _run(ids, weights, mask, hidden=96)


@pytest.mark.parametrize(
    "num_tokens,topk,num_experts", [(1, 1, 3), (5, 2, 8), (33, 3, 17), (200, 8, 64), (9, 4, 160)]
)
def test_general_topk_and_experts(num_tokens: int, topk: int, num_experts: int) -> None:
    """Non-DSV4 topk / E, and a pair count past one 1024-route chunk (200 x 8)."""
    gen = torch.Generator().manual_seed(num_tokens + 1000 * topk + num_experts)
    for mask_kind in ("random", "all_local", "single"):
        mask = _make_mask(mask_kind, num_experts, gen)
        for routing in ("uniform", "skewed"):
            ids, weights = _make_routes(num_tokens, topk, num_experts, routing, gen)
            _run(ids, weights, mask, hidden=40)


def test_exact_multiple_of_block_has_no_sentinels() -> None:
    # 32 tokens x 2 slots all on expert 1 and 2 -> counts 32 and 32: no padding at all.
    ids = torch.tensor([[1, 2]] * 32, dtype=torch.int32, device=DEVICE)
    weights = torch.rand(32, 2, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = torch.tensor([0, 1, 1, 0], dtype=torch.int32, device=DEVICE)
    got = moe_sort(ids, weights, prepare_moe_sort(mask), 8)
    assert got.num_valid.tolist() == [64, 32]
    # Hand-derived: expert 1 takes slot 0 of tokens 0..31, expert 2 slot 1 of tokens 0..31.
    tokens = torch.arange(32, dtype=torch.int32, device=DEVICE)
    assert torch.equal(got.sorted_ids[:64], torch.cat([tokens, (1 << 24) | tokens]))
    assert torch.equal(got.sorted_weights[:64], torch.cat([weights[:, 0], weights[:, 1]]))
    assert got.sorted_expert_ids[:2].tolist() == [0, 1]
    _assert_same(got, moe_sort_ref(ids, weights, mask, 8))


def test_padding_sentinel_and_dropped_fill_ids() -> None:
    # Hand-derived: 3 tokens, topk 2, E 4, experts 0 and 3 local; -1 and 4 are out-of-range fills.
    ids = torch.tensor([[3, 1], [0, -1], [3, 4]], dtype=torch.int32, device=DEVICE)
    weights = torch.tensor([[0.5, 0.25], [0.75, 0.0], [0.125, 0.0]], device=DEVICE)
    mask = torch.tensor([1, 0, 0, 1], dtype=torch.int32, device=DEVICE)
    got = moe_sort(ids, weights, prepare_moe_sort(mask), 4)
    sentinel = (2 << 24) | 3
    assert got.num_valid.tolist() == [64, 3]
    # Expert 0 (local id 0): token 1 slot 0, then 31 sentinels.
    assert got.sorted_ids[0].item() == 1
    assert set(got.sorted_ids[1:32].tolist()) == {sentinel}
    # Expert 3 (local id 1): token 0 slot 0, token 2 slot 0, then 30 sentinels.
    assert got.sorted_ids[32:34].tolist() == [0, 2]
    assert set(got.sorted_ids[34:64].tolist()) == {sentinel}
    assert got.sorted_weights[0].item() == 0.75
    assert got.sorted_weights[32:34].tolist() == [0.5, 0.125]
    pad = torch.cat([got.sorted_weights[1:32], got.sorted_weights[34:64]])
    assert torch.equal(pad, torch.zeros_like(pad))
    assert got.sorted_expert_ids[:2].tolist() == [0, 1]


def test_capacity_and_m0() -> None:
    mask = torch.ones(16, dtype=torch.int32, device=DEVICE)
    ids = torch.empty(0, 6, dtype=torch.int32, device=DEVICE)
    got = moe_sort(ids, torch.empty(0, 6, device=DEVICE), prepare_moe_sort(mask), 64)
    assert got.num_valid.tolist() == [0, 0]
    assert got.sorted_ids.numel() == moe_sort_capacity(0, 6, 16, BLOCK) == 16 * 32 - 6
    assert got.moe_buf.shape == (0, 64)


def test_bad_inputs_raise() -> None:
    mask = torch.ones(8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="expert_mask"):
        prepare_moe_sort(mask.to(torch.int64))
    with pytest.raises(ValueError, match="0 or 1"):
        prepare_moe_sort(mask * 2)
    plan = prepare_moe_sort(mask)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_sort(ids, torch.zeros(2, 2, device=DEVICE), plan, 8)
    # A plan left on another device than the routes ("meta": another device without a GPU).
    ids = torch.zeros(2, 2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=f"plan is on {plan.local_table.device}, routes on meta"):
        moe_sort(ids, torch.zeros(2, 2, device="meta"), plan, 8)


@pytest.mark.parametrize("fill_id", [0, -1, 384])
def test_padded_graph_rows(fill_id: int) -> None:
    """Rows past n_valid arrive with the backend's fill id and weight 0: id 0 is sorted like a
    real route (HIP convention), -1 and E are dropped."""
    gen = torch.Generator().manual_seed(11 + fill_id)
    mask = torch.zeros(384, dtype=torch.int32, device=DEVICE)
    mask[:96] = 1  # rank 0: expert 0 is local
    ids, weights = _make_routes(24, 6, 384, "uniform", gen)
    ids[20:] = fill_id
    weights[20:] = 0.0
    _run(ids, weights, mask, hidden=64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager() -> None:
    gen = torch.Generator().manual_seed(2)
    mask = _make_mask("ep_slice", 384, gen)
    ids, weights = _make_routes(32, 6, 384, "uniform", gen)
    plan = prepare_moe_sort(mask)  # host read before capture
    eager = moe_sort(ids, weights, plan, 4096)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_sort(ids, weights, plan, 4096)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(captured, eager)
