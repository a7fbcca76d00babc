"""`benchmark/kernels/bench_fp8_gemm.py`: its numerics checks pass (the `--smoke` mode on the CPU
interpreter, the full-size checks on a GPU), and the MX MoE check's inputs, its sort plan
included, live on the device they are built for (a plan left on the host makes `moe_sort` refuse
device routes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmark.kernels import bench_fp8_gemm  # noqa: E402

# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def _tensors(case: bench_fp8_gemm.MxMoeCase) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in case._asdict().items():
        if isinstance(value, torch.Tensor):
            out[name] = value
        else:  # a QuantizedWeight or the MoeSortPlan
            out |= {
                f"{name}.{k}": v for k, v in value._asdict().items() if isinstance(v, torch.Tensor)
            }
    return out


def test_mx_case_lives_on_the_device_it_is_built_for() -> None:
    """Built for "meta" (a device other than the host, available without a GPU): every tensor,
    the plan's local-id table included, is there."""
    case = bench_fp8_gemm.mx_moe_case(torch.Generator().manual_seed(0), "meta", small=True)
    tensors = _tensors(case)
    assert "plan.local_table" in tensors and "gate_up.scale" in tensors
    assert {name: t.device.type for name, t in tensors.items()} == {n: "meta" for n in tensors}


def test_mx_case_plan_maps_every_expert_to_itself() -> None:
    # Every expert is local in the check: local id = global id, 4 experts -> 8 histogram bins.
    case = bench_fp8_gemm.mx_moe_case(torch.Generator().manual_seed(0), "cpu", small=True)
    assert case.plan.local_table.tolist() == [0, 1, 2, 3]
    assert (case.plan.num_local, case.plan.num_bins) == (4, 8)
    assert case.mask.tolist() == [1, 1, 1, 1]


def test_checks_pass() -> None:
    """The script's checks, the MX MoE's `moe_sort` of device routes among them: small shapes on
    the CPU interpreter, the full ones on a GPU (its kernels compiled, no timing)."""
    argv = ["--skip-timing"] if torch.cuda.is_available() else ["--smoke"]
    try:
        assert bench_fp8_gemm.main(argv) == 0
    finally:
        bench_fp8_gemm.DEVICE = "cuda"  # `--smoke` switches the module to the CPU
