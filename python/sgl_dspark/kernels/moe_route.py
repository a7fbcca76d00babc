"""K2 + K3: MoE router gate -> top-k ids and weights, padded rows filled, in one or two launches.

Logits come from one of three sources:
  * x [M, H] and gate_weight [E, H]: a split-K GEMV (fixed 16-row x 16-expert x 512-K tiles, 192
    programs per row block at H 4096, E 384). With `_RouteMeta.fused` the last GEMV program of a
    row block (a per-block counter it resets) routes the block (one launch); else a second launch;
  * partials fp32 [S, M, E] from an external split-K GEMV, summed in order s = 0..S-1;
  * logits fp32 [M, E].
Then per row: scores (sqrtsoftplus | sigmoid), selection on scores + correction bias, top-k,
weights = unbiased scores of the chosen experts, renormalised (w / (sum + 1e-20)), times the routed
scaling factor; appended shared-expert columns; rows >= n_valid (device int32 scalar) get `fill_id`
/ weight 0. Hash routing (ids = tid2eid[input_ids]) is another switch; from x it is
`moe_route_hash.py`'s GEMV (only the token's experts' gate rows are read) + the routing launch.

Numerics (the spec is `router_topk_ref`):
  * sqrtsoftplus(l) = sqrt_rn(l if l > 20 else log2(1 + exp2(l * log2e)) * ln2);
    sigmoid(l) = 1 / (1 + exp2(-l * log2e)). exp2/log2 lowerings differ by backend, so weights are
    X2 at the ulp level; everything after the scores is exact fp32 in a fixed order.
  * A row's logits never depend on M, the grid or `_route_meta`: the GEMV tile, K split and chains
    are constants and the splits are summed in order s = 0..S-1.
  * NaN score -> weight 0 and selection value -inf.
  * Tie rule: descending selection value; equal values -> the lower expert id first (-0.0 == +0.0),
    i.e. `torch.sort(..., descending=True, stable=True)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from sgl_dspark.kernels._checks import require as _require
from sgl_dspark.kernels._router_math import hash_route_rows
from sgl_dspark.kernels._router_math import scores as _scores
from sgl_dspark.kernels._triton_utils import (
    prefetch_tile_l2,
    programmatic_launch,
    wait_for_producers,
)
from sgl_dspark.kernels.moe_route_hash import hash_gemv_partials

_SCORINGS = {"sqrtsoftplus": 0, "sigmoid": 1}
_SOURCE_X, _SOURCE_LOGITS, _SOURCE_PARTIALS = 0, 1, 2
# GEMV tile: fixed for every M so a row's logits come from the same instructions whatever the
# batch (also on MFMA, whose instruction depends on the tile): 16 rows (the tl.dot minimum), 16
# experts (the smallest dot width: many programs at M = 1), K split 512 as CHAINS pieces of one
# batched dot (sm90: the MMA chain is 8 deep, not 32; the pieces are then summed).
_SPLIT_K = 512
_GEMV_ROWS = 16
_GEMV_EXPERTS = 16
_GEMV_CHAINS = 4  # changes the logits' rounding (alike for every M); sweep_router.py times 1/2/4
_GEMV_WARPS = 4  # also the fused tail's: 4 rows route at once, one per warp
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


class _RouteMeta(NamedTuple):
    """Launch shape of the routing step: changes no result bit (sweep_router.py checks that)."""

    fused: bool  # x source: the last GEMV program of a row block routes it (one launch)
    tail_rows: int  # fused: rows per step of that program's loop (4 = one row per warp)
    rows: int  # routing launch: rows per program
    warps: int  # routing launch: num_warps (rows >= warps: each warp owns whole rows)
    gemv_stages: int  # GEMV num_stages: its K loop runs once, staging only costs shared memory
    unroll: bool  # top-k slots unrolled (ILP across slots) or a loop (a 6x smaller i-cache need)


def _route_meta(num_rows: int, interpreted: bool = False) -> _RouteMeta:
    """The launch shape for M rows; the one place sweep_router.py patches. H200 (kernels.md):
    two launches, a one-warp program per routed row, rolled top-k: 7.7 us at M = 1 against 8.9
    for the last GEMV program routing its block, 8.9 / 9.5 at M = 32 (5.9 us at M = 1 once both
    launches are programmatic). The CPU interpreter pays per program: 16 rows each there."""
    if interpreted:
        return _RouteMeta(num_rows <= 8, 4, 16, 4, 2, False)
    return _RouteMeta(False, 4, 1, 1, 2, False)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Per-layer routing options.

    topk: routed experts per token. scoring: "sqrtsoftplus" | "sigmoid". renormalize: divide the
    routed weights by (their sum + 1e-20). routed_scaling_factor: then multiply them by this.
    fill_id: id written to padded rows (0 on HIP, -1 on CUDA, E for MegaMoE; kernels.md §K3).
    num_shared / shared_weight / shared_id_base: append `num_shared` columns with ids
    shared_id_base + j (None -> E) and weight `shared_weight`.
    """

    topk: int
    scoring: str = "sqrtsoftplus"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    fill_id: int = 0
    num_shared: int = 0
    shared_weight: float = 1.0
    shared_id_base: int | None = None

    def __post_init__(self) -> None:
        if self.scoring not in _SCORINGS:
            raise ValueError(f"scoring must be one of {sorted(_SCORINGS)}, got {self.scoring!r}")
        if self.topk < 1 or self.num_shared < 0:
            raise ValueError(f"need topk >= 1, num_shared >= 0: {self.topk}, {self.num_shared}")


