"""DeepSeek-V4.1's ratio-2 compressor at decode / verify in one launch (`csa2_pair_pool_ref` is
the spec): each row's group {p - 1, p} pooled by the softmax of the two gate scores, its pool
row, and the row recorded in the pending-pair ring. The torch chain it replaces is some fifty
kernels a kv source (gathers, selects, stacks, the softmax, the ring's index writes).

One program per row, the whole row in registers. Reads before writes: a program writes only its
own ring row `p mod R`, and the rows read from the ring are partners `p' - 1` older than this
forward's first row of that request, which the ring (longer than any verify) never maps onto a
row written here.

Exactness: the addressing (partner, ring rows, pool rows, start positions) and the ring's fp32
copies are exact. The pooled row is within a tolerance: `exp` lowers differently from torch's
(the hardware exp2 on GPU, numpy's exp interpreted); the rest is torch's order of separate fp32
operations (max, the two exponentials, their sum, correctly rounded divisions, the two weighted
rows added in slot order, FMA contraction off), rounded once to kv's dtype (nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import FLOAT_DTYPES, check_index_vector, require
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    programmatic_launch,
    round_to_dtype,
    wait_for_producers,
)
from sgl_dspark.kernels.compressor.reference import PairGroups


@triton.jit
def _csa2_pair_pool_kernel(
    kv_ptr,
    score_ptr,
    kv_row_stride,
    score_row_stride,
    ring_kv_ptr,
    ring_score_ptr,
    ring_slot_stride,
    ring_row_stride,
    ring,
    pos_ptr,
    slot_ptr,
    prefix_ptr,
    table_ptr,
    table_row_stride,
    pooled_ptr,
    start_ptr,
    rows_ptr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # kv and score are the projection's output
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    partner = pos - 1
    fresh = partner >= tl.load(prefix_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < D
    prev = tl.maximum(t - 1, 0)
    ring_base = slot * ring_slot_stride + cols
    ring_prev = ring_base + (tl.maximum(partner, 0) % ring) * ring_row_stride
    kv_t = tl.load(kv_ptr + t * kv_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    sc_t = tl.load(score_ptr + t * score_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    # The partner from this forward's previous row or from the ring (one of the two is read).
    kv_p = tl.where(
        fresh,
        tl.load(kv_ptr + prev * kv_row_stride + cols, mask=in_row & fresh, other=0.0).to(
            tl.float32
        ),
        tl.load(ring_kv_ptr + ring_prev, mask=in_row & ~fresh, other=0.0),
    )
    sc_p = tl.where(
        fresh,
        tl.load(score_ptr + prev * score_row_stride + cols, mask=in_row & fresh, other=0.0).to(
            tl.float32
        ),
        tl.load(ring_score_ptr + ring_prev, mask=in_row & ~fresh, other=0.0),
    )
    top = tl.maximum(sc_p, sc_t)
    e_p = tl.exp(sc_p - top)
    e_t = tl.exp(sc_t - top)
    total = e_p + e_t
    pooled = tl.div_rn(e_p, total) * kv_p + tl.div_rn(e_t, total) * kv_t
    pooled = round_to_dtype(pooled, KIND, ON_BITS)
    tl.store(pooled_ptr + t * D + cols, pooled.to(pooled_ptr.dtype.element_ty), mask=in_row)
    start = pos - 1
    closes = (pos + 1) % 2 == 0
    row = tl.load(table_ptr + slot * table_row_stride + tl.maximum(start, 0)).to(tl.int64) // 2
    tl.store(start_ptr + t, start)
    tl.store(rows_ptr + t, tl.where(closes, row, 0))
    ring_row = ring_base + (pos % ring) * ring_row_stride
    tl.store(ring_kv_ptr + ring_row, kv_t, mask=in_row)
    tl.store(ring_score_ptr + ring_row, sc_t, mask=in_row)


def csa2_pair_pool(
    kv: torch.Tensor,
    score: torch.Tensor,
    ring_kv: torch.Tensor,
    ring_score: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    token_prefix: torch.Tensor,
    req_to_token: torch.Tensor,
) -> PairGroups:
    """`csa2_pair_pool_ref` in one launch (arguments and result as there; graph-safe, no host
    read). kv / score: [T, Dh] with unit stride along Dh; the rings contiguous fp32."""
    require(
        kv.dim() == 2 and score.shape == kv.shape and kv.dtype in FLOAT_DTYPES,
        f"kv / score: expected one [T, Dh] float shape, got {tuple(kv.shape)} {kv.dtype} and "
        f"{tuple(score.shape)}",
    )
    require(kv.stride(1) == 1 and score.stride(1) == 1, "kv / score: need unit stride along Dh")
    tokens, d = kv.shape
    for name, ring in (("ring_kv", ring_kv), ("ring_score", ring_score)):
        require(
            ring.dim() == 3
            and ring.dtype == torch.float32
            and ring.shape[2] == d
            and ring.shape == ring_kv.shape
            and ring.is_contiguous(),
            f"{name}: expected contiguous fp32 [slots, R, {d}], got {ring.dtype} "
            f"{tuple(ring.shape)}",
        )
    for name, vector in (
        ("positions", positions),
        ("token_slot", token_slot),
        ("token_prefix", token_prefix),
    ):
        check_index_vector(name, vector, tokens)
    require(
        req_to_token.dim() == 2 and req_to_token.stride(1) == 1,
        f"req_to_token: expected [slots, C] with unit stride, got {tuple(req_to_token.shape)}",
    )
    pooled = torch.empty_like(kv, memory_format=torch.contiguous_format)
    start = torch.empty(tokens, dtype=torch.int64, device=kv.device)
    rows = torch.empty(tokens, dtype=torch.int64, device=kv.device)
    if tokens and d:
        _csa2_pair_pool_kernel[(tokens,)](
            kv,
            score,
            kv.stride(0),
            score.stride(0),
            ring_kv,
            ring_score,
            ring_kv.stride(0),
            ring_kv.stride(1),
            ring_kv.shape[1],
            positions,
            token_slot,
            token_prefix,
            req_to_token,
            req_to_token.stride(0),
            pooled,
            start,
            rows,
            D=d,
            BLOCK_D=triton.next_power_of_2(d),
            KIND=DTYPE_KIND[kv.dtype],
            ON_BITS=interpreted(_csa2_pair_pool_kernel),
            num_warps=4,
            enable_fp_fusion=False,  # torch's separate products and sum
            **programmatic_launch(_csa2_pair_pool_kernel, kv.device),
        )
    return PairGroups(pooled, start, rows)


__all__ = ["csa2_pair_pool"]
