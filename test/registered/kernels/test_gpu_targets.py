"""Every kernel compiles for NVIDIA sm90 and AMD gfx950 and fits their shared memory, at the
launches of the benchmark cases (DeepSeek-V4-Flash shapes) and the hand-written runtime cases
(see `gpu_targets_check.py`); the FP8 kernels also emit their matrix instructions (the W8A8
GEMMs sm90's `wgmma ... e4m3.e4m3` and gfx950's FP8 MFMA, the MX MoE gfx950's
`v_mfma_scale_f32_*_f8f6f4`), the quantised GEMMs' K loops wait on no load of their own
step (`check_k_loops`), and register-capped launches spill nothing (`check_register_caps`);
checked without a GPU, in a subprocess free of TRITON_INTERPRET."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpu_targets_check import INSTRUCTIONS, K_LOOP_KERNELS, PDL_KERNELS
from sgl_dspark.kernels.mhc.post_combine import _MAX_BLOCK_M

CHECK = Path(__file__).with_name("gpu_targets_check.py")


def test_kernels_compile_for_sm90_and_gfx950() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[3] / "python"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, str(CHECK), "--all"], env=env, capture_output=True, text=True, timeout=900
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Every kernel module's kernels were launched and compiled (21 kernels today).
    assert len([x for x in lines if x.startswith("ok ")]) >= 21, proc.stdout
    # The programmatic-launch kernels compile with and without PDL (`check_programmatic_launch`).
    assert len([x for x in lines if x.startswith("ok pdl ")]) == len(PDL_KERNELS), proc.stdout
    # The quantised GEMMs' K loops wait on no scale load of their own step and keep the
    # dequantised tiles in registers (`check_k_loops`).
    assert len([x for x in lines if x.startswith("ok loops ")]) == len(K_LOOP_KERNELS), proc.stdout
    # The FP8 kernels emit the matrix instructions they exist for (sm90's FP8 wgmma, gfx950's
    # FP8 and scaled MFMA), within shared memory at the run-time specialisation.
    assert len([x for x in lines if x.startswith("ok asm ")]) == len(INSTRUCTIONS), proc.stdout
    # The mHC boundary's phase A at every row tile, single and two pass: a capped tile stays
    # within its cap without spilling (`check_register_caps`).
    tiles = _MAX_BLOCK_M.bit_length()  # 1, 2, 4, ... rows
    regs = [x for x in lines if x.startswith("ok regs ")]
    assert len(regs) == 2 * tiles, proc.stdout
    assert len([x for x in regs if "(cap None)" not in x]) == 1, regs  # V4.1's 8-row tile
