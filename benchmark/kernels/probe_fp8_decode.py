"""Probe: the FP8 weight decode of the quantised GEMMs on NVIDIA, bit placement
(`E4M3_SCALED_PTX`, the library's) against the hardware conversion (e4m3 -> f32 -> bf16), one
device, one process.

The two decodes give the same dequantised weights, so each shape's outputs are first checked
BIT-EQUAL; then both are timed ABBA (bits, conversion, conversion, bits) in CUDA graphs over
weight copies that exceed the L2 (`bench_quant_gemm.time_us`): the small-M linear at
DeepSeek-V4.1-Flash's dense decode shapes (the grouped output projection included) and
V4-Flash's wide one. The conversion is the linear launcher's decode with `fp4_ptx_decode`
answering False (which for an FP8 weight only picks its decode).

Usage (device machine): python3 benchmark/kernels/probe_fp8_decode.py --out fp8_decode.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sgl_dspark.kernels.linear import quantized as linear_module  # noqa: E402
from sgl_dspark.kernels.linear.quantized import (  # noqa: E402
    quantized_grouped_linear,
    quantized_linear,
)

from benchmark.kernels.bench_quant_gemm import (  # noqa: E402
    SETUP,
    _copies,
    _nbytes,
    _reps,
    quantize_random,
    time_us,
)

# (name, N, K, groups, scale group): V4.1-Flash's layer (FP8 32 x 32) and V4-Flash's wide shape.
DENSE = (
    ("v41 x_proj 1792x5120", 1792, 5120, 1, 32),
    ("v41 q_b 32768x1280", 32768, 1280, 1, 32),
    ("v41 o_a 8x1024x4096 grouped", 1024, 4096, 8, 32),
    ("v41 o_b 5120x8192", 5120, 8192, 1, 32),
    ("wide 32768x4096 fp8/128", 32768, 4096, 1, 128),
)


class _Decode:
    """Context: the FP8 decode the linear launcher picks: bit placement (the library's), or
    with `conversion` the hardware conversion."""

    def __init__(self, conversion: bool):
        self.conversion = conversion
        self.saved = linear_module.fp4_ptx_decode

    def __enter__(self):
        if self.conversion:
            linear_module.fp4_ptx_decode = lambda device: False
        return self

    def __exit__(self, *exc):
        linear_module.fp4_ptx_decode = self.saved


def _dense(name: str, n: int, k: int, groups: int, group: int, m: int) -> str:
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    shape = (m, k) if groups == 1 else (m, groups, k)
    x = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
    make = lambda: quantize_random((n * groups, k), "fp8", group, gen)  # noqa: E731
    call = quantized_linear if groups == 1 else quantized_grouped_linear
    w0 = make()
    weights = [w0] + [make() for _ in range(_copies(_nbytes(w0)) - 1)]
    calls = [lambda w=w: call(x, w) for w in weights]
    with _Decode(False):
        bits = call(x, w0)
    with _Decode(True):
        conv = call(x, w0)
    equal = torch.equal(bits.view(torch.int16), conv.view(torch.int16))
    times = {}
    for conversion in (False, True, True, False):
        with _Decode(conversion):
            times.setdefault(conversion, []).append(time_us(calls, _reps(len(calls))))
    b, c = (sum(times[v]) / 2 for v in (False, True))
    return f"| {name} | {m} | {equal} | {c:.1f} | {b:.1f} | {c / b:.2f} |"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--m", default="1,4,16")
    p.add_argument("--budget-s", type=float, default=200.0)
    a = p.parse_args()
    SETUP.device = "cuda"
    start = time.time()
    lines = [
        "| shape | M | bits equal | conversion us | bit placement us | conversion / bits |",
        "|---|---|---|---|---|---|",
    ]
    for name, n, k, groups, group in DENSE:
        for m in (int(v) for v in a.m.split(",")):
            if time.time() - start > a.budget_s:
                lines.append(f"| {name} | {m} | skipped: budget | | | |")
                continue
            try:
                line = _dense(name, n, k, groups, group, m)
            except Exception as exc:  # noqa: BLE001
                line = f"| {name} | {m} | FAIL {type(exc).__name__}: {exc}"[:200] + " | | | |"
            print(line, flush=True)
            lines.append(line)
            if a.out:
                Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
