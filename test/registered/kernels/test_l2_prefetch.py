"""L2 hints (`kernels/prefetch/l2.py`) and the models' side stream for them
(`srt/layers/weight_prefetch.py`).

A hint computes nothing, so what is tested is what it is given and where it runs: the byte ranges
a budget selects (in order, leading bytes first), the errors for what it cannot take, that
nothing is hinted eagerly, off NVIDIA or without a budget (the weights are then not even
gathered), and on a GPU that the kernel runs over real weights and that hints forked inside a
captured graph leave the graph's results unchanged. That the models name the right weights is
tested with the model (models/test_v41_weight_prefetch.py); that the compiled kernel issues
`prefetch.global.L2` by gpu_targets_check.py."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.linear.reference import QuantizedWeight
from sgl_dspark.kernels.prefetch.l2 import MAX_REGIONS, l2_prefetch, prefetch_plan
from sgl_dspark.srt.layers.weight_prefetch import (
    WeightPrefetch,
    l2_prefetch_budget,
    set_l2_prefetch_budget,
    weight_regions,
)

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def budget():
    """`set_l2_prefetch_budget` for one test; the process-wide budget is restored after it."""
    saved = l2_prefetch_budget()
    yield set_l2_prefetch_budget
    set_l2_prefetch_budget(saved >> 20)


def _taken(plan: list[tuple[torch.Tensor, int]]) -> list[tuple[int, int]]:
    """(address, bytes) of each planned range."""
    return [(region.data_ptr(), take) for region, take in plan]


def test_plan_takes_leading_bytes_in_order_until_the_budget() -> None:
    a = torch.randn(100, 3)  # 1200 bytes
    b = torch.randint(0, 255, (5000,), dtype=torch.uint8)
    c = torch.randn(7, dtype=torch.bfloat16)  # 14 bytes
    assert _taken(prefetch_plan([a, b, c], 10_000)) == [
        (a.data_ptr(), 1200),
        (b.data_ptr(), 5000),
        (c.data_ptr(), 14),
    ]
    # The budget ends inside b: b's first 800 bytes, nothing of c.
    assert _taken(prefetch_plan([a, b, c], 2000)) == [(a.data_ptr(), 1200), (b.data_ptr(), 800)]
    assert prefetch_plan([a, b], 0) == []
    # Empty regions are left out and do not count against the region limit.
    empty = torch.empty(0)
    plan = prefetch_plan([empty, a, empty, b, empty, c, empty], 10_000)
    assert _taken(plan) == [(a.data_ptr(), 1200), (b.data_ptr(), 5000), (c.data_ptr(), 14)]
    # Every range is a flat byte view of its tensor.
    assert all(r.dtype == torch.uint8 and r.dim() == 1 for r, _ in plan)
    assert plan[0][0].numel() == 1200


def test_plan_refuses_what_it_cannot_take() -> None:
    a = torch.randn(8, 8)
    with pytest.raises(ValueError, match=r"regions\[1\]: a contiguous tensor is needed"):
        prefetch_plan([a, a.t()], 1 << 20)
    with pytest.raises(ValueError, match=f"at most {MAX_REGIONS} regions"):
        prefetch_plan([a] * (MAX_REGIONS + 1), 1 << 20)
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        prefetch_plan([a], -1)
    # Past the budget, further regions are not planned, so they do not hit the limit.
    assert len(prefetch_plan([a] * (MAX_REGIONS + 3), 256 * MAX_REGIONS)) == MAX_REGIONS


def test_kernel_refuses_devices_without_the_ptx_hint() -> None:
    with pytest.raises(ValueError, match="NVIDIA GPUs"):
        l2_prefetch([torch.randn(64)], 1 << 20)
    assert l2_prefetch([torch.randn(64)], 0) == 0  # nothing planned: nothing launched


def test_weight_regions_put_scales_before_stored_bytes() -> None:
    data = torch.randint(0, 255, (64, 32), dtype=torch.uint8)
    scale = torch.randint(100, 140, (64, 2), dtype=torch.uint8)
    plain = torch.randn(16, 32)
    got = weight_regions([QuantizedWeight(data, scale, "mxfp4", 32), None, plain])
    assert [t.data_ptr() for t in got] == [scale.data_ptr(), data.data_ptr(), plain.data_ptr()]


def test_budget_is_checked_and_in_mib(budget) -> None:
    budget(3)
    assert l2_prefetch_budget() == 3 * 2**20
    with pytest.raises(ValueError, match="--l2-prefetch-mib must be >= 0"):
        set_l2_prefetch_budget(-1)
    assert l2_prefetch_budget() == 3 * 2**20  # unchanged by the refused call


def _never() -> list:
    raise AssertionError("the weights were gathered")


def test_nothing_is_hinted_eagerly_off_nvidia_or_without_a_budget(budget) -> None:
    hints = WeightPrefetch()
    budget(0)
    hints.issue(torch.device("cuda", 0), _never)  # no budget: not even the device is looked at
    budget(16)
    hints.issue(torch.device("cpu"), _never)
    hints.join()
    assert hints.issued == 0
    if torch.cuda.is_available():
        hints.issue(torch.device("cuda", torch.cuda.current_device()), _never)  # eager
        assert hints.issued == 0


@cuda_only
def test_kernel_hints_real_weights_and_reports_the_bytes() -> None:
    data = torch.randint(0, 255, (512, 1024), dtype=torch.uint8, device="cuda")
    scale = torch.randint(100, 140, (512, 32), dtype=torch.uint8, device="cuda")
    gate = torch.randn(96, 512, dtype=torch.bfloat16, device="cuda")
    want = (data.clone(), scale.clone(), gate.clone())
    regions = [scale, data, gate]
    assert l2_prefetch(regions, 1 << 30) == 512 * 32 + 512 * 1024 + 96 * 512 * 2
    assert l2_prefetch(regions, 100_000) == 100_000
    torch.cuda.synchronize()
    for a, b in zip((data, scale, gate), want):
        assert torch.equal(a, b)  # a hint writes nothing


@cuda_only
def test_hints_forked_in_a_captured_graph_change_no_result(budget) -> None:
    """Hints issued between two kernels of a capture, on the side stream, joined at the end:
    the graph replays the eager results on fresh inputs."""
    budget(4)
    hints = WeightPrefetch()
    w = torch.randn(1024, 1024, device="cuda")
    x = torch.randn(8, 1024, device="cuda")
    codes = torch.randint(0, 255, (1024, 512), dtype=torch.uint8, device="cuda")
    scales = torch.randint(120, 130, (1024, 32), dtype=torch.uint8, device="cuda")
    stored = QuantizedWeight(codes, scales, "mxfp4", 32)

    def step() -> torch.Tensor:
        y = x @ w.t()
        hints.issue(x.device, lambda: [w, None])
        z = torch.relu(y) @ w
        hints.issue(x.device, lambda: [stored])
        hints.join()
        return z

    step()  # eager: makes the side stream, hints nothing
    assert hints.issued == 0
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            out = step()
    torch.cuda.current_stream().wait_stream(side)
    assert hints.issued == 2
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, step())  # eager: no hint
