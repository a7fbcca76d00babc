"""Router gate -> top-k ids and weights, padded rows filled, in one or two launches
(`router_topk_ref` is the spec; `reference.py` gives the math).

Logits come from one of three sources:
  * x [M, H] and gate_weight [E, H]: a split-K GEMV (fixed 16-row x 16-expert x 512-K tiles, 192
    programs per row block at H 4096, E 384). With `_RouteMeta.fused` the last GEMV program of a
    row block (a per-block counter it resets) routes the block (one launch); else a second launch;
  * partials fp32 [S, M, E] from an external split-K GEMV, summed in order s = 0..S-1;
  * logits fp32 [M, E].
Hash routing from x uses `hash_gemv.py`'s GEMV (only the token's experts' gate rows are read),
then the routing launch.

Numerics: the scores' exp2/log2 lowerings differ by backend, so weights are within a tolerance
(ulp level) of the reference; everything after the scores is exact fp32 in a fixed order, and the
ids are exact (ties included). A row's logits never depend on M, the grid or `_route_meta`: the
GEMV tile, K split and chains are constants and the splits are summed in order s = 0..S-1. The
square root is correctly rounded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import (
    interpreted,
    prefetch_tile_l2,
    programmatic_launch,
    wait_for_producers,
)
from sgl_dspark.kernels.moe.hash_gemv import hash_gemv_partials
from sgl_dspark.kernels.moe.reference import SCORINGS, RouterConfig, RouterTopkOutput
from sgl_dspark.kernels.moe.route_rows import hash_route_rows, topk_route_rows

_SOURCE_X = 0
_SOURCE_LOGITS = 1
_SOURCE_PARTIALS = 2
# GEMV tile: fixed for every M so a row's logits come from the same instructions whatever the
# batch (also on matrix units whose instruction depends on the tile): 16 rows (the tl.dot
# minimum), 16 experts (the smallest dot width: many programs at M = 1), K split 512 as CHAINS
# pieces of one batched dot (shorter dependent MMA chains; the pieces are then summed).
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


def _route_meta(num_rows: int, on_interpreter: bool = False) -> _RouteMeta:
    """The launch shape for M rows; the one place `benchmark/kernels/sweep_router.py` patches.
    Compiled: two launches, a one-warp program per routed row, rolled top-k (a routed row per
    program keeps the routing step short; the fused variant serialises a block in one program).
    The CPU interpreter pays per program: 16 rows each there."""
    if on_interpreter:
        return _RouteMeta(num_rows <= 8, 4, 16, 4, 2, False)
    return _RouteMeta(False, 4, 1, 1, 2, False)


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
    gate_temp,
    SOURCE: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_TEMP: tl.constexpr,
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
            # loop's first x load along with it, above the wait (a race).
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
            if INTERPRETED:  # the CPU interpreter's bf16 tl.dot is wrong (triton 3.6): the exact
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
                gate_temp,
                SOURCE == 1,
                SCORING,
                HAS_TEMP,
                RENORMALIZE,
                TOPK,
                NUM_SHARED,
                NUM_SPLITS,
                ROWS,
                BLOCK_OUT,
                not INTERPRETED,
            )
        else:
            topk_route_rows(
                row0,
                row_end,
                n_valid,
                logits_ptr,
                partials_ptr,
                bias_ptr,
                ids_ptr,
                weights_ptr,
                logits_out_ptr,
                num_rows,
                num_experts,
                routed_scale,
                shared_weight,
                fill_id,
                shared_id_base,
                gate_temp,
                SOURCE == 1,
                SCORING,
                HAS_TEMP,
                HAS_BIAS,
                RENORMALIZE,
                WRITE_LOGITS,
                TOPK,
                NUM_SHARED,
                NUM_SPLITS,
                ROWS,
                CHUNKS,
                CHUNK,
                SPLIT_GROUP,
                BLOCK_OUT,
                not INTERPRETED,
                UNROLL,
            )


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
    require(
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
    require(
        sum(t is not None for t in (x, logits, partials)) == 1,
        "give exactly one of x (with gate_weight), logits, partials",
    )
    if x is not None:
        require(gate_weight is not None and x.dim() == 2, "x [M, H] needs gate_weight [E, H]")
        assert gate_weight is not None
        num_rows, hidden = x.shape
        _require_tensor("x", x, (num_rows, hidden), (torch.bfloat16, torch.float32))
        _require_tensor("gate_weight", gate_weight, (gate_weight.shape[0], hidden), (x.dtype,))
        return _SOURCE_X, num_rows, gate_weight.shape[0], hidden, x.device
    if logits is not None:
        require(logits.dim() == 2 and logits.is_contiguous(), "logits must be contiguous [M, E]")
        _require_tensor("logits", logits, tuple(logits.shape), (torch.float32,))
        return _SOURCE_LOGITS, logits.shape[0], logits.shape[1], 0, logits.device
    assert partials is not None
    require(
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
    require(is_hash or topk <= num_experts, f"topk {topk} exceeds E = {num_experts}")
    if tid2eid is not None:
        require(
            input_ids is not None and correction_bias is None,
            "hash routing needs input_ids and takes no correction_bias",
        )
        assert input_ids is not None
        _require_tensor("tid2eid", tid2eid, (tid2eid.shape[0], topk), (torch.int32, torch.int64))
        _require_tensor("input_ids", input_ids, (num_rows,), (torch.int32, torch.int64))
        require(logits_out is None, "hash routing gathers its experts' logits only: no logits_out")
    if correction_bias is not None:
        _require_tensor("correction_bias", correction_bias, (num_experts,), (torch.float32,))
    if n_valid is not None:
        require(
            n_valid.numel() == 1 and n_valid.dtype == torch.int32 and n_valid.device == device,
            "n_valid must be an int32 device scalar",
        )
    if logits_out is not None:
        require(source != _SOURCE_LOGITS, "logits_out needs the x or partials source")
        require(logits_out.is_contiguous(), "logits_out must be contiguous")
        _require_tensor("logits_out", logits_out, (num_rows, num_experts), (torch.float32,))

    width = topk + config.num_shared
    ids = torch.empty(num_rows, width, dtype=torch.int32, device=device)
    weights = torch.empty(num_rows, width, dtype=torch.float32, device=device)
    if num_rows == 0:
        return RouterTopkOutput(ids, weights)

    on_interpreter = interpreted(_router_topk_kernel)
    meta = _route_meta(num_rows, on_interpreter)
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
        gate_temp=float(config.gate_temp),
        SCORING=SCORINGS[config.scoring],
        HAS_TEMP=config.gate_temp != 1.0,
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
        INTERPRETED=on_interpreter,
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
    require(
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