class RouterTopkOutput(NamedTuple):
    """ids: int32 [M, topk + num_shared]; weights: fp32 [M, topk + num_shared]."""

    ids: torch.Tensor
    weights: torch.Tensor


class RouterWorkspace(NamedTuple):
    """Scratch for the x source: fp32 partials (>= S*M*E elements) and int32 counters
    (>= ceil(M / 16), zero before the first launch; the kernel leaves them zero)."""

    partials: torch.Tensor
    counters: torch.Tensor


def make_router_workspace(
    max_rows: int, num_experts: int, hidden: int, device: torch.device | str
) -> RouterWorkspace:
    """Allocate a reusable workspace (keep one per layer shape: no memset per call)."""
    splits = triton.cdiv(hidden, _SPLIT_K)
    return RouterWorkspace(
        torch.empty(splits * max_rows * num_experts, dtype=torch.float32, device=device),
        torch.zeros(triton.cdiv(max(max_rows, 1), _GEMV_ROWS), dtype=torch.int32, device=device),
    )


def _logits_ref(
    x: torch.Tensor | None,
    gate_weight: torch.Tensor | None,
    logits: torch.Tensor | None,
    partials: torch.Tensor | None,
) -> torch.Tensor:
    if logits is not None:
        return logits.float()
    if partials is not None:
        total = partials[0].float()
        for part in partials[1:]:
            total = total + part.float()
        return total
    assert x is not None and gate_weight is not None
    return x.float() @ gate_weight.float().t()


