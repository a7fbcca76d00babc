"""Argument checks shared by the kernel launchers (user-facing errors: ValueError)."""

from __future__ import annotations

import torch


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
) -> None:
    """Exact shape, one of `dtypes`, contiguous, on `device`; the message names the argument."""
    require(tuple(t.shape) == shape, f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    require(t.dtype in dtypes, f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    require(t.is_contiguous(), f"{name}: must be contiguous")
    require(t.device == device, f"{name}: expected device {device}, got {t.device}")


_COMPRESSOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_compressor_args(
    kv: torch.Tensor,
    score: torch.Tensor,
    state_kv: torch.Tensor,
    state_score: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    token_prefix: torch.Tensor,
    req_to_token: torch.Tensor,
    ratio: int,
    overlap: bool,
) -> tuple[int, int]:
    """Layout checks of the compressor launchers (`compressor_pool`, `compressor_decode`,
    `compressor_extend`); returns (T, Dh)."""
    if kv.dim() != 2 or kv.dtype not in _COMPRESSOR_DTYPES:
        raise ValueError(f"kv must be [T, W] bf16/fp16/fp32, got {kv.dtype} {tuple(kv.shape)}")
    tokens, width = kv.shape
    head_dim = norm_weight.shape[0] if norm_weight.dim() == 1 else -1
    if head_dim < 1 or width != (2 * head_dim if overlap else head_dim):
        raise ValueError(
            f"kv width {width} must be {'2*' if overlap else ''}Dh with Dh = "
            f"norm_weight's length, got norm_weight {tuple(norm_weight.shape)}"
        )
    if score.shape != kv.shape or score.dtype != kv.dtype:
        raise ValueError(
            f"score must match kv ({kv.dtype} {tuple(kv.shape)}), got "
            f"{score.dtype} {tuple(score.shape)}"
        )
    for name, t in (("state_kv", state_kv), ("state_score", state_score)):
        if t.dim() != 3 or t.shape[2] != width or t.dtype != kv.dtype or t.stride(2) != 1:
            raise ValueError(
                f"{name} must be [req_slots, R, {width}] {kv.dtype} with unit "
                f"channel stride, got {t.dtype} {tuple(t.shape)} {t.stride()}"
            )
    if state_score.shape != state_kv.shape:
        raise ValueError(
            f"state_score {tuple(state_score.shape)} != state_kv {tuple(state_kv.shape)}"
        )
    if position_bias.shape != (ratio, width) or position_bias.dtype not in (
        torch.float32,
        kv.dtype,
    ):
        raise ValueError(
            f"position_bias must be [{ratio}, {width}] fp32 or {kv.dtype}, got "
            f"{position_bias.dtype} {tuple(position_bias.shape)}"
        )
    for name, t in (
        ("positions", positions),
        ("token_slot", token_slot),
        ("token_prefix", token_prefix),
    ):
        if t.shape != (tokens,) or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous int64 [{tokens}], got {t.dtype} {tuple(t.shape)}"
            )
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int64:
        raise ValueError(f"req_to_token must be int64 [slots, max_ctx], got {req_to_token.dtype}")
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    if tokens > 0:  # an empty batch launches nothing, so its layouts do not matter
        for name, t in (("kv", kv), ("score", score), ("req_to_token", req_to_token)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have unit stride in its last dim, got {t.stride()}")
        if not (position_bias.is_contiguous() and norm_weight.is_contiguous()):
            raise ValueError("position_bias and norm_weight must be contiguous")
    return tokens, head_dim
