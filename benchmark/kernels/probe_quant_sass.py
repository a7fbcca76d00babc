"""Probe (no GPU needed): the quantised GEMMs compiled for sm90 as the launcher would launch them,
and what their K loop costs per weight byte.

    python benchmark/kernels/probe_quant_sass.py [--only SUBSTRING] [--keep DIR]

Each case calls a launcher on CPU tensors with its kernel replaced by a recorder, compiles the
recorded launch with Triton's toolchain for sm90 (pointer alignment and integer divisibility
specialised as the runtime launcher does, the device variant of every constexpr: the recorder and
the specialisation of `test/registered/kernels/gpu_targets_check.py`), disassembles it
with the `nvdisasm` Triton ships, and reports registers, spilled bytes, shared memory, whether
the weight tiles are asynchronous copies, and the instruction mix of the K loop (the largest
loop of the SASS) with its warp-instructions per weight byte. An SM issues at most 4
warp-instructions per clock, and at full HBM bandwidth it must consume bandwidth / (SMs x clock)
bytes per clock (about 18 at 4.8 TB/s, 132 SMs, 1.98 GHz), so a loop above 4 / that (~0.22)
cannot reach the bandwidth however its loads overlap (a static bound: latency, occupancy and
the memory system are not modelled).

The `gluon` cases are the probes' register-fed Gluon kernels (`probe_fma_gemv.py`,
`probe_w_first_fp4.py`), launched by their probes' launchers and compiled from Gluon's IR with the
same specialisation: no pipeline, so no asynchronous copies and "None stages". A kernel with two
K loops (the per-token stage 2 beside an FP8 extra expert) reports the larger, whose bytes a
step are counted in the stack's format.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.experimental.gluon._runtime import GluonASTSource

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python"), str(ROOT / "test/registered/kernels")]

from gpu_targets_check import (  # noqa: E402
    TARGETS,
    launch_source,
    mixed_moe_case,
    mixed_token_gemms_case,
    on_target,
    quantized_linear_case,
    quantized_moe_case,
    quantized_token_gemms_case,
    record_launches,
    resource_usage,
)

TARGET = TARGETS["sm90"][0]
_BIN = Path(importlib.import_module("triton.backends.nvidia").__file__).parent / "bin"


def _mix(lines: list[str]) -> collections.Counter:
    ops = collections.Counter()
    for line in lines:
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m[1]] += 1
    return ops


def loop_mix(sass: str) -> collections.Counter:
    """Instruction mix of the largest loop of a SASS listing: a predicated backward branch (an
    unpredicated one is the warp-divergence handler's jump back, not a loop)."""
    lines = sass.splitlines()
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    best = (0, -1)
    for i, line in enumerate(lines):
        m = re.search(r"@!?U?P\w+\s+BRA\s+`\((\.L_x_\d+)\)", line)
        if m and m[1] in labels and labels[m[1]] < i and i - labels[m[1]] > best[1] - best[0]:
            best = (labels[m[1]], i)
    return _mix(lines[best[0] : best[1] + 1])


# name -> (module, kernel, launcher call)
CASES: dict[str, tuple[str, str, Callable[[], object]]] = {}
# The per-token experts' two kernels (module, kernel).
_TOKEN_KERNELS = (
    ("sgl_dspark.kernels.moe.token_gemm", "_moe_route_gate_up_kernel"),
    ("sgl_dspark.kernels.moe.token_down", "_moe_token_down_kernel"),
)
for _fmt, _group in (("fp8", 128), ("fp8", 32), ("mxfp4", 32)):
    _tag = f"{_fmt}/{_group}"
    # 32 rows: the library's two row blocks a program, each dequantised tile multiplied by both
    CASES[f"linear {_tag} 4096x4096 m32 two blocks"] = (
        "sgl_dspark.kernels.linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case(_fmt, 4096, 4096, _group, m=32),
    )
    CASES[f"linear {_tag} 4096x4096"] = (
        "sgl_dspark.kernels.linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case(_fmt, 4096, 4096, _group, m=1),
    )
    CASES[f"linear {_tag} 32768x4096"] = (
        "sgl_dspark.kernels.linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case(_fmt, 32768, 4096, _group, m=1),
    )
for _fmt, _group in (("fp8", 128), ("mxfp4", 32)):
    for _block in (16, 32):
        CASES[f"moe grouped {_fmt}/{_group} block {_block}"] = (
            "sgl_dspark.kernels.moe.grouped_gemm",
            "_moe_grouped_gemm_kernel",
            quantized_moe_case(_fmt, _group, _block),
        )
    for _module, _kernel in _TOKEN_KERNELS:
        CASES[f"moe {_kernel.strip('_')} {_fmt}/{_group}"] = (
            _module,
            _kernel,
            quantized_token_gemms_case(_fmt, _group),
        )
# V4.1's shared expert (FP8 32 x 32) folded beside MXFP4 routed experts: one kernel holds both
# formats' K loops (the loop reported is the larger).
CASES["moe grouped mxfp4/32 + fp8/32 extra, block 16"] = (
    "sgl_dspark.kernels.moe.grouped_gemm",
    "_moe_grouped_gemm_kernel",
    mixed_moe_case(),
)
for _module, _kernel in _TOKEN_KERNELS:
    CASES[f"moe {_kernel.strip('_')} mxfp4/32 + fp8/32 extra"] = (
        _module,
        _kernel,
        mixed_token_gemms_case(),
    )


# The register-fed Gluon kernels of `probe_fma_gemv.py` (FP8) and `probe_w_first_fp4.py`
# (MXFP4), launched by their probes' own launchers at V4.1-Flash shapes, one token; their K
# step is GROUPS scale groups of 32 channels.
def _probe_case(probe: str, launcher: str, fmt: str, n: int, k: int, config: tuple):
    def run() -> None:
        from benchmark.kernels import bench_quant_gemm as bq

        bq.SETUP.device = "cpu"
        module = importlib.import_module(f"benchmark.kernels.{probe}")
        weight = bq.quantize_random((n, k), fmt, 32, torch.Generator().manual_seed(0))
        getattr(module, launcher)(torch.randn(1, k).to(torch.bfloat16), weight, *config)

    return run


GLUON_CASES: dict[str, tuple[str, str, Callable[[], object]]] = {}
for _config in (
    (16, 8, 1, 8, 8),
    (32, 8, 2, 8, 8),
    (16, 16, 1, 8, 16),
    (32, 8, 2, 8, 8, False, True),
    (16, 8, 4, 8, 8, False, False, 4),
    (32, 8, 4, 8, 8, False, False, 2),
):
    GLUON_CASES[f"gluon w-first fp8/32 1792x5120 {_config}"] = (
        "benchmark.kernels.probe_fma_gemv",
        "_gluon_mma_w_first_kernel",
        _probe_case("probe_fma_gemv", "gluon_mma_w_first_linear", "fp8", 1792, 5120, _config),
    )
for _config in ((16, 8, 1, 8), (32, 4, 1, 8), (64, 4, 2, 8), (32, 8, 2, 16), (16, 2, 4, 8, 4)):
    GLUON_CASES[f"gluon w-first mxfp4/32 5120x2304 {_config}"] = (
        "benchmark.kernels.probe_w_first_fp4",
        "_w_first_fp4_kernel",
        _probe_case("probe_w_first_fp4", "w_first_fp4_linear", "mxfp4", 5120, 2304, _config),
    )


def _w8a8_operands(n: int, k: int) -> tuple:
    """A random FP8 32 x 32 weight [n, k] and one token's activation quantised by the reference
    quantiser (32-channel groups, power-of-two scales), on the CPU."""
    from sgl_dspark.kernels.fp8.reference import quantize_act_fp8_ref

    from benchmark.kernels import bench_quant_gemm as bq

    bq.SETUP.device = "cpu"
    weight = bq.quantize_random((n, k), "fp8", 32, torch.Generator().manual_seed(0))
    act = quantize_act_fp8_ref(torch.randn(1, k).to(torch.bfloat16), 32, ue8m0=True)
    return act, weight


# The W8A8 probe's kernel (`probe_w8a8_decode.py`: the weight's 64 rows the warpgroup MMA's row
# side, both operands E4M3 codes, no weight decode), launched by its launcher with its K splits
# (BLOCK_N, scale groups a step, splits, stages).
def _w8a8_case(n: int, k: int, config: tuple):
    def run() -> None:
        module = importlib.import_module("benchmark.kernels.probe_w8a8_decode")
        module.w8a8_wgmma_linear(*_w8a8_operands(n, k), *config)

    return run


for _config in ((64, 4, 4, 4), (64, 2, 4, 8), (128, 4, 2, 4)):
    CASES[f"w8a8 wgmma fp8/32 1792x5120 {_config}"] = (
        "benchmark.kernels.probe_w8a8_decode",
        "_w8a8_wgmma_kernel",
        _w8a8_case(1792, 5120, _config),
    )
CASES.update(GLUON_CASES)


# The library's W8A8 GEMM (`fp8/w8a8.py`: 64-row tiles, the warpgroup MMA on E4M3 codes) at one
# token with narrower column tiles than its prefill shape (`probe_w8a8_decode.py` times them).
def _w8a8_library_case(n: int, k: int, meta: dict):
    def run() -> None:
        from unittest import mock

        from sgl_dspark.kernels.fp8 import w8a8

        act, weight = _w8a8_operands(n, k)
        shaped = {**w8a8._gemm_meta(1), **meta}
        with mock.patch.object(w8a8, "_gemm_meta", lambda m: shaped):
            w8a8.w8a8_linear(act, weight, 32)

    return run


for _meta in (
    {},
    {"BLOCK_N": 64},
    {"BLOCK_N": 32},
    {"BLOCK_N": 16},
    {"BLOCK_N": 32, "num_stages": 8},
):
    CASES[f"w8a8 library fp8/32 1792x5120 {_meta}"] = (
        "sgl_dspark.kernels.fp8.w8a8",
        "_w8a8_gemm_kernel",
        _w8a8_library_case(1792, 5120, _meta),
    )


# The tensor-descriptor (TMA) form of the quantised linear (`probe_tma_linear.py`), launched by its
# probe's launcher at V4.1-Flash shapes, one token, with the library's launch shape.
def _tma_case(fmt: str, n: int, k: int, overrides: dict):
    def run() -> None:
        from benchmark.kernels import bench_quant_gemm as bq

        bq.SETUP.device = "cpu"
        module = importlib.import_module("benchmark.kernels.probe_tma_linear")
        weight = bq.quantize_random((n, k), fmt, 32, torch.Generator().manual_seed(0))
        module.tma_linear(torch.randn(1, k).to(torch.bfloat16), weight, **overrides)

    return run


for _fmt, _n, _k in (("fp8", 1792, 5120), ("fp8", 32768, 1280), ("mxfp4", 5120, 2304)):
    for _label, _overrides in (("", {}), (" 6 stages", {"stages": 6})):
        CASES[f"tma {_fmt}/32 {_n}x{_k}{_label}"] = (
            "benchmark.kernels.probe_tma_linear",
            "_tma_linear_kernel",
            _tma_case(_fmt, _n, _k, _overrides),
        )


def _step_bytes(kwargs: dict, fp4: bool) -> int:
    """Stored weight bytes one K step of one program multiplies (the per-token stage 2 forms
    GROUP_SLOTS of a token's SLOTS slots a program; a Gluon probe's step is GROUPS scale groups
    in each of its WARPS_K slices)."""
    columns = kwargs["BLOCK_N"] * kwargs.get("GROUP_SLOTS", kwargs.get("SLOTS", 1))
    if "BLOCK_K" in kwargs:
        block_k = kwargs["BLOCK_K"]
    else:
        block_k = kwargs["GROUPS"] * kwargs["GROUP"] * kwargs.get("WARPS_K", 1)
    return columns * block_k // (2 if fp4 else 1)


def probe(name: str, keep: str | None) -> list[str]:
    module, kernel, run = CASES[name]
    out = []
    seen = set()
    rec = record_launches(module, kernel, run)
    for args, kwargs in rec.calls:
        key = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int))))
        if key in seen or not kwargs.get("QUANT", True):
            continue
        seen.add(key)
        kwargs = {k: v for k, v in kwargs.items() if k != "launch_pdl"}
        src, options = launch_source(rec.fn, args, on_target(kwargs, TARGET), TARGET)
        if name in GLUON_CASES:  # the same specialisation, compiled from Gluon's IR
            constants = src.constants
            src = GluonASTSource(src.fn, src.signature, None, src.attrs)
            src.constants = constants
        compiled = triton.compile(src, target=TARGET, options=options)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(keep or tmp, f"{name.replace(' ', '_').replace('/', '_')}.cubin")
            Path(cubin).write_bytes(compiled.asm["cubin"])
            sass = subprocess.run(
                [str(_BIN / "nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True
            ).stdout
        usage = resource_usage(compiled.asm["cubin"])
        mix = loop_mix(sass)
        total = sum(mix.values())
        fp4 = kwargs.get("FP4", "mxfp4" in name)  # the Gluon probes name their format
        per_byte = total * kwargs.get("num_warps", 4) / _step_bytes(kwargs, fp4)
        ttgir = compiled.asm["ttgir"]
        asyncs = ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy")
        top = " ".join(f"{op}:{n}" for op, n in mix.most_common(12))
        out.append(
            f"| {name} | {kwargs['BLOCK_N']} x {_step_bytes(kwargs, False) // kwargs['BLOCK_N']}, "
            f"{kwargs.get('num_warps')} "
            f"warps, {kwargs.get('num_stages')} stages | {usage['REG']} | "
            f"{usage['STACK']} | {compiled.metadata.shared} | {asyncs} | {total} | "
            f"{per_byte:.3f} | {top} |"
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="", help="substring of the case names")
    p.add_argument("--keep", default=None, help="keep the cubins in this directory")
    a = p.parse_args()
    print(
        "| case | tile, launch | regs | stack B | smem B | async copies | loop instr/warp "
        "| warp-instr / weight B | loop mix |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in CASES:
        if a.only in name:
            print("\n".join(probe(name, a.keep)), flush=True)


if __name__ == "__main__":
    main()
