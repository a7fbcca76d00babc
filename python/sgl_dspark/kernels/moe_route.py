"""K2 + K3: MoE router gate -> top-k ids and weights, padded rows filled, in one or two launches.

Logits come from one of three sources (a constexpr switch on one kernel):
  * x [M, H] and gate_weight [E, H]: the kernel runs a split-K GEMV (fixed 512-wide K splits, 16
    experts per program: 192 programs per 16-row block at H 4096, E 384). Up to 8 rows, the last
    program to finish (a per-block counter it resets) sums the splits in order and routes; above
    that a second launch routes the partials, all row tiles in parallel;
  * partials fp32 [S, M, E] from an external split-K GEMV, summed in order s = 0..S-1;
  * logits fp32 [M, E].
Then per row: scores (sqrtsoftplus | sigmoid), selection on scores + correction bias, top-k,
weights = unbiased scores of the chosen experts, renormalised (w / (sum + 1e-20)), times the routed
scaling factor; optional appended shared-expert columns; rows >= n_valid (device int32 scalar) get
`fill_id` / weight 0 in every column. Hash routing (ids = tid2eid[input_ids]) is another switch.

Numerics (the spec is `router_topk_ref`):
  * sqrtsoftplus(l) = sqrt_rn(l if l > 20 else log2(1 + exp2(l * log2e)) * ln2);
    sigmoid(l) = 1 / (1 + exp2(-l * log2e)). exp2/log2 lowerings differ by backend, so weights are
    X2 at the ulp level; everything after the scores is exact fp32 in a fixed order.
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

_SCORINGS = {"sqrtsoftplus": 0, "sigmoid": 1}
_SOURCE_X, _SOURCE_LOGITS, _SOURCE_PARTIALS = 0, 1, 2
_SPLIT_K = 512  # K per GEMV split: fixed, so a row's logits never depend on M or the grid
_GEMV_ROWS = 16  # rows per GEMV tile (tl.dot minimum); also fixed for the same reason
# Experts per GEMV tile: the smallest tl.dot width, for many programs at M = 1; fixed for every M
# so a row's logits come from the same instructions whatever the batch (also on MFMA).
_GEMV_EXPERTS = 16
_FUSED_ROUTE_MAX_ROWS = 8  # x source: the last GEMV program routes <= 2 serial epilogue tiles
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


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
            raise ValueError(f"topk must be >= 1 and num_shared >= 0, got {self.topk}, "
                             f"{self.num_shared}")  # fmt: skip


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
def _scores(logits, SCORING: tl.constexpr):
    if SCORING == 0:
        soft = tl.log2(1.0 + tl.exp2(logits * 1.4426950408889634)) * 0.6931471805599453
        return tl.sqrt_rn(tl.where(logits > 20.0, logits, soft))
    else:
        one = tl.full(logits.shape, 1.0, tl.float32)
        return tl.div_rn(one, 1.0 + tl.exp2(-logits * 1.4426950408889634))


@triton.jit
def _route_rows(
    row0, n_valid, logits_ptr, partials_ptr, bias_ptr, input_ids_ptr, tid2eid_ptr,
    ids_ptr, weights_ptr, logits_out_ptr,
    num_rows, num_experts, stride_tid,
    routed_scale, shared_weight, fill_id, shared_id_base,
    SOURCE: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
    RENORMALIZE: tl.constexpr, WRITE_LOGITS: tl.constexpr, TOPK: tl.constexpr,
    NUM_SHARED: tl.constexpr, NUM_SPLITS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_OUT: tl.constexpr,
):  # fmt: skip
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_rows
    col_ok = cols < num_experts
    tile_ok = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None] * num_experts + cols[None, :]
    if SOURCE == 1:
        logits = tl.load(logits_ptr + offs, mask=tile_ok, other=0.0)
    else:
        # Unrolled: the S loads are independent, so they are all in flight at once (one round
        # trip instead of S); the adds still run in the reference's order s = 0..S-1.
        logits = tl.load(partials_ptr + offs, mask=tile_ok, other=0.0)
        for split in tl.static_range(1, NUM_SPLITS):
            logits += tl.load(partials_ptr + split * num_rows * num_experts + offs, mask=tile_ok)
        if WRITE_LOGITS:
            tl.store(logits_out_ptr + offs, logits, mask=tile_ok)
    scores = _scores(logits, SCORING)
    gather_src = tl.where(scores != scores, 0.0, scores)
    is_pad = rows >= n_valid

    out_cols = tl.arange(0, BLOCK_OUT)[None, :]
    out_ids = tl.zeros([ROWS, BLOCK_OUT], dtype=tl.int32)
    out_w = tl.zeros([ROWS, BLOCK_OUT], dtype=tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    if HASH:
        live = row_ok & (rows < n_valid)
        token = tl.load(input_ids_ptr + rows, mask=live, other=0).to(tl.int64)
        for slot in tl.static_range(TOPK):
            expert = tl.load(tid2eid_ptr + token * stride_tid + slot, mask=live, other=0)
            expert = expert.to(tl.int32)
            picked = tl.sum(tl.where(cols[None, :] == expert[:, None], gather_src, 0.0), axis=1)
            out_ids = tl.where(out_cols == slot, expert[:, None], out_ids)
            out_w = tl.where(out_cols == slot, picked[:, None], out_w)
            total += picked
    else:
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
        choice = tl.where(choice != choice, float("-inf"), choice)
        choice = tl.where(choice == 0.0, 0.0, choice)  # -0.0 and +0.0 must tie
        # Order-preserving int32 key: a float compare with a distinct "taken" value that NaN/-inf
        # scores can never equal; the max's tie-break-left gives the lower expert id.
        bits = choice.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        taken = tl.full([ROWS, BLOCK_E], -2147483648, tl.int32)
        key = tl.where(col_ok[None, :], key, taken)
        for slot in tl.static_range(TOPK):
            _, expert = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
            hit = cols[None, :] == expert[:, None]
            picked = tl.sum(tl.where(hit, gather_src, 0.0), axis=1)
            key = tl.where(hit, taken, key)
            out_ids = tl.where(out_cols == slot, expert[:, None], out_ids)
            out_w = tl.where(out_cols == slot, picked[:, None], out_w)
            total += picked
    if RENORMALIZE:
        denom = tl.zeros([ROWS, BLOCK_OUT], dtype=tl.float32) + (total + 1e-20)[:, None]
        out_w = tl.div_rn(out_w, denom)
    out_w = out_w * routed_scale
    is_shared = (out_cols >= TOPK) & (out_cols < TOPK + NUM_SHARED)
    out_ids = tl.where(is_shared, shared_id_base + out_cols - TOPK, out_ids)
    out_w = tl.where(is_shared, shared_weight, out_w)
    out_ids = tl.where(is_pad[:, None], fill_id, out_ids)
    out_w = tl.where(is_pad[:, None], 0.0, out_w)
    out_offs = rows[:, None] * (TOPK + NUM_SHARED) + out_cols
    out_ok = row_ok[:, None] & (out_cols < TOPK + NUM_SHARED)
    tl.store(ids_ptr + out_offs, out_ids, mask=out_ok)
    tl.store(weights_ptr + out_offs, out_w, mask=out_ok)


@triton.jit
def _router_topk_kernel(
    x_ptr, gate_ptr, logits_ptr, partials_ptr, bias_ptr, n_valid_ptr, input_ids_ptr, tid2eid_ptr,
    ids_ptr, weights_ptr, logits_out_ptr, counter_ptr,
    num_rows, hidden, num_experts, stride_x, stride_gate, stride_tid,
    routed_scale, shared_weight, fill_id, shared_id_base,
    SOURCE: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_N_VALID: tl.constexpr, HASH: tl.constexpr, RENORMALIZE: tl.constexpr,
    WRITE_LOGITS: tl.constexpr, TOPK: tl.constexpr, NUM_SHARED: tl.constexpr,
    NUM_SPLITS: tl.constexpr, ROUTE: tl.constexpr,
    BLOCK_M: tl.constexpr, EPI_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_OUT: tl.constexpr,
    SPLIT_K: tl.constexpr, GEMV_N: tl.constexpr, GEMV_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """x source: program (row block, split x expert tile) writes one GEMV partial; with ROUTE the
    last arrival of the row block then routes it (else a second launch with the partials source
    does). Logits/partials sources: program (row block) routes its rows."""
    pid_m = tl.program_id(0)
    row0 = pid_m * BLOCK_M
    if SOURCE == 0:
        # Split-K GEMV tile: rows [row0, +BLOCK_M) x experts [e0, +GEMV_N) x K [split*SPLIT_K, +SPLIT_K).
        tile = tl.program_id(1)
        n_etiles = tl.cdiv(num_experts, GEMV_N)
        split = tile // n_etiles
        rows = row0 + tl.arange(0, BLOCK_M)
        experts = (tile - split * n_etiles) * GEMV_N + tl.arange(0, GEMV_N)
        acc = tl.zeros([BLOCK_M, GEMV_N], dtype=tl.float32)
        for k0 in range(split * SPLIT_K, split * SPLIT_K + SPLIT_K, GEMV_K):
            ks = k0 + tl.arange(0, GEMV_K)
            x_tile = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                             mask=(rows < num_rows)[:, None] & (ks < hidden)[None, :], other=0.0)
            w_tile = tl.load(gate_ptr + experts[None, :] * stride_gate + ks[:, None],
                             mask=(ks < hidden)[:, None] & (experts < num_experts)[None, :],
                             other=0.0)  # fmt: skip
            if DOT_FP32:
                x_tile = x_tile.to(tl.float32)
                w_tile = w_tile.to(tl.float32)
                acc = tl.dot(x_tile, w_tile, acc, input_precision="ieee")
            else:
                acc = tl.dot(x_tile, w_tile, acc)
        tl.store(partials_ptr + split * num_rows * num_experts + rows[:, None] * num_experts
                 + experts[None, :], acc,
                 mask=(rows < num_rows)[:, None] & (experts < num_experts)[None, :])  # fmt: skip
        if ROUTE:
            # Release our partial, acquire everyone else's; the last arrival routes the row
            # block. The barrier orders every thread's partial store before the release.
            tl.debug_barrier()
            ticket = tl.atomic_add(counter_ptr + pid_m, 1, sem="acq_rel")
            is_last = ticket == tl.num_programs(1) - 1
        else:
            is_last = False
    else:
        is_last = True
    if is_last:
        if SOURCE == 0:
            tl.store(counter_ptr + pid_m, 0)  # ready for the next launch (graph replay)
        n_valid = num_rows
        if HAS_N_VALID:
            n_valid = tl.load(n_valid_ptr)
        for sub in tl.static_range(BLOCK_M // EPI_M):
            if row0 + sub * EPI_M < num_rows:  # small M: route only sub-blocks holding rows
                _route_rows(
                    row0 + sub * EPI_M, n_valid, logits_ptr, partials_ptr, bias_ptr,
                    input_ids_ptr, tid2eid_ptr, ids_ptr, weights_ptr, logits_out_ptr,
                    num_rows, num_experts, stride_tid,
                    routed_scale, shared_weight, fill_id, shared_id_base,
                    SOURCE, SCORING, HAS_BIAS, HASH, RENORMALIZE, WRITE_LOGITS, TOPK, NUM_SHARED,
                    NUM_SPLITS, EPI_M, BLOCK_E, BLOCK_OUT,
                )  # fmt: skip


def _epilogue_rows(num_splits: int, fused: bool) -> int:
    """Rows per routing tile: the S partial tiles are loaded at once (one round trip), so bound
    S * rows; half as many in the GEMV kernel (its state is live too). DSV4, S = 8: 8 rows (182
    registers on sm90, 4 warps), fused 4 rows (154); 8 fused rows would spill."""
    rows = 8
    while rows > 1 and rows * num_splits > (32 if fused else 64):
        rows //= 2
    return rows


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


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
    _require(partials.dim() == 3 and partials.shape[0] >= 1 and partials.is_contiguous(),
             "partials must be contiguous [S, M, E]")  # fmt: skip
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
    """Router gate + top-k + pad fill in one launch, two for the x source above 8 rows
    (graph-safe).

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
        _require(input_ids is not None and correction_bias is None,
                 "hash routing needs input_ids and takes no correction_bias")  # fmt: skip
        assert input_ids is not None
        _require_tensor("tid2eid", tid2eid, (tid2eid.shape[0], topk), (torch.int32, torch.int64))
        _require_tensor("input_ids", input_ids, (num_rows,), (torch.int32, torch.int64))
    if correction_bias is not None:
        _require_tensor("correction_bias", correction_bias, (num_experts,), (torch.float32,))
    if n_valid is not None:
        _require(n_valid.numel() == 1 and n_valid.dtype == torch.int32 and n_valid.device == device,
                 "n_valid must be an int32 device scalar")  # fmt: skip
    if logits_out is not None:
        _require(source != _SOURCE_LOGITS, "logits_out needs the x or partials source")
        _require(logits_out.is_contiguous(), "logits_out must be contiguous")
        _require_tensor("logits_out", logits_out, (num_rows, num_experts), (torch.float32,))

    width = topk + config.num_shared
    ids = torch.empty(num_rows, width, dtype=torch.int32, device=device)
    weights = torch.empty(num_rows, width, dtype=torch.float32, device=device)
    if num_rows == 0:
        return RouterTopkOutput(ids, weights)

    dummy = ids  # stands in for absent pointer arguments; never dereferenced

    def launch(grid: tuple[int, ...], source: int, partials: torch.Tensor | None, block_m: int,
               route: bool) -> None:  # fmt: skip
        _router_topk_kernel[grid](
            *(t if t is not None else dummy for t in (x, gate_weight, logits, partials)),
            *(t if t is not None else dummy for t in (correction_bias, n_valid, input_ids,
                                                      tid2eid)),
            ids, weights, logits_out if logits_out is not None else dummy,
            workspace.counters if workspace is not None else dummy,
            num_rows, hidden, num_experts,
            x.stride(0) if x is not None else 0,
            gate_weight.stride(0) if gate_weight is not None else 0,
            tid2eid.stride(0) if tid2eid is not None else 0,
            float(config.routed_scaling_factor), float(config.shared_weight), int(config.fill_id),
            int(num_experts if config.shared_id_base is None else config.shared_id_base),
            SOURCE=source, SCORING=_SCORINGS[config.scoring], HAS_BIAS=correction_bias is not None,
            HAS_N_VALID=n_valid is not None, HASH=is_hash, RENORMALIZE=config.renormalize,
            WRITE_LOGITS=logits_out is not None, TOPK=topk, NUM_SHARED=config.num_shared,
            NUM_SPLITS=num_splits, ROUTE=route, BLOCK_M=block_m, EPI_M=epi_m,
            BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_OUT=triton.next_power_of_2(width), SPLIT_K=_SPLIT_K, GEMV_N=_GEMV_EXPERTS,
            GEMV_K=min(_SPLIT_K, max(16, triton.next_power_of_2(max(hidden, 1)))),
            # fp32 inputs must not go through tf32; the CPU interpreter's bf16 tl.dot returns
            # garbage (triton 3.6), so there the exact bf16 products are formed in fp32 instead.
            DOT_FP32=x is not None and (x.dtype == torch.float32 or x.device.type == "cpu"),
            num_warps=4,
        )  # fmt: skip

    num_splits = partials.shape[0] if partials is not None else 1
    if source == _SOURCE_X:
        num_splits = triton.cdiv(hidden, _SPLIT_K)
    fused = source == _SOURCE_X and num_rows <= _FUSED_ROUTE_MAX_ROWS
    epi_m = _epilogue_rows(num_splits, fused)
    if source != _SOURCE_X:
        launch((triton.cdiv(num_rows, epi_m),), source, partials, epi_m, route=True)
        return RouterTopkOutput(ids, weights)
    if workspace is None:
        workspace = make_router_workspace(num_rows, num_experts, hidden, device)
    _require(workspace.partials.numel() >= num_splits * num_rows * num_experts
             and workspace.counters.numel() >= triton.cdiv(num_rows, _GEMV_ROWS),
             "workspace too small for this call")  # fmt: skip
    gemv_grid = (triton.cdiv(num_rows, _GEMV_ROWS),
                 num_splits * triton.cdiv(num_experts, _GEMV_EXPERTS))
    launch(gemv_grid, _SOURCE_X, workspace.partials, _GEMV_ROWS, route=fused)
    if not fused:  # every row block routed in parallel instead of by one last arrival each
        launch((triton.cdiv(num_rows, epi_m),), _SOURCE_PARTIALS, workspace.partials, epi_m,
               route=True)
    return RouterTopkOutput(ids, weights)
