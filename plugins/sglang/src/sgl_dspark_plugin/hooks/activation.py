"""Clamped SwiGLU of DeepSeek-V4's experts: `silu_mul_clamp` for SGLang's
``silu_and_mul_clamp(input, output, swiglu_limit)`` (in place into ``output``).

Both compute y = silu(min(g, limit)) * clamp(u, -limit, limit) from bf16 or fp32 rows and round
y once. SGLang clamps bf16 inputs against the limit rounded to bf16, ours against the fp32
limit: the same whenever the limit is a bf16 value (V4's 10.0 is), so other limits stay on
SGLang's path. The sigmoid's exp differs (exp2 here, __expf there): at most one bf16 ulp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sgl_dspark_plugin.contract import Target
from sgl_dspark_plugin.hooks._common import decline, kernels_run_on

NAME = "silu_mul_clamp"
OURS = ("sgl_dspark.kernels:silu_mul_clamp",)
TARGET = Target(
    "sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp",
    ("input", "output", "swiglu_limit"),
)


def around(
    original: Callable[..., None], input: torch.Tensor, output: torch.Tensor, swiglu_limit: float
) -> None:
    from sgl_dspark.kernels import silu_mul_clamp

    limit = float(swiglu_limit)
    if input.dim() != 2 or input.dtype not in (torch.bfloat16, torch.float32):
        decline(NAME, "input is not a bf16/fp32 [rows, 2I] matrix")
        return original(input, output, swiglu_limit)
    rows, inter = input.shape[0], input.shape[1] // 2
    if (
        input.shape[1] % 2
        or input.stride(1) != 1
        or output.shape != (rows, inter)
        or output.dtype != input.dtype
        or not output.is_contiguous()
    ):
        decline(NAME, "layout outside the kernel's contract (odd width, strides or output)")
        return original(input, output, swiglu_limit)
    if not limit > 0:
        decline(NAME, "swiglu_limit <= 0")
        return original(input, output, swiglu_limit)
    if input.dtype == torch.bfloat16 and float(torch.tensor(limit, dtype=torch.bfloat16)) != limit:
        decline(NAME, "swiglu_limit is not a bf16 value (SGLang clamps against its bf16 rounding)")
        return original(input, output, swiglu_limit)
    if not kernels_run_on(input, output):
        decline(NAME, f"tensors on {input.device.type}")
        return original(input, output, swiglu_limit)
    silu_mul_clamp(input, limit, out=output)
    return None
