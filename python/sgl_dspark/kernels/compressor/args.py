"""Argument checks of the compressor launchers (`pool.py`, `decode.py`, `extend.py`)."""

from __future__ import annotations

import torch

from sgl_dspark.kernels._checks import FLOAT_DTYPES, require


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
    """Layouts every compressor launcher needs; returns (T, Dh)."""
    require(
        kv.dim() == 2 and kv.dtype in FLOAT_DTYPES,
        f"kv must be [T, W] bf16/fp16/fp32, got {kv.dtype} {tuple(kv.shape)}",
    )
    tokens, width = kv.shape
    head_dim = norm_weight.shape[0] if norm_weight.dim() == 1 else -1
    require(
        head_dim >= 1 and width == (2 * head_dim if overlap else head_dim),
        f"kv width {width} must be {'2*' if overlap else ''}Dh with Dh = "
        f"norm_weight's length, got norm_weight {tuple(norm_weight.shape)}",
    )
    require(
        score.shape == kv.shape and score.dtype == kv.dtype,
        f"score must match kv ({kv.dtype} {tuple(kv.shape)}), got "
        f"{score.dtype} {tuple(score.shape)}",
    )
    for name, t in (("state_kv", state_kv), ("state_score", state_score)):
        require(
            t.dim() == 3 and t.shape[2] == width and t.dtype == kv.dtype and t.stride(2) == 1,
            f"{name} must be [req_slots, R, {width}] {kv.dtype} with unit "
            f"channel stride, got {t.dtype} {tuple(t.shape)} {t.stride()}",
        )
    require(
        state_score.shape == state_kv.shape,
        f"state_score {tuple(state_score.shape)} != state_kv {tuple(state_kv.shape)}",
    )
    require(
        position_bias.shape == (ratio, width) and position_bias.dtype in (torch.float32, kv.dtype),
        f"position_bias must be [{ratio}, {width}] fp32 or {kv.dtype}, got "
        f"{position_bias.dtype} {tuple(position_bias.shape)}",
    )
    for name, t in (
        ("positions", positions),
        ("token_slot", token_slot),
        ("token_prefix", token_prefix),
    ):
        require(
            t.shape == (tokens,) and t.dtype == torch.int64 and t.is_contiguous(),
            f"{name} must be contiguous int64 [{tokens}], got {t.dtype} {tuple(t.shape)}",
        )
    require(
        req_to_token.dim() == 2 and req_to_token.dtype == torch.int64,
        f"req_to_token must be int64 [slots, max_ctx], got {req_to_token.dtype}",
    )
    require(ratio >= 1, f"ratio must be >= 1, got {ratio}")
    if tokens > 0:  # an empty batch launches nothing, so its layouts do not matter
        for name, t in (("kv", kv), ("score", score), ("req_to_token", req_to_token)):
            require(
                t.stride(-1) == 1,
                f"{name} must have unit stride in its last dim, got {t.stride()}",
            )
        require(
            position_bias.is_contiguous() and norm_weight.is_contiguous(),
            "position_bias and norm_weight must be contiguous",
        )
    return tokens, head_dim


def check_fused_args(
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
    cos: torch.Tensor,
    sin: torch.Tensor,
    entries: torch.Tensor,
) -> None:
    """`check_compressor_args` plus the entry pool and the rope tables of the launchers that
    rotate and store the entries (`decode.py`, `extend.py`)."""
    tokens, head_dim = check_compressor_args(
        kv,
        score,
        state_kv,
        state_score,
        position_bias,
        norm_weight,
        positions,
        token_slot,
        token_prefix,
        req_to_token,
        ratio,
        overlap,
    )
    require(
        entries.dim() == 2
        and entries.shape[1] == head_dim
        and entries.dtype == kv.dtype
        and entries.stride(1) == 1,
        f"entries must be [slots, {head_dim}] {kv.dtype} with unit channel "
        f"stride, got {entries.dtype} {tuple(entries.shape)}",
    )
    require(
        cos.shape == sin.shape
        and cos.dim() == 2
        and cos.shape[0] == tokens
        and cos.dtype == torch.float32
        and sin.dtype == torch.float32
        and 1 <= 2 * cos.shape[1] <= head_dim
        and head_dim % 2 == 0
        and cos.stride(1) == 1
        and sin.stride(1) == 1
        and cos.stride(0) == sin.stride(0),
        f"cos/sin must be fp32 [{tokens}, rd/2] with 2 <= rd <= Dh={head_dim} "
        f"(Dh even), unit stride along rd/2 and one row stride; got "
        f"{cos.dtype} {tuple(cos.shape)} / {sin.dtype} {tuple(sin.shape)}",
    )
    span = 2 * ratio if overlap else ratio
    require(
        state_kv.shape[1] >= span + 1,
        f"state ring of {state_kv.shape[1]} rows is too short for span {span}",
    )
