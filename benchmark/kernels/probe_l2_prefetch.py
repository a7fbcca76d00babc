"""What an L2 hint buys a weight-streaming GEMM after a stretch of kernels that leave HBM idle
(`kernels/prefetch/l2.py`, `srt/layers/weight_prefetch.py`), at V4.1-Flash's decode shapes.

    python benchmark/kernels/probe_l2_prefetch.py --out $OUT/l2_prefetch.md [--idle-us 0,5,10,20]

A decode step's stretch of latency-bound kernels (mHC boundary, router, attention) is stood in
for by one program spinning on the GPU's timer for `idle` microseconds (it reads nothing). Per
GEMM (one token: V4.1's x projection 1792 x 5120 and grouped o_a 8 x 1024 x 4096, FP8 32 x 32;
the per-token MoE stage 1 with 6 MXFP4 routes and the FP8 shared expert, whose gate-up rows are
the hint) three CUDA graphs, each over enough weight copies that every call's weights left L2
long before (the hinted bytes are a copy's own):

- `idle`: the spin alone;
- `cold`: the spin, then the GEMM;
- `hinted`: the hint forked onto a side stream as the spin starts (as the models fork it), the
  spin, the join, then the GEMM.

GEMM us = (graph - idle) per call; `hinted / cold` < 1 is the gain. Rounds in ABBA order (cold,
hinted, hinted, cold) and averaged. (A hint computes nothing, so no result is compared here; the
engine's graphs with hints are checked against its tokens in the e2e tests.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sgl_dspark.kernels.linear.quantized import (  # noqa: E402
    quantized_grouped_linear,
    quantized_linear,
)
from sgl_dspark.kernels.moe.reference import MixedExperts  # noqa: E402
from sgl_dspark.kernels.moe.sort import prepare_moe_sort  # noqa: E402
from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up  # noqa: E402
from sgl_dspark.kernels.prefetch.l2 import l2_prefetch  # noqa: E402
from sgl_dspark.srt.layers.weight_prefetch import weight_regions  # noqa: E402

from benchmark.kernels.bench_quant_gemm import quantize_random  # noqa: E402
from benchmark.kernels.graph_timing import graph_time_us  # noqa: E402

_BUDGET = 48 << 20  # bytes a hint may take: every case's whole hinted weight


@triton.jit
def _spin_kernel(ns):
    """Spin until `ns` nanoseconds of the GPU's global timer have passed; reads no memory."""
    start = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    now = start
    while now - start < ns:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )


def _spin(us: float) -> None:
    if us > 0:
        _spin_kernel[(1,)](int(us * 1000), num_warps=1)


class Case:
    """A GEMM over `copies` weight copies: `call(k)` runs it on copy k into its own output,
    `hinted(k)` names copy k's weights to hint."""

    def __init__(
        self,
        name: str,
        copies: int,
        call: Callable[[int], torch.Tensor],
        hinted: Callable[[int], list],
    ) -> None:
        self.name, self.copies, self.call, self.hinted = name, copies, call, hinted


def _linear_case(gen: torch.Generator) -> Case:
    copies = 16  # 9.2 MB each: 147 MB cycled
    weights = [quantize_random((1792, 5120), "fp8", 32, gen) for _ in range(copies)]
    x = torch.randn(1, 5120, generator=gen, device="cuda").to(torch.bfloat16)
    outs = [torch.empty(1, 1792, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    return Case(
        "x projection 1792x5120 (fp8/32)",
        copies,
        lambda k: quantized_linear(x, weights[k], out=outs[k]),
        lambda k: [weights[k]],
    )


def _grouped_case(gen: torch.Generator) -> Case:
    copies = 5  # 34.6 MB each
    weights = [quantize_random((8 * 1024, 4096), "fp8", 32, gen) for _ in range(copies)]
    x = torch.randn(1, 8, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    return Case(
        "o_a 8x1024x4096 grouped (fp8/32)",
        copies,
        lambda k: quantized_grouped_linear(x, weights[k]),
        lambda k: [weights[k]],
    )


def _moe_case(gen: torch.Generator) -> Case:
    """Stage 1 of the per-token MoE at one token: 96 MXFP4 experts (6 routed, a new draw per
    copy) and the FP8 shared expert folded as local expert 96, one shared copy per call."""
    d, inter, local = 5120, 2304, 96
    copies = 6  # shared gate-up rows 23.6 MB each
    routed = quantize_random((local, 2 * inter, d), "mxfp4", 32, gen)
    shared = [quantize_random((1, 2 * inter, d), "fp8", 32, gen) for _ in range(copies)]
    mask = torch.ones(local + 1, dtype=torch.int32)
    plan = prepare_moe_sort(mask.to("cuda"))
    x = torch.randn(1, d, generator=gen, device="cuda").to(torch.bfloat16)
    ids = []
    for _ in range(copies):
        picks = torch.randperm(local, generator=torch.Generator().manual_seed(len(ids)))[:6]
        ids.append(torch.cat((picks, torch.tensor([local]))).to(torch.int32)[None].cuda())
    hs = [torch.empty(7, inter, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    return Case(
        "MoE stage 1, 6 MXFP4 routes + FP8 shared (hint: shared gate-up)",
        copies,
        lambda k: moe_route_gate_up(
            x,
            MixedExperts(routed, shared[k]),
            ids[k],
            plan.local_table,
            plan.num_local,
            10.0,
            h=hs[k],
        ),
        lambda k: [shared[k].expert(0)],
    )


def _sequence(case: Case, idle: float, hint: bool, side: torch.cuda.Stream) -> list[Callable]:
    def step(k: int) -> None:
        if hint:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                l2_prefetch(weight_regions(case.hinted(k)), _BUDGET)
            _spin(idle)
            main.wait_stream(side)
        else:
            _spin(idle)
        case.call(k)

    return [lambda k=k: step(k) for k in range(case.copies)]


def _idle(case: Case, idle: float) -> list[Callable]:
    return [lambda: _spin(idle) for _ in range(case.copies)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--idle-us", default="0,5,10,20")
    p.add_argument("--reps", type=int, default=8)
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(7)
    side = torch.cuda.Stream()
    cases = [_linear_case(gen), _grouped_case(gen), _moe_case(gen)]
    lines = [
        "| GEMM | idle us | idle alone us | cold GEMM us | hinted GEMM us | hinted / cold |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        for idle in [float(v) for v in a.idle_us.split(",")]:
            base = graph_time_us(_idle(case, idle), a.reps) if idle > 0 else 0.0
            rounds = {"cold": [], "hinted": []}
            for variant in ("cold", "hinted", "hinted", "cold"):
                calls = _sequence(case, idle, variant == "hinted", side)
                rounds[variant].append(graph_time_us(calls, a.reps) - base)
            cold = sum(rounds["cold"]) / 2
            hinted = sum(rounds["hinted"]) / 2
            lines.append(
                f"| {case.name} | {idle:g} | {base:.2f} | {cold:.2f} | {hinted:.2f} | "
                f"{hinted / cold:.3f} |"
            )
            print(lines[-1], flush=True)
            if a.out:
                Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
