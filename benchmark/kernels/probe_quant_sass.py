"""Probe (no GPU needed): the quantised GEMMs compiled for sm90 as the launcher would launch them,
and what their K loop costs per weight byte.

    python benchmark/kernels/probe_quant_sass.py [--only SUBSTRING] [--keep DIR]

Each case calls a launcher on CPU tensors with its kernel replaced by a recorder, compiles the
recorded launch with Triton's toolchain for sm90 (pointer alignment and integer divisibility
specialised as the runtime launcher does, the device variant of every constexpr), disassembles it
with the `nvdisasm` Triton ships, and reports registers, spilled bytes, shared memory, whether
the weight tiles are asynchronous copies, and the instruction mix of the K loop (the largest
loop of the SASS) with its warp-instructions per weight byte. An SM issues at most 4
warp-instructions per clock, and at full HBM bandwidth it must consume bandwidth / (SMs x clock)
bytes per clock (about 18 at 4.8 TB/s, 132 SMs, 1.98 GHz), so a loop above 4 / that (~0.22)
cannot reach the bandwidth however its loads overlap (a static bound: latency, occupancy and
the memory system are not modelled).
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
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sgl_dspark.kernels.linear.reference import QuantizedWeight  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_BIN = Path(importlib.import_module("triton.backends.nvidia").__file__).parent / "bin"
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _record(module: str, kernel: str, run: Callable[[], object]) -> list[tuple]:
    """The launches of `module.kernel` that `run` makes, as (JIT function, args, kwargs); every
    kernel of the module records instead of running (the launchers are called on CPU)."""
    from triton.runtime.jit import JITFunction

    mod = importlib.import_module(module)
    real = {
        n: o for n, o in vars(mod).items() if isinstance(o, JITFunction) and n.endswith("_kernel")
    }
    recs = {n: _Recorder() for n in real}
    for n, rec in recs.items():
        setattr(mod, n, rec)
    try:
        run()
    finally:
        for n, fn in real.items():
            setattr(mod, n, fn)
    return [(real[kernel], args, kwargs) for args, kwargs in recs[kernel].calls]


def _compile(fn, args: tuple, kwargs: dict):
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    call = {k: v for k, v in kwargs.items() if k in fn.arg_names or k in _OPTIONS}
    bound, specialization, options = binder(*args, **call)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, call, bound, specialization, options
    )
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def _mix(lines: list[str]) -> collections.Counter:
    ops = collections.Counter()
    for line in lines:
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m[1]] += 1
    return ops


def loop_mix(sass: str) -> collections.Counter:
    """Instruction mix of the largest loop (a backward branch) of a SASS listing."""
    lines = sass.splitlines()
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    best = (0, -1)
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if m and m[1] in labels and labels[m[1]] < i and i - labels[m[1]] > best[1] - best[0]:
            best = (labels[m[1]], i)
    return _mix(lines[best[0] : best[1] + 1])


def _quantized(fmt: str, shape: tuple[int, ...], group: int) -> QuantizedWeight:
    *lead, n, k = shape
    rows = group if fmt == "fp8" else 1
    if fmt == "fp8":
        data = torch.zeros(*lead, n, k, dtype=torch.uint8).view(torch.float8_e4m3fn)
    else:
        data = torch.zeros(*lead, n, k // 2, dtype=torch.uint8)
    scale = torch.full((*lead, -(-n // rows), -(-k // group)), 120, dtype=torch.uint8)
    return QuantizedWeight(data, scale, fmt, group, rows)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


def _linear(fmt: str, group: int, n: int, k: int, m: int = 1):
    from sgl_dspark.kernels.linear.quantized import quantized_linear

    return lambda: quantized_linear(_bf16(m, k), _quantized(fmt, (n, k), group))


def _moe_grouped(fmt: str, group: int, block_size: int):
    from sgl_dspark.kernels.moe.grouped_gemm import fused_moe
    from sgl_dspark.kernels.moe.reference import MoeSortOutput

    sort = MoeSortOutput(
        torch.zeros(64, dtype=torch.int32),
        torch.zeros(64),
        torch.zeros(64 // block_size, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(4, 4096),
    )
    return lambda: fused_moe(
        _bf16(4, 4096),
        _quantized(fmt, (2, 4096, 4096), group),
        _quantized(fmt, (2, 4096, 2048), group),
        sort,
        6,
        10.0,
        block_size=block_size,
    )


def _moe_token(fmt: str, group: int):
    from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up, moe_token_down_reduce

    table = torch.tensor([0, 1, 2], dtype=torch.int32)
    ids = torch.tensor([[0, 1, 2, 0, 1, 1]], dtype=torch.int32)

    def run() -> None:
        h = moe_route_gate_up(
            _bf16(1, 4096), _quantized(fmt, (2, 4096, 4096), group), ids, table, 2, 10.0
        )
        down = _quantized(fmt, (2, 4096, 2048), group)
        moe_token_down_reduce(h, down, ids, torch.ones(1, 6), table, 2, 1.0, _bf16(1, 4096))

    return run


# name -> (module, kernel, launcher call)
CASES: dict[str, tuple[str, str, Callable[[], object]]] = {}
for _fmt, _group in (("fp8", 128), ("fp8", 32), ("mxfp4", 32)):
    _tag = f"{_fmt}/{_group}"
    CASES[f"linear {_tag} 4096x4096"] = (
        "sgl_dspark.kernels.linear.quantized",
        "_quantized_linear_kernel",
        _linear(_fmt, _group, 4096, 4096),
    )
    CASES[f"linear {_tag} 32768x4096"] = (
        "sgl_dspark.kernels.linear.quantized",
        "_quantized_linear_kernel",
        _linear(_fmt, _group, 32768, 4096),
    )
for _fmt, _group in (("fp8", 128), ("mxfp4", 32)):
    for _block in (16, 32):
        CASES[f"moe grouped {_fmt}/{_group} block {_block}"] = (
            "sgl_dspark.kernels.moe.grouped_gemm",
            "_moe_grouped_gemm_kernel",
            _moe_grouped(_fmt, _group, _block),
        )
    for _kernel in ("_moe_route_gate_up_kernel", "_moe_token_down_kernel"):
        CASES[f"moe {_kernel.strip('_')} {_fmt}/{_group}"] = (
            "sgl_dspark.kernels.moe.token_gemm",
            _kernel,
            _moe_token(_fmt, _group),
        )


def _step_bytes(kwargs: dict) -> int:
    """Stored weight bytes one K step of one program multiplies."""
    columns = kwargs["BLOCK_N"] * kwargs.get("SLOTS", 1)
    return columns * kwargs["BLOCK_K"] // (2 if kwargs.get("FP4") else 1)


def probe(name: str, keep: str | None) -> list[str]:
    module, kernel, run = CASES[name]
    out = []
    seen = set()
    for fn, args, kwargs in _record(module, kernel, run):
        key = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int))))
        if key in seen or not kwargs.get("QUANT", True):
            continue
        seen.add(key)
        compiled = _compile(fn, args, kwargs)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(keep or tmp, f"{name.replace(' ', '_').replace('/', '_')}.cubin")
            Path(cubin).write_bytes(compiled.asm["cubin"])
            sass = subprocess.run(
                [str(_BIN / "nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True
            ).stdout
            usage = subprocess.run(
                [str(_BIN / "cuobjdump"), "--dump-resource-usage", cubin],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        mix = loop_mix(sass)
        total = sum(mix.values())
        per_byte = total * kwargs.get("num_warps", 4) / _step_bytes(kwargs)
        asyncs = compiled.asm["ttgir"].count("async_copy_global_to_local")
        top = " ".join(f"{op}:{n}" for op, n in mix.most_common(12))
        out.append(
            f"| {name} | {kwargs['BLOCK_N']} x {kwargs['BLOCK_K']}, {kwargs.get('num_warps')} "
            f"warps, {kwargs.get('num_stages')} stages | {regs[1] if regs else '?'} | "
            f"{regs[2] if regs else '?'} | {compiled.metadata.shared} | {asyncs} | {total} | "
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
