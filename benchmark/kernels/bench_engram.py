"""Benchmark case for Engram's gated add (`sgl_dspark.kernels.engram.gate`) at DeepSeek-V4.1-Flash's
shapes: 4 mHC streams of 5120, the `wkv` output `[M, 5 * 5120]`, all bf16, eps 1e-20.

``CASES`` has the format of `bench_spec.py` (name, make_inputs(M, device), reference, launcher,
check, bytes_moved(M)). The reference is the torch path (`engram_gate_ref`).
"""

from __future__ import annotations

from typing import Any

import torch
from sgl_dspark.kernels.engram.gate import engram_gate
from sgl_dspark.kernels.engram.reference import engram_gate_ref

HIDDEN, HC = 5120, 4
EPS = 1e-20


def _make_inputs(m: int, device: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5120 + m)
    tensors = dict(
        streams=torch.randn(m, HC, HIDDEN, generator=gen),
        kv=torch.randn(m, (HC + 1) * HIDDEN, generator=gen),
        q_weight=1 + 0.5 * torch.randn(HC, HIDDEN, generator=gen),
        k_weight=1 + 0.5 * torch.randn(HC, HIDDEN, generator=gen),
    )
    return {**{k: v.to(torch.bfloat16).to(device) for k, v in tensors.items()}, "eps": EPS}


def _check(want: torch.Tensor, got: torch.Tensor) -> None:
    # A tolerance: the sums over D run in another order, so the gate may differ in its last fp32
    # bits; a bf16 output then differs by one unit in the last place, and rarely, or where the
    # add cancels by the gate's error times the value: 1e-5 (over ten times the largest gate
    # error seen) times |value| < 6.
    eps = torch.finfo(torch.bfloat16).eps
    larger = torch.maximum(got.float().abs(), want.float().abs())
    assert ((got.float() - want.float()).abs() <= eps * larger + 6e-5).all()
    assert (got == want).float().mean().item() >= 0.99


def _bytes(m: int) -> int:
    # Read the streams and the wkv output, write the streams (bf16), plus both weights once.
    return 2 * (m * HC * HIDDEN + m * (HC + 1) * HIDDEN + m * HC * HIDDEN + 2 * HC * HIDDEN)


CASES: list[dict[str, Any]] = [
    dict(
        name="engram_gate_v41_flash_4x5120",
        make_inputs=_make_inputs,
        reference=engram_gate_ref,
        launcher=engram_gate,
        check=_check,
        bytes_moved=_bytes,
    )
]
