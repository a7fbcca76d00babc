"""Benchmark cases for the small-M linear (`sgl_dspark.kernels.linear.small_m`) against the
BLAS (`F.linear`, what the "linear" family's torch choice runs), at decode projections:
    mid_x_proj     910M model, a CSA layer's fused x projection: [M, 1024] x [1160, 1024]^T
    mid_o_b        910M model, output projection: [M, 1024] x [1024, 1024]^T
    mid_lm_head    910M model, lm_head: [M, 1024] x [32000, 1024]^T
    flash_q_b      DeepSeek-V4-Flash q_b: [M, 1024] x [32768, 1024]^T (64 heads x 512)
    flash_o_b      DeepSeek-V4-Flash output projection: [M, 8192] x [4096, 8192]^T
Rows beyond the kernel's 16 fall back to `F.linear` (the "linear" family's dispatch), so M = 24,
32 and 128 time the BLAS against itself. ``CASES`` has the format of `bench_spec.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from sgl_dspark.kernels.linear.small_m import MAX_M, small_m_linear


def _dispatch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return small_m_linear(x, weight) if x.shape[0] <= MAX_M else F.linear(x, weight)


def _blas(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def _make_inputs(n: int, k: int) -> Callable[[int, str], dict[str, Any]]:
    def make(m: int, device: str) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(n + k + m)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
        return dict(x=x.to(device), weight=w.to(device))

    return make


def _check(want: torch.Tensor, got: torch.Tensor) -> None:
    # A tolerance: fp32 sums in another order, one rounding to bf16: at most one bf16 ulp, rarely.
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    assert (got == want).float().mean().item() >= 0.9


def _case(name: str, n: int, k: int) -> dict[str, Any]:
    return dict(
        name=name,
        make_inputs=_make_inputs(n, k),
        reference=_blas,
        launcher=_dispatch,
        check=_check,
        bytes_moved=lambda m: 2 * (n * k + m * k + m * n),
    )


CASES: list[dict[str, Any]] = [
    _case("linear_mid_x_proj_1160x1024", 1160, 1024),
    _case("linear_mid_o_b_1024x1024", 1024, 1024),
    _case("linear_mid_lm_head_32000x1024", 32000, 1024),
    _case("linear_flash_q_b_32768x1024", 32768, 1024),
    _case("linear_flash_o_b_4096x8192", 4096, 8192),
]
