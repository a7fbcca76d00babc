"""The split-K gate GEMV of hash-routed layers over only each token's own experts.

A hash layer's experts are `tid2eid[token]`, fixed by the token id, and its weights are the
scores of those TOPK experts alone, renormalised (`router_topk_ref`). So the logits of the other
E - TOPK experts are never needed: program (row, split) dots x's K chunk with the row's TOPK gate
rows only (TOPK x H weights per row, 48 KB at H 4096 and top-6, instead of the whole E x H gate,
3 MB at E 384) and stores the partials where the full GEMV would; the routing launch of
`router.py` then sums them in split order and finishes as for any hash row. (One program per row
over the whole K would be a dependent, latency-bound K loop.)

Numerics: a partial is one fp32 tree reduction of the chunk's products (x and the weight in
fp32), fixed per split, so a row's bits depend neither on M nor on the other rows (DSpark's
verify rows reproduce decode rows). It differs from the full GEMV's tl.dot order and from
torch's, so the weights are within a tolerance of the reference (ulp level, like the scores'
transcendentals); ids exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers

_WARPS = 4


@triton.jit
def _hash_gemv_partials_kernel(
    x_ptr,
    gate_ptr,
    input_ids_ptr,
    tid2eid_ptr,
    partials_ptr,
    num_rows,
    hidden,
    num_experts,
    num_tokens,
    stride_x,
    stride_gate,
    stride_tid,
    TOPK: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, split): the fp32 partial logits of the row's TOPK experts over K range
    [split * SPLIT_K, +SPLIT_K), stored at partials[split, row, expert] (the full GEMV's layout,
    so the routing launch sums them in split order as for any x source)."""
    wait_for_producers(PDL)  # x is the previous kernel's output
    row = tl.program_id(0)
    split = tl.program_id(1)
    slots = tl.arange(0, BLOCK_TOPK)
    ok = slots < TOPK
    # Ids are clamped into their tables: a padding row's stale ids read and write in bounds.
    token = tl.load(input_ids_ptr + row).to(tl.int64)
    token = tl.minimum(tl.maximum(token, 0), num_tokens - 1)
    expert = tl.load(tid2eid_ptr + token * stride_tid + slots, mask=ok, other=0).to(tl.int64)
    expert = tl.minimum(tl.maximum(expert, 0), num_experts - 1)
    ks = split * SPLIT_K + tl.arange(0, SPLIT_K)
    k_ok = ks < hidden
    xk = tl.load(x_ptr + row.to(tl.int64) * stride_x + ks, mask=k_ok, other=0.0)
    wk = tl.load(
        gate_ptr + expert[:, None] * stride_gate + ks[None, :],
        mask=ok[:, None] & k_ok[None, :],
        other=0.0,
    )
    partial = tl.sum(wk.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
    dst = partials_ptr + (split.to(tl.int64) * num_rows + row) * num_experts + expert
    tl.store(dst, partial, mask=ok)  # a repeated expert stores the same value twice


def hash_gemv_partials(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    input_ids: torch.Tensor,
    tid2eid: torch.Tensor,
    partials: torch.Tensor,
    split_k: int,
) -> None:
    """partials [S, M, E] (S = ceil(H / split_k)) at each row's own experts = the split-K partial
    logits of x [M, H] @ gate [E, H].T; the other entries are left as they are (the hash route
    never reads them). Called by `router.router_topk`, which validates the arguments."""
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    topk = tid2eid.shape[1]
    _hash_gemv_partials_kernel[(num_rows, triton.cdiv(hidden, split_k))](
        x,
        gate_weight,
        input_ids,
        tid2eid,
        partials,
        num_rows,
        hidden,
        gate_weight.shape[0],
        tid2eid.shape[0],
        x.stride(0),
        gate_weight.stride(0),
        tid2eid.stride(0),
        TOPK=topk,
        BLOCK_TOPK=triton.next_power_of_2(topk),
        SPLIT_K=split_k,
        num_warps=_WARPS,
        **programmatic_launch(_hash_gemv_partials_kernel, x.device),
    )
