"""What the GEMM scripts (`bench_fp8_gemm.py`, `bench_quant_gemm.py`) time and check with: the
microseconds of one call from a CUDA graph of back-to-back calls (launch gaps amortised, as in a
captured decode step), best of a few replays, and a result's relative error."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


def graph_time_us(calls: Sequence[Callable[[], object]], reps: int, replays: int = 5) -> float:
    """Microseconds per call: `calls` run once on a side stream (compilation and the caching
    allocator settle outside the capture), then captured as `reps` rounds over `calls` into one
    CUDA graph; one warm replay, then the best of `replays` timed ones."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (reps * len(calls)))
    return best


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in fp32 (a NaN in `got` gives NaN: gate with `not rel <=
    tolerance`). The denominator is floored, so a reference of zeros gives 0 where `got` is zeros
    too, not 0 / 0."""
    scale = want.float().abs().max().clamp_min(1e-30)
    return float((got.float() - want.float()).abs().max() / scale)
