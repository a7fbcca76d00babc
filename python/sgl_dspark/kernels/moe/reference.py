"""The routed-expert (MoE) layer in torch: the reference of the "moe" kernel family.

Routing (`router_topk_ref`): logits = x @ gate_weight.T (or given logits, or split-K partials
summed in order s = 0..S-1); per row, scores (sqrtsoftplus | sigmoid), selection on scores +
correction bias (or hash routing: ids = tid2eid[input_ids]), top-k, weights = the unbiased
scores of the chosen experts, renormalised (w / (sum + 1e-20)), times the routed scaling factor;
appended shared-expert columns; rows >= n_valid get `fill_id` / weight 0.
    sqrtsoftplus(l) = sqrt(l if l > 20 else log2(1 + exp2(l * log2e)) * ln2)
    sigmoid(l) = 1 / (1 + exp2(-l * log2e))
A NaN score gives weight 0 and selection value -inf. Ties: descending selection value, equal
values -> the lower expert id first (-0.0 == +0.0), i.e. a stable descending sort.

Sorting (`moe_sort_ref`): the (token, slot) routes of one expert-parallel rank grouped by local
expert in blocks of `block_size` rows, so a grouped GEMM runs one block per expert tile; routes
to remote experts are dropped. A route is packed as `(slot << 24) | token`, padding as
`(topk << 24) | M`.

Experts: stage 1 `h = act(x @ gate_up_proj[e].T)` with the clamped SwiGLU
    act(gate_up) = silu(min(g, limit)) * clamp(u, -limit, limit),   gate_up = [g | u],
silu(g) = g * sigmoid(g), sigmoid in the exp2 form above; stage 2 `y = h @ down_proj[e].T`; every
GEMM accumulates in fp32 and rounds once to the activation dtype.

Reduce (`moe_reduce_ref`), per token, rounding where the unfused chain stores:
    r   = sum over slots k in order, only where the expert is local, of w[t, k] * y[t, k, :] (fp32)
    r   = round(r);  r = round(r * routed_scale)   (skipped when routed_scale == 1)
    out = round(r + shared)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from sgl_dspark.kernels.fp8.reference import Fp8Activation, quantize_act_fp8_ref
from sgl_dspark.kernels.linear.reference import QuantizedWeight

SCORINGS = {"sqrtsoftplus": 0, "sigmoid": 1}
LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# Packed route id: (slot << 24) | token. Tokens must fit in 24 bits, slots in the 7 bits above.
TOKEN_BITS = 24
TOKEN_MASK = (1 << TOKEN_BITS) - 1
FP8_GROUP = 128


class MixedExperts(NamedTuple):
    """An expert stack `[E, N, K]` and one more expert `[1, N, K]` kept in another format (the
    shared expert folded into routed stacks of another format): local id E is `extra`. The
    per-token and the grouped kernels take it wherever they take a stack; no weight is copied
    or converted."""

    stack: torch.Tensor | QuantizedWeight
    extra: torch.Tensor | QuantizedWeight

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.stack.shape
        return (e + 1, n, k)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Per-layer routing options.

    topk: routed experts per token. scoring: "sqrtsoftplus" | "sigmoid". renormalize: divide the
    routed weights by (their sum + 1e-20). routed_scaling_factor: then multiply them by this.
    fill_id: id written to padded rows (0 where expert kernels fault on -1, -1 where they skip
    it, E for an id a dispatcher drops).
    num_shared / shared_weight / shared_id_base: append `num_shared` columns with ids
    shared_id_base + j (None -> E) and weight `shared_weight`.
    gate_temp: the fp32 logits are divided by it (correctly rounded) before scoring
    (DeepSeek-V4.1's router temperature; `logits_out` keeps them undivided).
    """

    topk: int
    scoring: str = "sqrtsoftplus"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    fill_id: int = 0
    num_shared: int = 0
    shared_weight: float = 1.0
    shared_id_base: int | None = None
    gate_temp: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {sorted(SCORINGS)}, got {self.scoring!r}")
        if self.topk < 1 or self.num_shared < 0:
            raise ValueError(f"need topk >= 1, num_shared >= 0: {self.topk}, {self.num_shared}")
        if not self.gate_temp > 0:
            raise ValueError(f"gate_temp must be > 0, got {self.gate_temp}")


