"""DeepSeek-V4.1's indexer on the device: the scores of a kv source's packed FP4 index keys with
the visibility and candidate-block masks applied in the same launch (`v41_index_scores`), and the
block scores the candidate source's two-level top-k ranks (`candidate_block_max`). References:
`v41_index_scores_ref`, `candidate_block_max_ref`.

`v41_index_scores`: grid (T, entry blocks). A program decodes BLOCK_N keys straight from the
cache rows (E2M1 nibbles times their power-of-two scale: exact), forms every head's dot products
with them in one matrix multiply (the keys' even and odd channels against the queries' even
and odd ones: two dots into one accumulator), then sums `w[h] * relu(q[h] . K) * Di^-0.5` over
the heads. bf16 queries multiply in bf16 (the decoded keys are exact in bf16 and the products
exact in fp32); other dtypes in fp32 with IEEE products. Entries past the row's visible count,
or outside the kept candidate blocks, are -inf and read nothing (the masked page-table entries
cost no key loads). Tier: tolerance (the dot products and the head sum run in another order
than the reference's einsum); the masks are exact. A score depends on the token's row and the
entry count (which fixes BLOCK_N), never on T.

`candidate_block_max`: grid (T, block tiles): the maximum of every block of entries and the
pinned newest block. Bit-exact (max only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import INDEX_DTYPES, require
from sgl_dspark.kernels._triton_utils import interpreted, programmatic_launch, wait_for_producers
from sgl_dspark.kernels.indexer.fp4_codec import e2m1_decode


@triton.jit
def _v41_index_scores_kernel(
    q_ptr,
    w_ptr,
    key_ptr,
    scale_ptr,
    rows_ptr,
    visible_ptr,
    keep_ptr,
    out_ptr,
    N,
    NB,
    q_stride_t,
    w_stride_t,
    rows_stride_t,
    key_row_stride,
    scale_row_stride,
    weight_scale,
    score_scale,
    HEADS: tl.constexpr,
    H_POW2: tl.constexpr,
    DI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAND_BLOCK: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # queries, head weights and keys come from earlier kernels
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = offs_n < N
    visible = tl.load(visible_ptr + t)
    live = in_row & (offs_n < visible)
    if HAS_KEEP:
        keep = tl.load(keep_ptr + t * NB + offs_n // CAND_BLOCK, mask=live, other=0)
        live = live & (keep != 0)
    rows = tl.load(rows_ptr + t * rows_stride_t + offs_n, mask=live, other=0).to(tl.int64)
    HALF: tl.constexpr = DI // 2
    offs_p = tl.arange(0, HALF)
    packed = tl.load(
        key_ptr + rows[:, None] * key_row_stride + offs_p[None, :], mask=live[:, None], other=0
    ).to(tl.int32)
    # Element 2i in the low nibble; pair i belongs to the 32-group (2i) // 32 = i // 16.
    exps = tl.load(
        scale_ptr + rows[:, None] * scale_row_stride + (offs_p // 16)[None, :],
        mask=live[:, None],
        other=127,
    ).to(tl.int32)
    scale = (exps << 23).to(tl.float32, bitcast=True)
    k_even = e2m1_decode(packed & 15) * scale
    k_odd = e2m1_decode(packed >> 4) * scale
    # Queries as [Di / 2, heads] operands (even channels, odd channels); padded heads read 0.
    heads = tl.arange(0, H_POW2)
    head_ok = heads < HEADS
    q_cols = q_ptr + t * q_stride_t + heads[None, :] * DI + 2 * offs_p[:, None]
    q_even = tl.load(q_cols, mask=head_ok[None, :], other=0.0)
    q_odd = tl.load(q_cols + 1, mask=head_ok[None, :], other=0.0)
    if DOT_FP32:
        dots = tl.dot(k_even, q_even.to(tl.float32), input_precision="ieee")
        dots = tl.dot(k_odd, q_odd.to(tl.float32), dots, input_precision="ieee")
    else:  # bf16 queries: the decoded keys are exact in bf16
        dots = tl.dot(k_even.to(q_even.dtype), q_even)
        dots = tl.dot(k_odd.to(q_odd.dtype), q_odd, dots)
    w = tl.load(w_ptr + t * w_stride_t + heads, mask=head_ok, other=0.0).to(tl.float32)
    terms = tl.maximum(dots, 0.0) * score_scale * (w * weight_scale)[None, :]
    acc = tl.sum(terms, axis=1)
    out = tl.where(live, acc, float("-inf"))
    tl.store(out_ptr + t * N + offs_n, out, mask=in_row)


def v41_index_scores(
    qi: torch.Tensor,
    weights: torch.Tensor,
    key_data: torch.Tensor,
    key_scales: torch.Tensor,
    entry_rows: torch.Tensor,
    visible: torch.Tensor,
    *,
    weight_scale: float,
    keep_blocks: torch.Tensor | None = None,
    block: int = 1,
) -> torch.Tensor:
    """`v41_index_scores_ref` in one launch, no host sync (arguments as there; qi `[T, Hi, Di]`
    and weights `[T, Hi]` with unit stride in their last dims, Di a power of two >= 32)."""
    require(qi.dim() == 3, f"qi: expected [T, Hi, Di], got shape {tuple(qi.shape)}")
    t, heads, di = qi.shape
    require(di >= 32 and di & (di - 1) == 0, f"qi: Di={di} must be a power of two >= 32")
    require(qi.stride(2) == 1 and qi.stride(1) == di, "qi: heads must be contiguous rows")
    require(
        weights.shape == (t, heads) and weights.stride(1) == 1,
        f"weights: expected [{t}, {heads}] with unit stride, got {tuple(weights.shape)}",
    )
    require(
        key_data.dtype == torch.uint8 and key_data.dim() == 2 and key_data.shape[1] == di // 2,
        f"key_data: expected uint8 [R, {di // 2}], got {key_data.dtype} {tuple(key_data.shape)}",
    )
    require(
        key_scales.dtype == torch.uint8 and key_scales.shape == (key_data.shape[0], di // 32),
        f"key_scales: expected uint8 [{key_data.shape[0]}, {di // 32}], got "
        f"{key_scales.dtype} {tuple(key_scales.shape)}",
    )
    require(key_data.stride(1) == 1 and key_scales.stride(1) == 1, "keys: unit stride rows")
    require(
        entry_rows.dim() == 2 and entry_rows.shape[0] == t and entry_rows.dtype in INDEX_DTYPES,
        f"entry_rows: expected int [{t}, N], got {entry_rows.dtype} {tuple(entry_rows.shape)}",
    )
    require(entry_rows.stride(1) == 1 or entry_rows.shape[1] <= 1, "entry_rows: unit stride")
    require(
        visible.shape == (t,) and visible.dtype in INDEX_DTYPES and visible.is_contiguous(),
        f"visible: expected contiguous int [{t}], got {visible.dtype} {tuple(visible.shape)}",
    )
    n = entry_rows.shape[1]
    nb = -(-n // block) if n else 0
    if keep_blocks is not None:
        require(
            keep_blocks.shape == (t, nb) and keep_blocks.dtype == torch.bool,
            f"keep_blocks: expected bool [{t}, {nb}], got {keep_blocks.dtype} "
            f"{tuple(keep_blocks.shape)}",
        )
        keep_blocks = keep_blocks.contiguous()
    out = torch.empty(t, n, dtype=torch.float32, device=qi.device)
    if t == 0 or n == 0:
        return out
    # 16 entries a program (the matrix unit's least M) while that gives at most 256 programs a
    # token; 64 beyond, so a program's query tile is read for more keys.
    block_n = 16 if n <= 16 * 256 else 64
    _v41_index_scores_kernel[(t, triton.cdiv(n, block_n))](
        qi,
        weights,
        key_data,
        key_scales,
        entry_rows,
        visible,
        keep_blocks.view(torch.uint8) if keep_blocks is not None else visible,
        out,
        n,
        nb,
        qi.stride(0),
        weights.stride(0),
        entry_rows.stride(0),
        key_data.stride(0),
        key_scales.stride(0),
        float(weight_scale),
        float(di**-0.5),
        HEADS=heads,
        H_POW2=max(16, triton.next_power_of_2(heads)),
        DI=di,
        BLOCK_N=block_n,
        CAND_BLOCK=block,
        HAS_KEEP=keep_blocks is not None,
        # The CPU interpreter's 16-bit tl.dot is unreliable: exact products in fp32 there.
        DOT_FP32=qi.dtype != torch.bfloat16 or interpreted(_v41_index_scores_kernel),
        num_warps=4,
        **programmatic_launch(_v41_index_scores_kernel, qi.device),
    )
    return out


@triton.jit
def _candidate_block_max_kernel(
    scores_ptr,
    visible_ptr,
    out_ptr,
    N,
    NB,
    BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_b = tl.program_id(1) * TILE + tl.arange(0, TILE)
    offs_e = tl.arange(0, BLOCK_P)
    entry = offs_b[:, None] * BLOCK + offs_e[None, :]
    m = (offs_b < NB)[:, None] & (offs_e < BLOCK)[None, :] & (entry < N)
    s = tl.load(scores_ptr + t * N + entry, mask=m, other=float("-inf"))
    block_max = tl.max(s, axis=1)
    visible = tl.load(visible_ptr + t)
    newest = tl.minimum(tl.maximum(visible - 1, 0) // BLOCK, NB - 1)
    block_max = tl.where((offs_b == newest) & (visible > 0), float("inf"), block_max)
    tl.store(out_ptr + t * NB + offs_b, block_max, mask=offs_b < NB)


def candidate_block_max(scores: torch.Tensor, visible: torch.Tensor, block: int) -> torch.Tensor:
    """`candidate_block_max_ref` in one launch, no host sync: scores fp32 `[T, N]` contiguous,
    visible int `[T]`, `block` >= 1 entries per block."""
    require(
        scores.dim() == 2 and scores.dtype == torch.float32 and scores.is_contiguous(),
        f"scores: expected contiguous fp32 [T, N], got {scores.dtype} {tuple(scores.shape)}",
    )
    t, n = scores.shape
    require(
        visible.shape == (t,) and visible.dtype in INDEX_DTYPES and visible.is_contiguous(),
        f"visible: expected contiguous int [{t}], got {visible.dtype} {tuple(visible.shape)}",
    )
    require(block >= 1, f"block: expected >= 1, got {block}")
    nb = -(-n // block)
    out = torch.empty(t, nb, dtype=torch.float32, device=scores.device)
    if t == 0 or nb == 0:
        return out
    block_p = triton.next_power_of_2(block)
    tile = max(1, min(triton.next_power_of_2(nb), 4096 // block_p))
    _candidate_block_max_kernel[(t, triton.cdiv(nb, tile))](
        scores,
        visible,
        out,
        n,
        nb,
        BLOCK=block,
        BLOCK_P=block_p,
        TILE=tile,
        num_warps=4,
        **programmatic_launch(_candidate_block_max_kernel, scores.device),
    )
    return out


__all__ = ["candidate_block_max", "v41_index_scores"]
