"""Probe: the routed experts' two grouped GEMMs (`fused_moe`'s launches) with the programs in
tile-major vs block-major order, on one device, ABBA, CUDA-graph timed.

At decode sizes `moe_sort`'s static layout has far more blocks than live ones (M = 1, 64 experts,
block 32: ~62 blocks, 6 live), so most programs of the grid exit at once; tile-major order
launches the live blocks' programs first. Each graph replays `--calls` launches over as many
different routings, so the experts' weights come from HBM as in a decode step (one routing
would keep its six experts in L2). Both orders are checked bit-identical first.

Usage (device machine): python3 benchmark/kernels/probe_moe_order.py --out probe.md
"""

from __future__ import annotations

import argparse
import statistics

import torch
from sgl_dspark.kernels.moe.grouped_gemm import moe_grouped_gemm
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort

SHAPES = {  # name: (hidden D, routed I, local experts, experts, top-k)
    "mid_910m": (1024, 512, 64, 64, 6),
    "dsv4_flash_ep4": (4096, 2048, 96, 384, 6),
}


def _case(shape: str, m: int, calls: int, device: str):
    d, inter, local, experts, topk = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(7 + m)
    gate_up = (
        torch.randn(local, 2 * inter, d, generator=gen, device=device, dtype=torch.bfloat16)
        * d**-0.5
    )
    down = (
        torch.randn(local, d, inter, generator=gen, device=device, dtype=torch.bfloat16)
        * inter**-0.5
    )
    mask = torch.zeros(experts, dtype=torch.int32)
    mask[:local] = 1
    plan = prepare_moe_sort(mask.to(device))
    x = torch.randn(m, d, generator=gen, device=device).to(torch.bfloat16)
    sorts = []
    for _ in range(calls):
        ids = torch.rand(m, experts, generator=gen, device=device).argsort(1)[:, :topk]
        sorts.append(moe_sort(ids.to(torch.int32), torch.rand(m, topk, device=device), plan, 0))

    # Rows of remote routes are never written: poisoned, so both orders compare in full.
    outs = [
        torch.full((m * topk, d), float("nan"), dtype=torch.bfloat16, device=device) for _ in sorts
    ]

    def run(tile_major: bool) -> list[torch.Tensor]:
        for s, out in zip(sorts, outs):
            routes = (s.sorted_ids, s.sorted_expert_ids, s.num_valid, topk)
            h = moe_grouped_gemm(
                x, gate_up, *routes, out_swiglu=True, swiglu_limit=10.0, tile_major=tile_major
            )
            moe_grouped_gemm(h, down, *routes, a_per_pair=True, out=out, tile_major=tile_major)
        return outs

    return run


def _graph_us(run, tile_major: bool, calls: int, replays: int) -> float:
    run(tile_major)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(tile_major)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,4,8,32,128,512")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = [
        "| shape | M | block-major us | tile-major us | ratio | auto picks |",
        "|---|---|---|---|---|---|",
    ]
    for shape in SHAPES:
        for m in (int(v) for v in a.m.split(",")):
            run = _case(shape, m, a.calls, "cuda")
            first = [o.clone() for o in run(True)]
            for x, y in zip(first, run(False)):
                assert torch.equal(x.view(torch.int16), y.view(torch.int16)), (shape, m)
            ab = {True: [], False: []}
            for order in (False, True, True, False):  # ABBA
                ab[order].append(_graph_us(run, order, a.calls, a.replays))
            blk, tile = statistics.mean(ab[False]), statistics.mean(ab[True])
            auto = "tile" if m == 1 else "block"  # moe_grouped_gemm's choice
            rows.append(f"| {shape} | {m} | {blk:.2f} | {tile:.2f} | {blk / tile:.2f}x | {auto} |")
            print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
