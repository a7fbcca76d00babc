"""Benchmark cases for the fused RMSNorm (`sgl_dspark.kernels.norm.rmsnorm`) at the norms of one
DeepSeek-V4-Flash decode step.

``CASES`` has the format of `bench_spec.py` (name, make_inputs(M, device), reference, launcher,
check, bytes_moved(M)). Activations are bf16, norm weights fp32 (as the model runner keeps them):
    hidden   final norm (and the layer norms): [M, 4096], weighted
    q_lora   q_a_norm: [M, 1024], weighted
    q_heads  the weightless per-head q norm: [M * 64 heads, 512]
The reference is the unfused torch chain (`rms_norm_ref` == `srt/layers/norm.py::rms_norm`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sgl_dspark.kernels.norm.reference import rms_norm_ref
from sgl_dspark.kernels.norm.rmsnorm import rms_norm

HIDDEN, Q_LORA, HEADS, HEAD_DIM = 4096, 1024, 64, 512
EPS = 1e-6
M_VALUES = (1, 4, 8, 24, 32, 128)


def _make_inputs(
    rows_per_token: int,
    n: int,
    weighted: bool,
) -> Callable[[int, str], dict[str, Any]]:
    def make(m: int, device: str) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(97 * n + m)
        x = torch.randn(m * rows_per_token, n, generator=gen).to(torch.bfloat16)
        weight = 1 + 0.1 * torch.randn(n, generator=gen) if weighted else None
        return dict(x=x.to(device), weight=None if weight is None else weight.to(device), eps=EPS)

    return make


def _check(want: torch.Tensor, got: torch.Tensor) -> None:
    # A tolerance: the mean square is summed in another order, so rstd may differ in its last fp32
    # bit; bf16 outputs then differ by at most two units in the last place, and only rarely.
    torch.testing.assert_close(
        got.float(), want.float(), rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-30
    )
    assert (got == want).float().mean().item() >= 0.99


def _bytes(rows_per_token: int, n: int, weighted: bool) -> Callable[[int], int]:
    # Read x and write the output (bf16), plus the fp32 weight once.
    return lambda m: 2 * 2 * m * rows_per_token * n + (4 * n if weighted else 0)


def _case(name: str, rows_per_token: int, n: int, weighted: bool) -> dict[str, Any]:
    return dict(
        name=name,
        make_inputs=_make_inputs(rows_per_token, n, weighted),
        reference=rms_norm_ref,
        launcher=rms_norm,
        check=_check,
        bytes_moved=_bytes(rows_per_token, n, weighted),
    )


CASES: list[dict[str, Any]] = [
    _case("rmsnorm_hidden_d4096", 1, HIDDEN, True),
    _case("rmsnorm_q_lora_d1024", 1, Q_LORA, True),
    _case("rmsnorm_q_heads_64x512_weightless", HEADS, HEAD_DIM, False),
]
