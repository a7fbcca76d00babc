"""Masked local route reduce (`moe_reduce`) vs `moe_reduce_ref` (bit-exact, interpreter included)."""

from __future__ import annotations

import importlib

import pytest
import torch
from sgl_dspark.kernels.moe.reduce import moe_reduce
from sgl_dspark.kernels.moe.reference import moe_reduce_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
moe_reduce_module = importlib.import_module("sgl_dspark.kernels.moe.reduce")
# The interpreter converts scalar loop bounds through a numpy call that numpy 1.25+ deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def _mask(kind: str, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "all_local":
        mask = torch.ones(num_experts, dtype=torch.int32)
    elif kind == "none_local":
        mask = torch.zeros(num_experts, dtype=torch.int32)
    elif kind == "ep_slice":
        mask = torch.zeros(num_experts, dtype=torch.int32)
        mask[: num_experts // 4] = 1
    else:
        mask = (torch.rand(num_experts, generator=gen) < 0.4).to(torch.int32)
    return mask.to(DEVICE)


def _inputs(
    num_tokens: int,
    topk: int,
    hidden: int,
    num_experts: int,
    mask: torch.Tensor,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(-1, num_experts + 1, (num_tokens, topk), generator=gen)  # -1, E: fills
    weights = torch.rand(num_tokens, topk, generator=gen)
    weights[torch.rand(num_tokens, topk, generator=gen) < 0.1] = 0.0  # padded-row style routes
    y = (torch.randn(num_tokens, topk, hidden, generator=gen) * 3).to(dtype)
    shared = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    ids, y = ids.to(torch.int32).to(DEVICE), y.to(DEVICE)
    # Remote slots hold garbage in the unfused pipeline: NaN there must not leak into the output.
    known = (ids >= 0) & (ids < num_experts)
    remote = ~known | (mask.long()[ids.long().clamp(0, num_experts - 1)] == 0)
    y[remote] = float("nan")
    return y, weights.to(DEVICE), ids, shared.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask_kind", ["ep_slice", "random", "none_local", "all_local"])
@pytest.mark.parametrize("num_tokens,hidden", [(0, 64), (1, 96), (4, 1000), (24, 256), (37, 700)])
def test_matches_ref_bitwise(
    num_tokens: int, hidden: int, mask_kind: str, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 17 + hidden + len(mask_kind))
    mask = _mask(mask_kind, 384, gen)
    y, weights, ids, shared = _inputs(num_tokens, 6, hidden, 384, mask, dtype, gen)
    for routed_scale in (1.0, 2.5):
        for use_shared in (True, False):
            kwargs = dict(routed_scale=routed_scale, shared=shared if use_shared else None)
            out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=DEVICE)
            got = moe_reduce(y, weights, ids, mask, out=out, **kwargs)
            assert got is out
            ref = moe_reduce_ref(y, weights, ids, mask, **kwargs)
            assert torch.equal(got, ref)
            # Unit weights as None (routes weighted before the down projection): a tensor of
            # ones' result, bit for bit.
            unit = moe_reduce(y, None, ids, mask, **kwargs)
            ones = moe_reduce_ref(y, torch.ones_like(weights), ids, mask, **kwargs)
            assert torch.equal(unit, ones)


@pytest.mark.parametrize("topk,num_experts", [(1, 4), (8, 64), (3, 5)])
def test_other_topk(topk: int, num_experts: int) -> None:
    gen = torch.Generator().manual_seed(topk * 100 + num_experts)
    mask = _mask("random", num_experts, gen)
    y, weights, ids, shared = _inputs(9, topk, 300, num_experts, mask, torch.bfloat16, gen)
    got = moe_reduce(y, weights, ids, mask, routed_scale=1.5, shared=shared)
    assert torch.equal(got, moe_reduce_ref(y, weights, ids, mask, routed_scale=1.5, shared=shared))


def test_hand_derived() -> None:
    # Token 0: slots on experts 1 (local, w 0.5) and 2 (remote); token 1: both remote -> shared.
    mask = torch.tensor([0, 1, 0], dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([[1, 2], [0, 2]], dtype=torch.int32, device=DEVICE)
    weights = torch.tensor([[0.5, 0.25], [1.0, 1.0]], device=DEVICE)
    y = torch.full((2, 2, 4), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    y[0, 0] = torch.tensor([2.0, -4.0, 6.0, 8.0])
    shared = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, -3.0, 0.5, 7.0]], device=DEVICE)
    got = moe_reduce(y, weights, ids, mask, routed_scale=2.0, shared=shared.bfloat16())
    expected = torch.tensor([[3.0, -3.0, 7.0, 9.0], [3.0, -3.0, 0.5, 7.0]], device=DEVICE)
    assert torch.equal(got, expected.bfloat16())


def test_bad_inputs_raise() -> None:
    y = torch.zeros(2, 3, 8, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    weights = torch.zeros(2, 3, device=DEVICE)
    mask = torch.ones(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_reduce(y, weights, ids.long(), mask)
    with pytest.raises(ValueError, match="shared"):
        moe_reduce(y, weights, ids, mask, shared=torch.zeros(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="y must be"):
        moe_reduce(y.transpose(0, 1), weights, ids, mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager() -> None:
    gen = torch.Generator().manual_seed(3)
    mask = _mask("ep_slice", 384, gen)
    y, weights, ids, shared = _inputs(32, 6, 4096, 384, mask, torch.bfloat16, gen)
    eager = moe_reduce(y, weights, ids, mask, routed_scale=2.5, shared=shared)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_reduce(y, weights, ids, mask, routed_scale=2.5, shared=shared)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("block_h,num_warps", [(128, 1), (1024, 2), (4096, 8)])
def test_launch_meta_never_changes_results(block_h: int, num_warps: int, monkeypatch) -> None:
    """Columns per program and warps are free (`_reduce_meta`): each column is its own
    slot-ordered sum, so every variant is bit-equal to the reference (BLOCK_H below, inside and
    above H = 1000)."""
    gen = torch.Generator().manual_seed(block_h + num_warps)
    mask = _mask("ep_slice", 384, gen)
    y, weights, ids, shared = _inputs(5, 6, 1000, 384, mask, torch.bfloat16, gen)
    monkeypatch.setattr(
        moe_reduce_module,
        "_reduce_meta",
        lambda tokens, hidden: {"BLOCK_H": block_h, "num_warps": num_warps},
    )
    out = torch.full((5, 1000), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = moe_reduce(y, weights, ids, mask, routed_scale=2.5, shared=shared, out=out)
    assert torch.equal(got, moe_reduce_ref(y, weights, ids, mask, routed_scale=2.5, shared=shared))
