"""K2 + K3 for hash-routed layers: the gate GEMV of only the token's own experts, in one launch.

A hash layer's experts are `tid2eid[token]`, fixed by the token id; its weights are the scores of
those TOPK experts alone, renormalised (`moe_route.router_topk_ref`, the spec). So the gate
logits of the other E - TOPK experts are never needed: one program per token row loads the
token's expert ids and dots x with those TOPK gate rows only (TOPK x H weights, 48 KB at H 4096
and top-6, instead of the whole E x H gate, 3 MB at E 384), then scores, renormalises, scales,
appends the shared columns and fills padded rows (`_router_math.finish_hash_rows`, shared with
the from-logits path).

Numerics: each logit is an fp32 dot accumulated over BLOCK_K-wide chunks (x and the weight
converted to fp32, per-lane products summed in chunk order, then one tree reduction); the tile
is fixed, so a row's bits depend neither on M nor on the other rows (DSpark's verify rows
reproduce decode rows). The order differs from the full split-K GEMV of `router_topk`'s top-k
path and from torch's, so weights are X2 against the reference (ulp-level, like the scores'
transcendentals); ids are exact (they come from the table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._router_math import finish_hash_rows
from sgl_dspark.kernels._triton_utils import interpreted, programmatic_launch, wait_for_producers

if TYPE_CHECKING:  # moe_route imports this module
    from sgl_dspark.kernels.moe_route import RouterConfig

# K chunk of the gate rows (TOPK x BLOCK_K fp32 products per iteration) and warps: fixed for
# every M so a row's bits never depend on the batch.
_BLOCK_K = 512
_WARPS = 4


@triton.jit
def _hash_route_x_kernel(
    x_ptr, gate_ptr, input_ids_ptr, tid2eid_ptr, n_valid_ptr, ids_ptr, weights_ptr,
    num_rows, hidden, num_experts, num_tokens, stride_x, stride_gate, stride_tid,
    routed_scale, shared_weight, fill_id, shared_id_base,
    SCORING: tl.constexpr, HAS_N_VALID: tl.constexpr, RENORMALIZE: tl.constexpr,
    TOPK: tl.constexpr, NUM_SHARED: tl.constexpr, BLOCK_OUT: tl.constexpr,
    BLOCK_K: tl.constexpr, BRANCHLESS_SQRT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producers(PDL)  # x is the previous kernel's output
    row = tl.program_id(0)
    rows = row + tl.zeros([1, 1], dtype=tl.int32)
    cols = tl.arange(0, BLOCK_OUT)[None, :]
    ok = cols < TOPK
    # Ids are clamped into their tables: a padding row's stale ids read in bounds.
    token = tl.load(input_ids_ptr + row).to(tl.int64)
    token = tl.minimum(tl.maximum(token, 0), num_tokens - 1)
    expert = tl.load(tid2eid_ptr + token * stride_tid + cols, mask=ok, other=0).to(tl.int32)
    expert = tl.minimum(tl.maximum(expert, 0), num_experts - 1)
    gate_rows = gate_ptr + expert.to(tl.int64).reshape(BLOCK_OUT, 1) * stride_gate
    slot_ok = ok.reshape(BLOCK_OUT, 1)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    acc = tl.zeros([BLOCK_OUT, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        xk = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        wk = tl.load(gate_rows + ks[None, :], mask=slot_ok & k_ok[None, :], other=0.0)
        acc += wk.to(tl.float32) * xk[None, :]
    logits = tl.sum(acc, axis=1).reshape(1, BLOCK_OUT)
    n_valid = tl.load(n_valid_ptr) if HAS_N_VALID else num_rows
    finish_hash_rows(rows, rows < num_rows, cols, expert, logits, ok, n_valid, ids_ptr,
                     weights_ptr, routed_scale, shared_weight, fill_id, shared_id_base, SCORING,
                     RENORMALIZE, TOPK, NUM_SHARED, BRANCHLESS_SQRT)


def hash_route_from_x(x: torch.Tensor, gate_weight: torch.Tensor, input_ids: torch.Tensor,
                      tid2eid: torch.Tensor, n_valid: torch.Tensor | None, ids: torch.Tensor,
                      weights: torch.Tensor, config: RouterConfig, scoring: int,
                      num_experts: int) -> None:
    """Write hash routing's ids and weights [M, topk + num_shared] from x [M, H] and the gate
    [E, H]. Called by `moe_route.router_topk` (the dispatch point, which validates every
    argument; `scoring` is its code of config.scoring); `router_topk_ref` is the reference."""
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    base = num_experts if config.shared_id_base is None else config.shared_id_base
    _hash_route_x_kernel[(num_rows,)](
        x, gate_weight, input_ids, tid2eid, n_valid if n_valid is not None else ids, ids,
        weights, num_rows, hidden, num_experts, tid2eid.shape[0], x.stride(0),
        gate_weight.stride(0), tid2eid.stride(0), float(config.routed_scaling_factor),
        float(config.shared_weight), int(config.fill_id), int(base),
        SCORING=scoring, HAS_N_VALID=n_valid is not None, RENORMALIZE=config.renormalize,
        TOPK=config.topk, NUM_SHARED=config.num_shared,
        BLOCK_OUT=triton.next_power_of_2(config.topk + config.num_shared),
        BLOCK_K=min(_BLOCK_K, triton.next_power_of_2(hidden)),
        BRANCHLESS_SQRT=not interpreted(_hash_route_x_kernel), num_warps=_WARPS,
        **programmatic_launch(_hash_route_x_kernel, x.device))
