"""The register-fed Gluon kernels of the decode-linear probes (`benchmark/kernels/probe_fma_gemv.py`
for FP8, `probe_w_first_fp4.py` for MXFP4) compile for sm90 as their probes launch them, and their
K loops have the structure they exist to time: the weight straight from global memory into the
matrix unit's operand registers (mma.sync), with no shared memory in the loop (a program whose
warps split K adds their slices' sums through it once, after the loop), no asynchronous copies
and no spilled registers. Gluon kernels do not run in the CPU interpreter (their results are checked
against dequantise-then-reference by the probes on the GPU, before timing); this compiles them
with `benchmark/kernels/probe_quant_sass.py`, in a subprocess free of TRITON_INTERPRET."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_probe_gluon_kernels_keep_the_k_loop_in_registers() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark/kernels/probe_quant_sass.py"), "--only", "gluon"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| gluon")]
    kernels = {row.split("|")[1].split()[2] for row in rows}  # fp8/32, mxfp4/32
    assert kernels == {"fp8/32", "mxfp4/32"} and len(rows) >= 8, proc.stdout
    split = 0
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        stack, shared, copies, mix = cells[3], cells[4], cells[5], cells[8]
        assert (stack, copies) == ("0", "0"), row
        assert "HMMA:" in mix and "LDG:" in mix, row
        assert not any(op in mix for op in ("LDS:", "STS:", "BAR:")), row
        # Shared memory only where a program's warps split K: their slices' sums, added once
        # after the loop (a warp's partial tile of fp32: at most 16 rows x 16 tokens a warp).
        warps = int(cells[1].split(",")[1].split()[0])
        if shared != "0":
            split += 1
            assert int(shared) <= warps * 16 * 16 * 4, row
    assert split >= 2, proc.stdout  # the K-split variants of both formats were compiled
