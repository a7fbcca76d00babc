"""Lightning-indexer scores over a variable context in one launch (`indexer_logits_ref` is the
spec; the math is in `reference.py`). The output width n_max is a host int (context capacity //
m), so the launch shape is static and the launcher is CUDA-graph safe: nothing is read back from
the device.

Schedule ("varctx"): one program per (token, chunk of BLOCK_N entries). A chunk that starts at or
beyond the token's visible count writes -inf and returns before loading any key, so the work
follows each token's real context, not n_max.

Exactness: within a tolerance of the reference. Products of bf16/fp16 inputs are exact in fp32 and
everything is accumulated in fp32 (fp32 inputs use an IEEE fp32 dot, never TF32), as in the
reference; only the order of the Di-long dot products and of the Hi-long head sum differs, so fp32
scores agree to a few ulp of the largest term (relative ~1e-6). The -inf pattern is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import FLOAT_DTYPES, require
from sgl_dspark.kernels._triton_utils import interpreted, programmatic_launch, wait_for_producers
from sgl_dspark.kernels.compressor.entry_rows import load_entry_rows

_MIN_DOT = 16  # tl.dot needs every tile dimension >= 16


@triton.jit
def _indexer_logits_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    pos_ptr,
    slot_ptr,
    table_ptr,
    out_ptr,
    num_heads,
    head_dim,
    n_max,
    ratio,
    table_width,
    scale,
    weight_scale,
    q_stride_t,
    q_stride_h,
    w_stride_t,
    keys_stride,
    table_stride,
    out_stride_t,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # Before the early -inf store too: every input is an activation, cache or index of earlier
    # kernels (the head weights w are per-token activations), and out may still be read.
    wait_for_producers(PDL)
    token = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK_N
    cols = first + tl.arange(0, BLOCK_N)
    in_row = cols < n_max
    out_row = out_ptr + token * out_stride_t + cols
    visible = (tl.load(pos_ptr + token) + 1) // ratio
    if first >= visible:
        # The whole chunk lies beyond the token's context: no key is loaded.
        tl.store(out_row, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=in_row)
        return

    seen = in_row & (cols < visible)
    req = tl.load(slot_ptr + token)
    entry = load_entry_rows(table_ptr + req * table_stride, cols, ratio, table_width, seen)

    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < head_dim
    keys = tl.load(
        keys_ptr + entry[:, None] * keys_stride + dims[None, :],
        mask=seen[:, None] & in_dim[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    heads = tl.arange(0, BLOCK_H)
    in_head = heads < num_heads
    q = tl.load(
        q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
        mask=in_head[:, None] & in_dim[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    # Pad heads have q = 0 and w = 0, so they add exact zeros to the head sum.
    # fp32(w) * weight_scale, as the reference: the layer's scaled copy is no separate launch.
    w = tl.load(w_ptr + token * w_stride_t + heads, mask=in_head, other=0.0).to(tl.float32)
    w = w * weight_scale
    if DOT_FP32:
        q = q.to(tl.float32)
        keys = keys.to(tl.float32)
    dots = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
    per_head = tl.maximum(dots, 0.0) * scale
    score = tl.sum(per_head * w[:, None], axis=0)
    tl.store(out_row, tl.where(seen, score, float("-inf")), mask=in_row)


def indexer_logits(
    qi: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    req_to_token: torch.Tensor,
    ratio: int,
    n_max: int,
    *,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """`indexer_logits_ref` in one launch.

    Args:
        qi: [T, Hi, Di] bf16/fp16/fp32, unit stride along Di (token/head strides free).
        weights: [T, Hi] fp32 or qi's dtype, unit stride along Hi (the row stride free: the
            layer passes a column view of its fused projection's output).
        index_keys: [num_entry_slots, Di] of qi's dtype, unit stride along Di.
        positions, token_slot: [T] int64 (contiguous).
        req_to_token: [slots, max_ctx] int64, unit stride along max_ctx.
        ratio: m >= 1; n_max >= 0: host ints (the launch shape depends only on T and n_max).
        out: optional [T, n_max] fp32 buffer with unit column stride.
        block_n: entries per program (power of two >= 16).
        weight_scale: the head weights are used as fp32(weights) * weight_scale.
    Returns:
        ``out`` [T, n_max] fp32: the scores of `indexer_logits_ref`, -inf beyond each token's
        visible entries.
    """
    require(
        qi.dim() == 3 and qi.dtype in FLOAT_DTYPES,
        f"qi must be [T, Hi, Di] bf16/fp16/fp32, got {qi.dtype} {tuple(qi.shape)}",
    )
    tokens, num_heads, head_dim = qi.shape
    require(
        weights.shape == (tokens, num_heads) and weights.dtype in (torch.float32, qi.dtype),
        f"weights must be fp32 or {qi.dtype} [{tokens}, {num_heads}], got "
        f"{weights.dtype} {tuple(weights.shape)}",
    )
    require(
        index_keys.dim() == 2
        and index_keys.shape[1] == head_dim
        and (index_keys.dtype == qi.dtype),
        f"index_keys must be [slots, {head_dim}] {qi.dtype}, got "
        f"{index_keys.dtype} {tuple(index_keys.shape)}",
    )
    for name, t in (("positions", positions), ("token_slot", token_slot)):
        require(
            t.shape == (tokens,) and t.dtype == torch.int64 and t.is_contiguous(),
            f"{name} must be contiguous int64 [{tokens}], got {t.dtype} {tuple(t.shape)}",
        )
    require(
        req_to_token.dim() == 2 and req_to_token.dtype == torch.int64,
        f"req_to_token must be int64 [slots, max_ctx], got {req_to_token.dtype} "
        f"{tuple(req_to_token.shape)}",
    )
    require(
        ratio >= 1 and n_max >= 0,
        f"ratio must be >= 1 and n_max >= 0, got ratio={ratio} n_max={n_max}",
    )
    require(
        block_n >= _MIN_DOT and (not block_n & block_n - 1),
        f"block_n must be a power of two >= {_MIN_DOT}, got {block_n}",
    )
    if out is None:
        out = torch.empty((tokens, n_max), dtype=torch.float32, device=qi.device)
    require(
        out.shape == (tokens, n_max) and out.dtype == torch.float32,
        f"out must be fp32 [{tokens}, {n_max}], got {out.dtype} {tuple(out.shape)}",
    )
    if tokens == 0 or n_max == 0:
        return out
    for name, t in (
        ("qi", qi),
        ("weights", weights),
        ("index_keys", index_keys),
        ("req_to_token", req_to_token),
        ("out", out),
    ):
        require(
            t.stride(-1) == 1, f"{name} must have unit stride in its last dim, got {t.stride()}"
        )
    block_n = min(block_n, max(_MIN_DOT, triton.next_power_of_2(n_max)))
    grid = (tokens, triton.cdiv(n_max, block_n))
    _indexer_logits_kernel[grid](
        qi,
        weights,
        index_keys,
        positions,
        token_slot,
        req_to_token,
        out,
        num_heads,
        head_dim,
        n_max,
        ratio,
        req_to_token.shape[1],
        head_dim**-0.5,
        float(weight_scale),
        qi.stride(0),
        qi.stride(1),
        weights.stride(0),
        index_keys.stride(0),
        req_to_token.stride(0),
        out.stride(0),
        BLOCK_H=max(_MIN_DOT, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        # Widening bf16/fp16 tiles to fp32 changes no value (their products are exact in fp32);
        # the CPU interpreter needs it because its bf16 tl.dot is wrong (triton 3.6).
        DOT_FP32=qi.dtype == torch.float32 or interpreted(_indexer_logits_kernel),
        **programmatic_launch(_indexer_logits_kernel, qi.device),
    )
    return out
