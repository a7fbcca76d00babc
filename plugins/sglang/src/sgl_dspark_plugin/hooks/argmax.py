"""Greedy argmax of the DSpark target verify: `vocab_argmax` (chunk pairs of (max, index)
combined in a second launch) for `torch.argmax(logits, dim=-1)`.

`vocab_argmax` follows torch.argmax's order exactly (NaN above every number, ties to the lower
index), so the token ids are equal to SGLang's default path bit for bit. SGLang's opt-in fused
row argmax does not rank NaN as torch does; with this hook on, both settings give torch's ids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sgl_dspark_plugin.contract import Target
from sgl_dspark_plugin.hooks._common import decline, kernels_run_on

NAME = "greedy_argmax"
# What it runs of sglang-dspark (checked at install like the target).
OURS = ("sgl_dspark.kernels:vocab_argmax",)
TARGET = Target(
    "sglang.kernels.ops.speculative.dspark.dspark_accept._row_argmax", ("logits", "fused")
)
# Global indices travel as fp32 between the two launches: exact below 2**24.
_MAX_VOCAB = 1 << 24
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def around(original: Callable[..., torch.Tensor], logits: torch.Tensor, fused: bool = False):
    from sgl_dspark.kernels import vocab_argmax

    if logits.dim() != 2 or logits.dtype not in _DTYPES or logits.shape[1] == 0:
        decline(NAME, "logits are not a non-empty [rows, vocab] fp32/bf16/fp16 matrix")
        return original(logits, fused)
    if logits.stride(1) != 1 or logits.shape[1] >= _MAX_VOCAB:
        decline(NAME, "vocab dim not contiguous or wider than 2**24")
        return original(logits, fused)
    if not kernels_run_on(logits):
        decline(NAME, f"logits on {logits.device.type}")
        return original(logits, fused)
    return vocab_argmax(logits)