class RouterTopkOutput(NamedTuple):
    """ids: int32 [M, topk + num_shared]; weights: fp32 [M, topk + num_shared]."""

    ids: torch.Tensor
    weights: torch.Tensor


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
        soft = torch.log2(1.0 + torch.exp2(logits * LOG2E)) * _LN2
        return torch.sqrt(torch.where(logits > 20.0, logits, soft))
    return 1.0 / (1.0 + torch.exp2(-logits * LOG2E))


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
    workspace: object = None,
) -> RouterTopkOutput:
    """Router gate -> top-k ids and weights (module doc); same arguments as `router_topk`
    (`workspace` is ignored)."""
    full_logits = _logits_ref(x, gate_weight, logits, partials)
    if logits_out is not None:
        logits_out.copy_(full_logits)
    if config.gate_temp != 1.0:
        full_logits = full_logits / config.gate_temp
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


class MoeSortOutput(NamedTuple):
    """Outputs of `moe_sort` / `moe_sort_ref`.

    sorted_ids:        int32 [capacity]; `(slot << 24) | token`, padding `(topk << 24) | M`.
    sorted_weights:    fp32 [capacity]; the route's weight, 0 for padding.
    sorted_expert_ids: int32 [ceil(capacity / block)]; local expert id of each block.
    num_valid:         int32 [2]; [number of valid (padded) entries, M].
    moe_buf:           [M, hidden_size] zeros (stage-2 accumulator).
    """

    sorted_ids: torch.Tensor
    sorted_weights: torch.Tensor
    sorted_expert_ids: torch.Tensor
    num_valid: torch.Tensor
    moe_buf: torch.Tensor


def moe_sort_capacity(num_tokens: int, topk: int, num_experts: int, block_size: int) -> int:
    """Static length of `sorted_ids` (AITER's bound): topk*M + block*E - topk."""
    return max(topk * num_tokens + block_size * num_experts - topk, 0)