def _scores_ref(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sqrtsoftplus":
        soft = torch.log2(1.0 + torch.exp2(logits * _LOG2E)) * _LN2
        return torch.sqrt(torch.where(logits > 20.0, logits, soft))
    return 1.0 / (1.0 + torch.exp2(-logits * _LOG2E))


def router_topk_ref(
    config: RouterConfig,
    *,
    x: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    logits_out: torch.Tensor | None = None,
    workspace: RouterWorkspace | None = None,
) -> RouterTopkOutput:
    """Reference (the spec); same arguments as `router_topk` (`workspace` is ignored)."""
    full_logits = _logits_ref(x, gate_weight, logits, partials)
    if logits_out is not None:
        logits_out.copy_(full_logits)
    scores = _scores_ref(full_logits, config.scoring)
    num_rows, num_experts = scores.shape
    gather_src = torch.where(torch.isnan(scores), torch.zeros_like(scores), scores)
    if tid2eid is not None:
        assert input_ids is not None
        ids = tid2eid[input_ids.long()].long()
    else:
        choice = scores if correction_bias is None else scores + correction_bias.float()
        choice = torch.where(torch.isnan(choice), torch.full_like(choice, -float("inf")), choice)
        ids = torch.sort(choice, dim=1, descending=True, stable=True).indices[:, : config.topk]
    weights = gather_src.gather(1, ids)
    if config.renormalize:
        total = weights[:, 0]
        for slot in range(1, config.topk):  # slot order, as the kernel sums
            total = total + weights[:, slot]
        weights = weights / (total + 1e-20)[:, None]
    weights = weights * config.routed_scaling_factor
    ids = ids.to(torch.int32)
    if config.num_shared:
        base = num_experts if config.shared_id_base is None else config.shared_id_base
        shared = torch.arange(base, base + config.num_shared, dtype=torch.int32, device=ids.device)
        ids = torch.cat([ids, shared.expand(num_rows, -1)], dim=1)
        shared_weights = weights.new_full((num_rows, config.num_shared), config.shared_weight)
        weights = torch.cat([weights, shared_weights], dim=1)
    if n_valid is not None:
        is_pad = torch.arange(num_rows, device=ids.device) >= n_valid.reshape(()).to(ids.device)
        ids = torch.where(is_pad[:, None], torch.full_like(ids, config.fill_id), ids)
        weights = torch.where(is_pad[:, None], torch.zeros_like(weights), weights)
    return RouterTopkOutput(ids.contiguous(), weights.contiguous())


@triton.jit
def _row_max(x):
    # Chunks first (in-thread when a warp owns the row), then the lanes: one REDUX on sm90.
    return tl.max(tl.max(x, axis=1, keep_dims=True), axis=2, keep_dims=True)


@triton.jit
def _router_topk_kernel(
    x_ptr,
    gate_ptr,
    logits_ptr,
    partials_ptr,
    counter_ptr,
    bias_ptr,
    n_valid_ptr,
    input_ids_ptr,
    tid2eid_ptr,
    ids_ptr,
    weights_ptr,
    logits_out_ptr,
    num_rows,
    hidden,
    num_experts,
    num_tokens,
    stride_x,
    stride_gate,
    stride_tid,
    routed_scale,
    shared_weight,
    fill_id,
    shared_id_base,
    SOURCE: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_N_VALID: tl.constexpr,
    HASH: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,
    TOPK: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ROUTE: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GEMV_M: tl.constexpr,
    GEMV_N: tl.constexpr,
    GEMV_K: tl.constexpr,
    CHAINS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INTERPRETED: tl.constexpr,
    UNROLL: tl.constexpr,
    PDL: tl.constexpr,
):
    """x source: program (row block, split x expert tile) writes one GEMV partial; with ROUTE the
    last arrival of the row block routes its rows. Else program p routes rows [p * ROWS, +ROWS)."""
    pid = tl.program_id(0)
    row0, row_end = pid * ROWS, pid * ROWS + ROWS
    if SOURCE != 0:  # the logits / partials come from the previous kernel
        wait_for_producers(PDL)
    if SOURCE == 0:
        tile = tl.program_id(1)
        n_etiles = tl.cdiv(num_experts, GEMV_N)
        split = tile // n_etiles
        xrows = pid * GEMV_M + tl.arange(0, GEMV_M)
        experts = (tile - split * n_etiles) * GEMV_N + tl.arange(0, GEMV_N)
        xrow_ok = xrows < num_rows
        expert_ok = experts < num_experts
        acc = tl.zeros([GEMV_M, GEMV_N], dtype=tl.float32)
        if PDL:
            # The gate weight is no kernel's output: its first K tile streams into L2 while the
            # previous kernel finishes. A prefetch, not a load: the pipeliner would hoist the
            # loop's first x load along with it, above the wait (a race, seen on the H200).
            prefetch_tile_l2(
                gate_ptr,
                tl.minimum(experts, num_experts - 1),
                stride_gate,
                split * SPLIT_K,
                hidden,
                GEMV_K,
            )
        wait_for_producers(PDL)
        for k0 in range(split * SPLIT_K, split * SPLIT_K + SPLIT_K, GEMV_K):
            # K as CHAINS contiguous pieces, one batch entry each: their MMA chains run on
            # separate warps, then a fixed-shape sum over the pieces.
            ks = (
                k0
                + tl.arange(0, CHAINS)[:, None] * (GEMV_K // CHAINS)
                + tl.arange(0, GEMV_K // CHAINS)[None, :]
            )
            w_tile = tl.load(
                gate_ptr + experts[None, None, :] * stride_gate + ks[:, :, None],
                mask=(ks < hidden)[:, :, None] & expert_ok[None, None, :],
                other=0.0,
            )
            x_tile = tl.load(
                x_ptr + xrows[None, :, None] * stride_x + ks[:, None, :],
                mask=xrow_ok[None, :, None] & (ks < hidden)[:, None, :],
                other=0.0,
            )
            if DOT_FP32:  # the CPU interpreter's bf16 tl.dot is wrong (triton 3.6): the exact
                x_tile = x_tile.to(tl.float32)  # bf16 products are formed in fp32 instead
                w_tile = w_tile.to(tl.float32)
            # "ieee": fp32 inputs must not go through tf32 (bf16 ignores the setting).
            acc += tl.sum(tl.dot(x_tile, w_tile, input_precision="ieee"), axis=0)
        tl.store(
            partials_ptr
            + split * num_rows * num_experts
            + xrows[:, None] * num_experts
            + experts[None, :],
            acc,
            mask=xrow_ok[:, None] & expert_ok[None, :],
        )
        row0 = pid * GEMV_M
        row_end = tl.minimum(row0 + GEMV_M, num_rows)
        if ROUTE:
            # Release ours, acquire all partials (the barrier orders every thread's store first).
            tl.debug_barrier()
            ticket = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
            is_last = ticket == tl.num_programs(1) - 1
        else:
            is_last = False
    else:
        is_last = True
    if is_last:
        if SOURCE == 0:
            tl.store(counter_ptr + pid, 0)  # ready for the next launch (graph replay)
        n_valid = num_rows
        if HAS_N_VALID:
            n_valid = tl.load(n_valid_ptr)
        if HASH:
            hash_route_rows(
                row0,
                row_end,
                n_valid,
                logits_ptr,
                partials_ptr,
                input_ids_ptr,
                tid2eid_ptr,
                ids_ptr,
                weights_ptr,
                num_rows,
                num_experts,
                num_tokens,
                stride_tid,
                routed_scale,
                shared_weight,
                fill_id,
                shared_id_base,
                SOURCE == 1,
                SCORING,
                RENORMALIZE,
                TOPK,
                NUM_SHARED,
                NUM_SPLITS,
                ROWS,
                BLOCK_OUT,
                not INTERPRETED,
            )
        else:
            # Rows [r0, r0 + ROWS) per loop step. Tile [ROWS, CHUNKS, CHUNK], expert = chunk *
            # CHUNK + lane: CHUNK 128 fills a warp's 32 lanes x 4 and the layout's next axis is
            # the rows, so warps split rows and a row's reductions stay in one warp. Per-row:
            # [ROWS, 1, 1].
            for r0 in range(row0, row_end, ROWS):
                rows = r0 + tl.arange(0, ROWS)[:, None, None]
                cols = (
                    tl.arange(0, CHUNKS)[None, :, None] * CHUNK + tl.arange(0, CHUNK)[None, None, :]
                )
                row_ok = rows < num_rows
                col_ok = cols < num_experts
                tile_ok = row_ok & col_ok
                offs = rows * num_experts + cols
                if SOURCE == 1:
                    logits = tl.load(logits_ptr + offs, mask=tile_ok, other=0.0)
                else:
                    # The reference's order s = 0..S-1; a group's loads are independent, so
                    # SPLIT_GROUP are in flight at once (a round trip per group, bounded registers).
                    logits = tl.load(partials_ptr + offs, mask=tile_ok, other=0.0)
                    for s0 in range(1, NUM_SPLITS, SPLIT_GROUP):
                        for j in tl.static_range(SPLIT_GROUP):
                            live = s0 + j < NUM_SPLITS
                            part = tl.load(
                                partials_ptr + (s0 + j) * num_rows * num_experts + offs,
                                mask=tile_ok & live,
                                other=0.0,
                            )
                            logits = tl.where(live, logits + part, logits)
                    if WRITE_LOGITS:
                        tl.store(logits_out_ptr + offs, logits, mask=tile_ok)
                scores = _scores(logits, SCORING, not INTERPRETED)
                # Scores are >= +0.0 (NaN -> 0), so their bits are int32 >= 0 and a max over
                # "hit ? bits : 0" with one hit gathers them exactly (an int REDUX, no float tree).
                gather_bits = tl.where(scores != scores, 0.0, scores).to(tl.int32, bitcast=True)
                out_cols = tl.arange(0, BLOCK_OUT)[None, None, :]
                out_ids = tl.zeros([ROWS, 1, BLOCK_OUT], dtype=tl.int32)
                out_w = tl.zeros([ROWS, 1, BLOCK_OUT], dtype=tl.float32)
                total = tl.zeros([ROWS, 1, 1], dtype=tl.float32)
                choice = scores
                if HAS_BIAS:  # a full-tile load: a [1, CHUNKS, CHUNK] one gets a layout with the
                    # warps on the chunks, and the whole top-k would follow it
                    choice += tl.load(bias_ptr + rows * 0 + cols, mask=tile_ok, other=0.0)
                choice = tl.where(choice != choice, float("-inf"), choice)
                choice = tl.where(choice == 0.0, 0.0, choice)  # -0.0 and +0.0 must tie
                # Order-preserving int32 key; "taken" (INT_MIN) is below every real key (NaN and
                # -inf included). Per slot: the max key, then the lowest expert holding it.
                bits = choice.to(tl.int32, bitcast=True)
                key = tl.where(col_ok, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), -2147483648)
                for slot in tl.range(0, TOPK, loop_unroll_factor=UNROLL):
                    # the lowest expert holding the max key (a max over negated ids)
                    expert = -_row_max(tl.where(key == _row_max(key), -cols, -2147483647))
                    hit = cols == expert
                    key = tl.where(hit, -2147483648, key)
                    picked = _row_max(tl.where(hit, gather_bits, 0)).to(tl.float32, bitcast=True)
                    out_ids = tl.where(out_cols == slot, expert, out_ids)
                    out_w = tl.where(out_cols == slot, picked, out_w)
                    total += picked
                if RENORMALIZE:
                    out_w = tl.div_rn(out_w, tl.zeros_like(out_w) + (total + 1e-20))
                out_w = out_w * routed_scale
                is_shared = (out_cols >= TOPK) & (out_cols < TOPK + NUM_SHARED)
                out_ids = tl.where(is_shared, shared_id_base + out_cols - TOPK, out_ids)
                out_w = tl.where(is_shared, shared_weight, out_w)
                out_ids = tl.where(rows >= n_valid, fill_id, out_ids)
                out_w = tl.where(rows >= n_valid, 0.0, out_w)
                out_offs = rows * (TOPK + NUM_SHARED) + out_cols
                out_ok = row_ok & (out_cols < TOPK + NUM_SHARED)
                tl.store(ids_ptr + out_offs, out_ids, mask=out_ok)
                tl.store(weights_ptr + out_offs, out_w, mask=out_ok)


def _tile_shape(num_experts: int, rows: int, warps: int, num_splits: int) -> dict[str, int]:
    """Constexprs of a [rows, CHUNKS, CHUNK] routing tile on `warps` warps. SPLIT_GROUP bounds the
    partial loads in flight to ~128 fp32 registers per thread (more would spill)."""
    block_e = triton.next_power_of_2(num_experts)
    per_thread = max(1, block_e * rows // (32 * warps))
    group = max(1, min(num_splits - 1, 128 // per_thread))
    return dict(
        ROWS=rows, CHUNKS=block_e // min(block_e, 128), CHUNK=min(block_e, 128), SPLIT_GROUP=group
    )


def _require_tensor(
    name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> None:
    _require(
        tuple(tensor.shape) == shape and tensor.dtype in dtypes and tensor.stride(-1) == 1,
        f"{name} must be {shape} of {dtypes} with a contiguous last dim, "
        f"got {tuple(tensor.shape)} {tensor.dtype} strides {tensor.stride()}",
    )


def _logits_source(
    x: torch.Tensor | None,
    gate_weight: torch.Tensor | None,
    logits: torch.Tensor | None,
    partials: torch.Tensor | None,
) -> tuple[int, int, int, int, torch.device]:
    """Validate the one given logits source; returns (source, M, E, H or 0, device)."""
    _require(
        sum(t is not None for t in (x, logits, partials)) == 1,
        "give exactly one of x (with gate_weight), logits, partials",
    )
    if x is not None:
        _require(gate_weight is not None and x.dim() == 2, "x [M, H] needs gate_weight [E, H]")
        assert gate_weight is not None
        num_rows, hidden = x.shape
        _require_tensor("x", x, (num_rows, hidden), (torch.bfloat16, torch.float32))
        _require_tensor("gate_weight", gate_weight, (gate_weight.shape[0], hidden), (x.dtype,))
        return _SOURCE_X, num_rows, gate_weight.shape[0], hidden, x.device
    if logits is not None:
        _require(logits.dim() == 2 and logits.is_contiguous(), "logits must be contiguous [M, E]")
        _require_tensor("logits", logits, tuple(logits.shape), (torch.float32,))
        return _SOURCE_LOGITS, logits.shape[0], logits.shape[1], 0, logits.device
    assert partials is not None
    _require(
        partials.dim() == 3 and partials.shape[0] >= 1 and partials.is_contiguous(),
        "partials must be contiguous [S, M, E]",
    )
    _require_tensor("partials", partials, tuple(partials.shape), (torch.float32,))
    return _SOURCE_PARTIALS, partials.shape[1], partials.shape[2], 0, partials.device


def router_topk(
    config: RouterConfig,
    *,
    x: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    logits_out: torch.Tensor | None = None,
    workspace: RouterWorkspace | None = None,
) -> RouterTopkOutput:
    """Router gate + top-k + pad fill in one launch (two for the x source unless
    `_route_meta(M).fused`); graph-safe.

    Args:
        config: the layer's `RouterConfig`.
        x, gate_weight: [M, H] and [E, H], both bf16 or both fp32, last dim contiguous
            (logits = x @ gate_weight.T, fp32 accumulate). Give exactly one source:
            (x, gate_weight), logits or partials.
        logits: fp32 [M, E] contiguous.
        partials: fp32 [S, M, E] contiguous split-K partial sums.
        correction_bias: fp32 [E]; added for selection only (not with hash routing).
        n_valid: int32 device scalar ([] or [1]); rows >= n_valid get fill_id / weight 0.
        input_ids, tid2eid: hash routing: int [M] token ids and int [V, topk] expert table.
        logits_out: optional fp32 [M, E] receiving the summed logits (x / partials sources).
        workspace: scratch for the x source (`make_router_workspace`); allocated if None.
    Returns:
        `RouterTopkOutput` (ids int32, weights fp32, both [M, topk + num_shared]).
    """
    source, num_rows, num_experts, hidden, device = _logits_source(x, gate_weight, logits, partials)
    topk, is_hash = config.topk, tid2eid is not None
    _require(is_hash or topk <= num_experts, f"topk {topk} exceeds E = {num_experts}")
    if tid2eid is not None:
        _require(
            input_ids is not None and correction_bias is None,
            "hash routing needs input_ids and takes no correction_bias",
        )
        assert input_ids is not None
        _require_tensor("tid2eid", tid2eid, (tid2eid.shape[0], topk), (torch.int32, torch.int64))
        _require_tensor("input_ids", input_ids, (num_rows,), (torch.int32, torch.int64))
        _require(logits_out is None, "hash routing gathers its experts' logits only: no logits_out")
    if correction_bias is not None:
        _require_tensor("correction_bias", correction_bias, (num_experts,), (torch.float32,))
    if n_valid is not None:
        _require(
            n_valid.numel() == 1 and n_valid.dtype == torch.int32 and n_valid.device == device,
            "n_valid must be an int32 device scalar",
        )
    if logits_out is not None:
        _require(source != _SOURCE_LOGITS, "logits_out needs the x or partials source")
        _require(logits_out.is_contiguous(), "logits_out must be contiguous")
        _require_tensor("logits_out", logits_out, (num_rows, num_experts), (torch.float32,))

    width = topk + config.num_shared
    ids = torch.empty(num_rows, width, dtype=torch.int32, device=device)
    weights = torch.empty(num_rows, width, dtype=torch.float32, device=device)
    if num_rows == 0:
        return RouterTopkOutput(ids, weights)

    interpreted = isinstance(_router_topk_kernel, InterpretedFunction)
    meta = _route_meta(num_rows, interpreted)
    num_splits = (
        triton.cdiv(hidden, _SPLIT_K)
        if source == _SOURCE_X
        else (partials.shape[0] if partials is not None else 1)
    )
    gemv_k = min(_SPLIT_K, max(16, triton.next_power_of_2(hidden)))
    dummy = ids  # stands in for absent pointer arguments; never dereferenced
    common = dict(
        ids_ptr=ids,
        weights_ptr=weights,
        num_rows=num_rows,
        hidden=hidden,
        num_experts=num_experts,
        num_tokens=tid2eid.shape[0] if tid2eid is not None else 1,
        stride_x=x.stride(0) if x is not None else 0,
        stride_gate=gate_weight.stride(0) if gate_weight is not None else 0,
        stride_tid=tid2eid.stride(0) if tid2eid is not None else 0,
        routed_scale=float(config.routed_scaling_factor),
        shared_weight=float(config.shared_weight),
        fill_id=int(config.fill_id),
        shared_id_base=int(num_experts if config.shared_id_base is None else config.shared_id_base),
        SCORING=_SCORINGS[config.scoring],
        HAS_BIAS=correction_bias is not None,
        HAS_N_VALID=n_valid is not None,
        HASH=is_hash,
        RENORMALIZE=config.renormalize,
        WRITE_LOGITS=logits_out is not None,
        TOPK=topk,
        NUM_SHARED=config.num_shared,
        NUM_SPLITS=num_splits,
        BLOCK_OUT=triton.next_power_of_2(width),
        SPLIT_K=_SPLIT_K,
        GEMV_M=_GEMV_ROWS,
        GEMV_N=_GEMV_EXPERTS,
        GEMV_K=gemv_k,
        CHAINS=max(1, min(_GEMV_CHAINS, gemv_k // 16)),
        DOT_FP32=device.type == "cpu",
        INTERPRETED=interpreted,
        UNROLL=topk if meta.unroll else 1,
        **programmatic_launch(_router_topk_kernel, device),
        **{
            name: t if t is not None else dummy
            for name, t in (
                ("x_ptr", x),
                ("gate_ptr", gate_weight),
                ("logits_ptr", logits),
                ("bias_ptr", correction_bias),
                ("n_valid_ptr", n_valid),
                ("input_ids_ptr", input_ids),
                ("tid2eid_ptr", tid2eid),
                ("logits_out_ptr", logits_out),
            )
        },
    )

    def route_launch(source: int, partials: torch.Tensor | None) -> None:
        _router_topk_kernel[(triton.cdiv(num_rows, meta.rows),)](
            partials_ptr=partials if partials is not None else dummy,
            counter_ptr=dummy,
            SOURCE=source,
            ROUTE=True,
            num_warps=meta.warps,
            **_tile_shape(num_experts, meta.rows, meta.warps, num_splits),
            **common,
        )

    if source != _SOURCE_X:
        route_launch(source, partials)
        return RouterTopkOutput(ids, weights)
    if workspace is None:
        workspace = make_router_workspace(num_rows, num_experts, hidden, device)
    _require(
        workspace.partials.numel() >= num_splits * num_rows * num_experts
        and workspace.counters.numel() >= triton.cdiv(num_rows, _GEMV_ROWS),
        "workspace too small for this call",
    )
    if is_hash:  # the rows' own experts' partials only, then the routing launch
        assert x is not None and gate_weight is not None
        assert input_ids is not None and tid2eid is not None
        hash_gemv_partials(x, gate_weight, input_ids, tid2eid, workspace.partials, _SPLIT_K)
        route_launch(_SOURCE_PARTIALS, workspace.partials)
        return RouterTopkOutput(ids, weights)
    _router_topk_kernel[
        (triton.cdiv(num_rows, _GEMV_ROWS), num_splits * triton.cdiv(num_experts, _GEMV_EXPERTS))
    ](
        partials_ptr=workspace.partials,
        counter_ptr=workspace.counters,
        SOURCE=_SOURCE_X,
        ROUTE=meta.fused,
        **_tile_shape(num_experts, meta.tail_rows, _GEMV_WARPS, num_splits),
        num_warps=_GEMV_WARPS,
        num_stages=meta.gemv_stages,
        **common,
    )
    if not meta.fused:  # every row routed in parallel instead of by one last arrival per block
        route_launch(_SOURCE_PARTIALS, workspace.partials)
    return RouterTopkOutput(ids, weights)
