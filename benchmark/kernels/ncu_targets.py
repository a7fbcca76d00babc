"""Driver for Nsight Compute: the rank model's heaviest decode kernels at one token, each launched
once at DeepSeek-V4.1-Flash's shapes (weights as released: dense FP8 32 x 32, routed experts
MXFP4 with the FP8 shared expert folded), so that `ncu` reads their hardware counters (DRAM
throughput, issue-slot use, occupancy, waves, warp stalls) instead of our guessing them from
timings.

Targets, in launch order (`--targets` picks some; the kernel each launches in brackets):
  x_proj       the joint q_a + kv projection, 1792 x 5120        [_quantized_linear_kernel]
  q_b          32768 x 1280                                       [_quantized_linear_kernel]
  o_a          8 groups of 1024 x 4096 (grouped)                  [_quantized_linear_kernel]
  o_b          5120 x 8192                                        [_quantized_linear_kernel]
  moe_gate_up  per-token stage 1, 6 MXFP4 routes + the shared one [_moe_route_gate_up_kernel]
  moe_down     per-token stage 2 with the route reduce            [_moe_token_down_kernel]
  mhc          the sublayer boundary, single pass (phase A, B)    [_mhc_post_combine_kernel]

Every target first runs once outside the profiled range (Triton compiles it; inputs made), then
`--launches` times inside it (`torch.cuda.profiler.start` / `stop`: run ncu with
`--profile-from-start off`), each launch on another copy of its weights (the MoE stages: another
routing) so that a decode step's HBM reads are what is measured; ncu flushes the caches before
each profiled kernel anyway. Nothing is checked here: the compiled tests check these kernels.

Usage (device machine; `benchmark/gpu/native_h200.sh ncu` runs it under ncu):
  python3 benchmark/kernels/ncu_targets.py [--targets x_proj,moe_gate_up] [--launches 1]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sgl_dspark.kernels.linear.quantized import (  # noqa: E402
    quantized_grouped_linear,
    quantized_linear,
)

from benchmark.kernels.bench_quant_gemm import quantize_random  # noqa: E402
from benchmark.kernels.probe_mhc_phases import _boundaries, _library  # noqa: E402
from benchmark.kernels.probe_moe_token import _setup  # noqa: E402

HIDDEN = 5120
# name: (N, K, groups) of V4.1-Flash's dense decode GEMMs, FP8 with 32 x 32 blocks
DENSE = {
    "x_proj": (1792, HIDDEN, 1),
    "q_b": (32768, 1280, 1),
    "o_a": (1024, 4096, 8),
    "o_b": (HIDDEN, 8192, 1),
}
TARGETS = (*DENSE, "moe_gate_up", "moe_down", "mhc")


def _dense(name: str, copies: int) -> list[Callable[[], object]]:
    n, k, groups = DENSE[name]
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(1, groups, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
    weights = [quantize_random((groups * n, k), "fp8", 32, gen) for _ in range(copies)]
    if groups > 1:
        return [lambda w=w: quantized_grouped_linear(x, w) for w in weights]
    return [lambda w=w: quantized_linear(x[:, 0], w) for w in weights]


def _calls(name: str, launches: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """(warm-up, profiled): the profiled call launches the target `launches` times."""
    if name == "mhc":
        calls = [_library(b) for b in _boundaries(1, launches + 1, "cuda")]
    elif name in DENSE:
        calls = _dense(name, launches + 1)
    else:  # one call of a stage runs every routing of its setup, each on other experts
        paths = _setup("dsv41_flash_ep4", 1, launches, "mxfp4")
        paths["gate_up"]()  # stage 2's input rows
        stage = paths["gate_up" if name == "moe_gate_up" else "down"]
        return stage, stage

    def profiled() -> None:
        for call in calls[1:]:
            call()

    return calls[0], profiled


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--launches", type=int, default=1, help="profiled launches per target")
    a = p.parse_args()
    for name in a.targets.split(","):
        if name not in TARGETS:
            raise SystemExit(f"--targets: unknown {name!r}; known: {', '.join(TARGETS)}")
        warm_up, profiled = _calls(name, a.launches)
        warm_up()  # compiles
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        profiled()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"ran {name}", flush=True)


if __name__ == "__main__":
    main()