def moe_sort_ref(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_mask: torch.Tensor,
    hidden_size: int,
    block_size: int = 32,
    moe_buf_dtype: torch.dtype = torch.bfloat16,
) -> MoeSortOutput:
    """The routes of this rank grouped by local expert (module doc). Local experts in global
    order (= local-id order); within an expert, routes in token-major order p = t*topk + k;
    each expert padded to a multiple of `block_size` (an expert with no routes takes no block).
    Ids outside [0, E) and remote experts are dropped."""
    num_tokens, topk = topk_ids.shape
    num_experts = expert_mask.numel()
    device = topk_ids.device
    capacity = moe_sort_capacity(num_tokens, topk, num_experts, block_size)
    sentinel = (topk << TOKEN_BITS) | num_tokens
    sorted_ids = torch.full((capacity,), sentinel, dtype=torch.int32, device=device)
    sorted_weights = torch.zeros(capacity, dtype=torch.float32, device=device)
    sorted_expert_ids = torch.full(
        (-(-capacity // block_size),), -1, dtype=torch.int32, device=device
    )
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1)
    is_local = expert_mask.reshape(-1).to(torch.int64)
    local_ids = torch.cumsum(is_local, 0) - is_local
    pos = 0
    for expert in range(num_experts):
        if is_local[expert].item() == 0:
            continue
        pairs = torch.nonzero(flat_ids == expert).flatten()
        count = pairs.numel()
        packed = ((pairs % topk) << TOKEN_BITS) | (pairs // topk)
        sorted_ids[pos : pos + count] = packed.to(torch.int32)
        sorted_weights[pos : pos + count] = flat_weights[pairs]
        padded = -(-count // block_size) * block_size
        sorted_expert_ids[pos // block_size : (pos + padded) // block_size] = local_ids[expert]
        pos += padded
    num_valid = torch.tensor([pos, num_tokens], dtype=torch.int32, device=device)
    moe_buf = torch.zeros(num_tokens, hidden_size, dtype=moe_buf_dtype, device=device)
    return MoeSortOutput(sorted_ids, sorted_weights, sorted_expert_ids, num_valid, moe_buf)


def silu_mul_clamp_ref(
    gate_up: torch.Tensor,
    limit: float | None = None,
    out_format: str = "plain",
    scale_ue8m0: bool = False,
    group: int = FP8_GROUP,
) -> torch.Tensor | Fp8Activation:
    """Clamped SwiGLU (module doc); same arguments as `silu_mul_clamp`. The fp8 outputs are
    `quantize_act_fp8_ref` of the rounded activation (one scale per row for "fp8_row")."""
    inter = gate_up.shape[-1] // 2
    gate = gate_up[..., :inter].float()
    up = gate_up[..., inter:].float()
    if limit is not None:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
    sigmoid = 1.0 / (1.0 + torch.exp2(-gate * LOG2E))
    y = (gate * sigmoid * up).to(gate_up.dtype)
    if out_format == "plain":
        return y
    width = max(inter, 1) if out_format == "fp8_row" else group
    return quantize_act_fp8_ref(y, width, scale_ue8m0)


def moe_grouped_gemm_ref(
    a: torch.Tensor,
    weight: torch.Tensor,
    sorted_ids: torch.Tensor,
    sorted_expert_ids: torch.Tensor,
    num_valid: torch.Tensor,
    topk: int,
    a_per_pair: bool = False,
    block_size: int = 32,
    out: torch.Tensor | None = None,
    *,
    out_swiglu: bool = False,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """One grouped expert GEMM over `moe_sort`'s layout; same arguments as `moe_grouped_gemm`.
    Block by block over the valid prefix: each live row's product in fp32, rounded once to a's
    dtype (with out_swiglu then `silu_mul_clamp_ref` of it)."""
    num_tokens = a.shape[0] // topk if a_per_pair else a.shape[0]
    if out is None:
        n_out = weight.shape[1] // 2 if out_swiglu else weight.shape[1]
        out = torch.full((num_tokens * topk, n_out), float("nan"), dtype=a.dtype, device=a.device)
    num_entries = int(num_valid[0])
    for block in range(num_entries // block_size):
        packed = sorted_ids[block * block_size : (block + 1) * block_size].long()
        token, slot = packed & TOKEN_MASK, packed >> TOKEN_BITS
        live = token < num_tokens
        pair = token[live] * topk + slot[live]
        rows = pair if a_per_pair else token[live]
        expert = int(sorted_expert_ids[block])
        product = (a[rows].float() @ weight[expert].float().t()).to(a.dtype)
        if out_swiglu:
            h = silu_mul_clamp_ref(product, swiglu_limit)
            assert isinstance(h, torch.Tensor)
            product = h
        out[pair] = product
    return out


def fused_moe_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_mask: torch.Tensor,
    limit: float | None,
    topk_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts in terms of routes (independent of `moe_sort`'s layout).

    y[t, k] = act(x[t] @ gate_up_proj[l].T) @ down_proj[l].T for l = local id of expert
    topk_ids[t, k], act = `silu_mul_clamp_ref`, each GEMM accumulated in fp32 and rounded once
    to x's dtype; NaN where the
    expert is remote or the id is outside [0, E) (rows `fused_moe` never writes). With
    `topk_weights` (fp32 [M, topk], `fused_moe`'s weight_before_down) the activation is
    `(act.float() * topk_weights[t, k]).to(x.dtype)` (DeepSeek-V4.1).
    """
    num_tokens, topk = topk_ids.shape
    num_experts = expert_mask.numel()
    is_local = expert_mask.long().cpu()
    local_ids = torch.cumsum(is_local, 0) - is_local
    y = torch.full(
        (num_tokens, topk, down_proj.shape[1]), float("nan"), dtype=x.dtype, device=x.device
    )
    for token in range(num_tokens):
        for slot in range(topk):
            expert = int(topk_ids[token, slot])
            if not (0 <= expert < num_experts) or is_local[expert] == 0:
                continue
            local = int(local_ids[expert])
            gate_up = (x[token].float() @ gate_up_proj[local].float().t()).to(x.dtype)
            h = silu_mul_clamp_ref(gate_up[None], limit)
            assert isinstance(h, torch.Tensor)
            if topk_weights is not None:
                h = (h.float() * topk_weights[token, slot].float()).to(x.dtype)
            y[token, slot] = (h[0].float() @ down_proj[local].float().t()).to(x.dtype)
    return y


def moe_reduce_ref(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_mask: torch.Tensor,
    routed_scale: float = 1.0,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked route reduce + routed scale + shared add (module doc); same arguments as
    `moe_reduce`."""
    num_experts = expert_mask.numel()
    ids = topk_ids.long()
    known = (ids >= 0) & (ids < num_experts)
    is_local = known & (expert_mask.long()[ids.clamp(0, max(num_experts - 1, 0))] == 1)
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for slot in range(y.shape[1]):
        term = topk_weights[:, slot, None] * y[:, slot, :].float()
        acc = acc + torch.where(is_local[:, slot, None], term, torch.zeros_like(term))
    routed = acc.to(y.dtype)
    if routed_scale != 1.0:
        routed = (routed.float() * routed_scale).to(y.dtype)
    if shared is None:
        return routed
    return (routed.float() + shared.float()).to(y.dtype)


def _local_ids_ref(
    ids: torch.Tensor, local_table: torch.Tensor, num_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(local id, is local) per route, as the kernels derive them."""
    num_experts = local_table.numel()
    known = (ids >= 0) & (ids < num_experts)
    local = torch.where(known, local_table.long()[ids.long().clamp(0, num_experts - 1)], num_local)
    return local, local < num_local


def moe_route_gate_up_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    ids: torch.Tensor,
    local_table: torch.Tensor,
    num_local: int,
    limit: float | None,
    h: torch.Tensor | None = None,
    act_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-route stage 1 (gate-up GEMM and clamped SwiGLU, times the route's weight with
    `act_weights`); same arguments as `moe_route_gate_up`."""
    num_tokens, topk = ids.shape
    inter = gate_up_proj.shape[1] // 2
    if h is None:
        h = torch.full((num_tokens * topk, inter), float("nan"), dtype=x.dtype, device=x.device)
    local, is_local = _local_ids_ref(ids, local_table, num_local)
    for route in torch.nonzero(is_local.reshape(-1)).flatten().tolist():
        weight = gate_up_proj[int(local.reshape(-1)[route])]
        gate_up = (x[route // topk].float() @ weight.float().t()).to(x.dtype)
        act = silu_mul_clamp_ref(gate_up[None], limit)
        assert isinstance(act, torch.Tensor)
        if act_weights is not None:
            act = (act.float() * act_weights.reshape(-1)[route].float()).to(x.dtype)
        h[route] = act[0]
    return h


def moe_token_down_reduce_ref(
    h: torch.Tensor,
    down_proj: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    local_table: torch.Tensor,
    num_local: int,
    routed_scale: float = 1.0,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token stage 2 and route reduce: each local route's product rounded to h's dtype, then
    `moe_reduce_ref` (slot order, scale, shared add); same arguments as
    `moe_token_down_reduce`."""
    num_tokens, topk = ids.shape
    local, is_local = _local_ids_ref(ids, local_table, num_local)
    y = torch.zeros(num_tokens, topk, down_proj.shape[1], dtype=h.dtype, device=h.device)
    for route in torch.nonzero(is_local.reshape(-1)).flatten().tolist():
        weight = down_proj[int(local.reshape(-1)[route])]
        y.view(-1, y.shape[2])[route] = (h[route].float() @ weight.float().t()).to(h.dtype)
    expert_mask = (local_table < num_local).to(torch.int32)
    return moe_reduce_ref(y, weights, ids, expert_mask, routed_scale, shared)
