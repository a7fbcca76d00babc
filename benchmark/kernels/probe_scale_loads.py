"""Probe: the scale bytes of the quantised GEMMs' narrow tiles loaded a step ahead
(`weight_loads.scales_loaded_ahead`, the library's) against loaded in their step (the rule
answering False in the linear launcher and the expert kernels), one device, one process.

Both give the same bits, so each case's outputs are first checked BIT-EQUAL; then both sides
are timed ABBA (library, in step, in step, library) in CUDA graphs over weight copies that
exceed the L2 (`bench_quant_gemm.time_us`): the small-M linear at DeepSeek-V4.1-Flash's dense
decode shapes (FP8 32 x 32; the grouped output projection included) and V4-Flash's wide one
(FP8 128 x 128, whose steps hold too few groups to load ahead: a control), and the rank
model's experts through the per-token stages (MXFP4 routed experts beside the FP8 shared one,
`probe_moe_token.py`'s set-up).

Usage (device machine): python3 benchmark/kernels/probe_scale_loads.py --out scale_loads.md
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sgl_dspark.kernels.linear import quantized as linear_module  # noqa: E402
from sgl_dspark.kernels.linear.quantized import (  # noqa: E402
    quantized_grouped_linear,
    quantized_linear,
)
from sgl_dspark.kernels.moe import expert_weights  # noqa: E402

from benchmark.kernels.bench_quant_gemm import (  # noqa: E402
    SETUP,
    _copies,
    _nbytes,
    _reps,
    quantize_random,
    time_us,
)
from benchmark.kernels.probe_moe_token import _setup  # noqa: E402
from benchmark.kernels.run_all import time_graph  # noqa: E402

# (name, N, K, groups, scale group): V4.1-Flash's layer (FP8 32 x 32) and V4-Flash's wide shape.
DENSE = (
    ("v41 x_proj 1792x5120", 1792, 5120, 1, 32),
    ("v41 q_b 32768x1280", 32768, 1280, 1, 32),
    ("v41 o_a 8x1024x4096 grouped", 1024, 4096, 8, 32),
    ("v41 o_b 5120x8192", 5120, 8192, 1, 32),
    ("wide 32768x4096 fp8/128", 32768, 4096, 1, 128),
)
# The rule where each launcher looks it up: "in step" replaces it with one answering False.
RULE_HOMES = (linear_module, expert_weights)


@contextlib.contextmanager
def _in_step(on: bool):
    """The launchers with every scale tile loaded in its step (unchanged unless `on`)."""
    with contextlib.ExitStack() as stack:
        for module in RULE_HOMES if on else ():
            stack.enter_context(
                mock.patch.object(module, "scales_loaded_ahead", lambda *args: False)
            )
        yield


def _ab(label: str, m: int, run: Callable[[], list], time_fn: Callable) -> str:
    """Bits of both sides compared, then ABBA timings: a table row."""
    with _in_step(False):
        want = [t.clone() for t in run()]
    with _in_step(True):
        got = run()
    equal = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(want, got))
    times: dict[bool, list[float]] = {}
    for in_step in (False, True, True, False):
        with _in_step(in_step):
            times.setdefault(in_step, []).append(time_fn())
    lib, alt = (sum(times[v]) / 2 for v in (False, True))
    return f"| {label} | {m} | {equal} | {alt:.1f} | {lib:.1f} | {alt / lib:.2f} |"


def _dense(name: str, n: int, k: int, groups: int, group: int, m: int) -> str:
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    shape = (m, k) if groups == 1 else (m, groups, k)
    x = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
    make = lambda: quantize_random((n * groups, k), "fp8", group, gen)  # noqa: E731
    call = quantized_linear if groups == 1 else quantized_grouped_linear
    w0 = make()
    weights = [w0] + [make() for _ in range(_copies(_nbytes(w0)) - 1)]
    calls = [lambda w=w: call(x, w) for w in weights]
    return _ab(name, m, lambda: [call(x, w0)], lambda: time_us(calls, _reps(len(calls))))


def _experts(m: int, calls: int = 8) -> str:
    """The rank model's per-token stages (MXFP4 routed experts + the FP8 shared one), `calls`
    routings per graph."""
    token = _setup("dsv41_flash_ep4", m, calls, "mxfp4")["token"]
    return _ab(
        "v41 experts per-token (mixed)",
        m,
        token,
        lambda: time_graph(token, 1, 20)[0] / calls,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--m", default="1,4,16")
    p.add_argument("--budget-s", type=float, default=200.0)
    a = p.parse_args()
    SETUP.device = "cuda"
    start = time.time()
    lines = [
        f"device: {torch.cuda.get_device_name()}",
        "",
        "| case | M | bits equal | in step us | ahead us (library) | in step / ahead |",
        "|---|---|---|---|---|---|",
    ]
    cases = [
        (f"{case[0]} M {m}", lambda m=m, c=case: _dense(*c, m))
        for case in DENSE
        for m in (int(v) for v in a.m.split(","))
    ]
    cases += [(f"experts M {m}", lambda m=m: _experts(m)) for m in (1, 2)]
    for label, case in cases:
        if time.time() - start > a.budget_s:
            line = f"| {label} | | skipped: budget | | | |"
        else:
            try:
                line = case()
            except Exception as exc:  # noqa: BLE001
                line = f"| {label} | | FAIL {type(exc).__name__}: {exc}"[:200] + " | | | |"
        print(line, flush=True)
        lines.append(line)
        if a.out:
            Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
