"""Routed experts (stacked `gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`) and the shared
expert, both SwiGLU with the DeepSeek-V4 clamp.

The "moe" kernel family picks the implementation once, at construction:
  * torch: per-expert loop over the routed tokens (reads the expert counts on the host).
  * triton, no host sync in forward: `moe_sort` of the routes into expert blocks of 16 or 32
    rows (`sort_block_size`: 16 at decode sizes) ->
    grouped GEMM stage 1 with the clamped SwiGLU as its epilogue -> grouped GEMM stage 2
    (`kernels/moe/grouped_gemm.py`) -> `moe_reduce`, slot-ordered, with the shared expert's output
    added (`kernels/moe/reduce.py`). Up to `token_path_max_m` tokens the routes are not sorted:
    stage 1 per route (SwiGLU epilogue), then stage 2 with the reduce as its epilogue
    (`kernels/moe/token_gemm.py`, `token_down.py`): two launches instead of four, the same bits
    on a GPU.
    Every expert is local (one GPU): the expert mask is all ones and the sort's mask table is built
    once, here in the constructor, from a host tensor (so no device read ever happens); it is a
    non-persistent buffer, so it follows the module to its device and stays out of checkpoints.
    The routed scale is already in the router's weights, so the reduce applies none.
    DeepSeek-V4.1 (`weight_before_down`): stage 1's epilogue multiplies each route's activation
    by its weight (rounded as stored, the torch path's order) and the reduce sums the routes
    with unit weights.
    Once the model is placed (`fused_linear.fuse_after_placement`), the shared expert is folded
    into the routed experts' stacks as expert E (`[E + 1, 2I, D]` / `[E + 1, D, I]`; the
    checkpoint parameters become views of them) and the router appends it to every token as
    one more route of weight 1: the same kernels then run it with the routed experts, and its
    own three launches (gate-up GEMM, SwiGLU, down GEMM) go. Its product joins the reduce's
    slot-ordered fp32 sum as the last slot instead of being added to the rounded routed sum
    (not bitwise against the torch chain, which rounds the routed sum first); the per-token and
    the sorted paths still give the same bits.

Weights kept as stored (`layers/quantized.py`): both stacks may hold FP8 or MXFP4 experts. The
Triton kernels dequantise them in their K loops; the torch loop dequantises each expert it runs
per call. The shared expert folds into quantised stacks when it is stored in the same format and
scale group; in another format (DeepSeek-V4.1: FP8 beside MXFP4 experts) it folds as the stacks'
extra expert (`MixedExperts`: the kernels read local expert E from its own weight, in its own
format), the routed stacks untouched. Only with the MX kernels (stacks of one format) does it run
on its own, its output added in the reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sgl_dspark.kernels.fp8.reference import Fp8Activation
from sgl_dspark.kernels.linear.reference import QuantizedWeight, dequantize_weight_ref
from sgl_dspark.kernels.moe.reference import MixedExperts
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.distributed import Communicator, get_parallel_state
from sgl_dspark.srt.distributed.sharding import mark_shard, split_evenly
from sgl_dspark.srt.layers.fp8_linear import fp8_linear_impl, mx_fused_moe_impl
from sgl_dspark.srt.layers.fused_linear import LinearGroup, linear_impl
from sgl_dspark.srt.layers.quantized import (
    WeightLike,
    cat_weights,
    index_weight,
    mark_quantizable,
    module_weight,
    replace_weight,
    row_slice,
    unsqueeze_weight,
    weight_kind,
    weight_ptr,
)

if TYPE_CHECKING:
    from sgl_dspark.kernels.moe.sort import MoeSortPlan

# Tokens up to which the unsorted per-route / per-token kernels run (the same bits as the sorted
# path). Each route streams its expert's weights itself, which stops paying once tokens share
# experts (`benchmark/kernels/probe_moe_token.py`; measured in benchmark/results/kernels.md): up
# to 4 tokens for experts in the activation dtype; kept as stored, up to 2 tokens for MXFP4 and 1
# for FP8 (from 2 on within a few percent). MXFP4 at 3-4 tokens timed faster alone but made a
# bs 1 DSpark step (a 4-token verify) slower than the sorted path did, measured on the whole
# step (benchmark/results/engine.md).
TOKEN_PATH_MAX_M = 4
QUANTIZED_TOKEN_PATH_MAX_M = {"mxfp4": 2, "fp8": 1}


# The routed experts' stacks as the kernels take them: with the shared expert folded in another
# format, a `MixedExperts`.
ExpertStacks = WeightLike | MixedExperts


def token_path_max_m(gate_up: ExpertStacks) -> int:
    """The most tokens `RoutedExperts` runs through the per-token kernels for experts stored as
    `gate_up` (TOKEN_PATH_MAX_M, or QUANTIZED_TOKEN_PATH_MAX_M by format when kept as stored; a
    `MixedExperts` by its routed stack's format)."""
    if isinstance(gate_up, MixedExperts):
        gate_up = gate_up.stack
    if isinstance(gate_up, QuantizedWeight):
        return QUANTIZED_TOKEN_PATH_MAX_M[gate_up.fmt]
    return TOKEN_PATH_MAX_M


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): the gate is clamped from above only."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _uses_triton(kernels: KernelChoice | None) -> bool:
    return (kernels or KernelChoice()).of("moe") == "triton"


class RoutedExperts(nn.Module):
    expert_mask: torch.Tensor  # triton backend only: int32 [E], all ones (every expert local)
    sort_table: torch.Tensor  # triton backend only: `moe_sort`'s local-id table for that mask

    def __init__(
        self,
        n_experts: int,
        hidden_size: int,
        intermediate: int,
        limit: float,
        kernels: KernelChoice | None = None,
        weight_before_down: bool = False,
    ) -> None:
        """`weight_before_down` (DeepSeek-V4.1): each route's weight scales its activation
        before the down projection (fp32), not the projected output."""
        super().__init__()
        self.n_experts = n_experts
        self.weight_before_down = weight_before_down
        self.intermediate = intermediate
        self.limit = limit
        # Expert parallelism: this rank holds experts [first_local, first_local + num_local) of
        # the global ids the router picks; `ep` is None on one rank (the unchanged path).
        ps = get_parallel_state()
        self.ep: Communicator | None = ps.ep if ps.ep_size > 1 else None
        self.ep_exact = ps.ep_combine == "exact"
        local = split_evenly(n_experts, ps.ep_size, "n_routed_experts", "--ep-size")
        self.first_local, self.num_local = ps.ep_rank * local, local
        self.gate_up_proj = nn.Parameter(torch.zeros(local, 2 * intermediate, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(local, hidden_size, intermediate))
        mark_shard(self.gate_up_proj, 0, ps.ep_rank, ps.ep_size)
        mark_shard(self.down_proj, 0, ps.ep_rank, ps.ep_size)
        mark_quantizable(self, "gate_up_proj", "down_proj")
        self._combine = self._combine_torch
        self._triton = _uses_triton(kernels)
        if self._triton:
            # Imported only when chosen: the torch path never loads Triton.
            from sgl_dspark.kernels import fused_moe, moe_reduce, moe_sort
            from sgl_dspark.kernels.moe.sort import MoeSortPlan, prepare_moe_sort, sort_block_size
            from sgl_dspark.kernels.moe.token_down import (
                moe_token_down_reduce,
                token_down_arrival_count,
            )
            from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up

            self._moe_sort, self._moe_reduce = moe_sort, moe_reduce
            # MXFP4 stacks on targets with native scaled dots: the MX kernels (fp8_linear.py),
            # whose row tile is the target's scaled-MMA tile (32 on gfx950, 128 on Blackwell).
            self._fused_moe = mx_fused_moe_impl(kernels, fused_moe)
            mx_block = (kernels or KernelChoice()).mx_moe_block
            self._mx_sort_block = mx_block or None
            self._sort_block_size = sort_block_size
            self._route_gate_up, self._token_down_reduce = moe_route_gate_up, moe_token_down_reduce
            self._arrival_count = token_down_arrival_count
            self._arrivals: torch.Tensor | None = None
            self._plan_type = MoeSortPlan
            # On the host whatever the ambient device (a model built under torch.device("cuda")
            # or "meta"): the plan is read there, and Module.to() moves the buffers.
            mask = self._local_mask(n_experts)
            plan = prepare_moe_sort(mask)  # host tensor: no device read
            self.register_buffer("expert_mask", mask, persistent=False)
            self.register_buffer("sort_table", plan.local_table, persistent=False)
            self._num_local, self._num_bins = plan.num_local, plan.num_bins
            self._combine = self._combine_triton

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x `[T, D]`, ids/weights `[T, k]` (+ optional shared-expert output `[T, D]`) ->
        `sum_k weights[:, k] * expert_{ids[:, k]}(x) (+ shared)` `[T, D]`; duplicate ids in a
        row are summed."""
        return self._combine(x, ids, weights, shared)

    def fold_shared(self, shared: SharedExpert) -> None:
        """Stack the shared expert after the routed ones as expert E (triton backend; shapes
        and weight kinds must match) and make both modules' parameters views of the stacks (no
        extra memory once the old tensors are freed). A later `Module.to()` unties them:
        `folded` is then False and the model runs the shared expert separately again."""
        gate, up = module_weight(shared.gate_proj), module_weight(shared.up_proj)
        down = module_weight(shared.down_proj)
        routed_gu = module_weight(self, "gate_up_proj")
        routed_down = module_weight(self, "down_proj")
        routed_kinds = {weight_kind(w) for w in (routed_gu, routed_down)}
        shared_kinds = {weight_kind(w) for w in (gate, up, down)}
        if (
            not self._triton
            or shared.gate_proj.out_features != self.intermediate
            or len(routed_kinds) > 1
            or len(shared_kinds) > 1
        ):
            return
        # Another format than the routed stacks' (V4.1: FP8 beside MXFP4): the shared expert
        # stays a stack of its own that the kernels read as local expert E (`MixedExperts`).
        # Not with the MX kernels, whose stacks are MXFP4 only.
        mixed = routed_kinds != shared_kinds
        if mixed and self._mx_sort_block is not None:
            return
        from sgl_dspark.kernels.moe.sort import prepare_moe_sort

        n, e = self.num_local, self.n_experts
        # Under expert parallelism the shared expert is one more local expert of EP rank 0 only
        # (computed once); the other ranks keep their stacks and mask expert E out.
        mask = self._local_mask(e + 1)
        gate_up: ExpertStacks = routed_gu
        down_all: ExpertStacks = routed_down
        if self.ep is None or self.ep.rank == 0:
            shared_gu = unsqueeze_weight(cat_weights([gate, up], dim=-2))  # [1, 2I, D]
            shared_down = unsqueeze_weight(down)
            if mixed:
                gate_up = MixedExperts(routed_gu, shared_gu)
                down_all = MixedExperts(routed_down, shared_down)
                self._tie_shared(shared, index_weight(shared_gu, 0))
            else:
                stacked_gu = cat_weights([routed_gu, shared_gu], dim=0)
                stacked_down = cat_weights([routed_down, shared_down], dim=0)
                replace_weight(self, "gate_up_proj", index_weight(stacked_gu, slice(0, n)))
                replace_weight(self, "down_proj", index_weight(stacked_down, slice(0, n)))
                self._tie_shared(shared, index_weight(stacked_gu, n))
                replace_weight(shared.down_proj, "weight", index_weight(stacked_down, n))
                gate_up, down_all = stacked_gu, stacked_down
            mask[e] = 1
        plan = prepare_moe_sort(mask)
        routed = module_weight(self, "gate_up_proj")
        device = (routed.data if isinstance(routed, QuantizedWeight) else routed).device
        self._stacks = (gate_up, down_all)
        self._folded_plan = self._plan_type(
            plan.local_table.to(device), plan.num_local, plan.num_bins
        )
        self._folded_mask = mask.to(device)

    def _tie_shared(self, shared: SharedExpert, joint: WeightLike) -> None:
        """Make the shared expert's gate and up weights the row halves of `joint` `[2I, D]`
        (its slice of the folded stacks), its group fused on them (the members are views)."""
        i = self.intermediate
        for lin, start in ((shared.gate_proj, 0), (shared.up_proj, i)):
            replace_weight(lin, "weight", row_slice(joint, start, start + i))
        shared.gate_up.restack(joint)

    @property
    def folded(self) -> bool:
        stacks = getattr(self, "_stacks", None)
        if stacks is None:
            return False
        gate_up, down = (s.stack if isinstance(s, MixedExperts) else s for s in stacks)
        return weight_ptr(module_weight(self, "gate_up_proj")) == weight_ptr(
            gate_up
        ) and weight_ptr(module_weight(self, "down_proj")) == weight_ptr(down)

    def forward_folded(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """`forward` with the shared expert as expert E (ids/weights `[T, k + 1]`, the router's
        `with_shared` output); requires `folded`."""
        gate_up, down = self._stacks
        if self.ep is not None:
            return self._combine_triton_ep(
                x,
                ids,
                weights,
                None,
                self.ep,
                gate_up,
                down,
                self._folded_plan,
                self._folded_mask,
                shared_rows=False,
            )
        return self._run_triton(
            x, ids, weights, None, gate_up, down, self._folded_plan, self._folded_mask
        )

    def _local_mask(self, n_experts: int) -> torch.Tensor:
        """int32 [n_experts] on the host: 1 where the expert lives on this rank."""
        mask = torch.zeros(n_experts, dtype=torch.int32, device="cpu")
        mask[self.first_local : self.first_local + self.num_local] = 1
        return mask

    def _combine_torch(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None
    ) -> torch.Tensor:
        if self.ep is not None:
            return self._combine_torch_ep(x, ids, weights, shared, self.ep)
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.n_experts).tolist()
        token_of = order // ids.shape[1]
        w_sorted = weights.reshape(-1)[order]
        start = 0
        gate_up, down = module_weight(self, "gate_up_proj"), module_weight(self, "down_proj")
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start : start + n]
            gu = F.linear(x[tok], _expert(gate_up, e, x.dtype))
            h = swiglu_clamp(gu[:, : self.intermediate], gu[:, self.intermediate :], self.limit)
            w = w_sorted[start : start + n, None]
            if self.weight_before_down:
                y = F.linear((h.float() * w.float()).to(x.dtype), _expert(down, e, x.dtype))
            else:
                y = F.linear(h, _expert(down, e, x.dtype)) * w.to(x.dtype)
            out.index_add_(0, tok, y.to(out.dtype))
            start += n
        return out if shared is None else out + shared

    def _expert_products(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token of each route, weighted product of each route) in the expert-sorted route
        order of `_combine_torch`; routes to experts of other ranks get zero rows."""
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.n_experts).tolist()
        token_of = order // ids.shape[1]
        w_sorted = weights.reshape(-1)[order]
        y_sorted = x.new_zeros(flat_ids.numel(), x.shape[1])
        start = sum(counts[: self.first_local])
        gate_up, down = module_weight(self, "gate_up_proj"), module_weight(self, "down_proj")
        for local in range(self.num_local):
            n = counts[self.first_local + local]
            if n == 0:
                continue
            tok = token_of[start : start + n]
            gu = F.linear(x[tok], _expert(gate_up, local, x.dtype))
            h = swiglu_clamp(gu[:, : self.intermediate], gu[:, self.intermediate :], self.limit)
            w = w_sorted[start : start + n, None]
            if self.weight_before_down:
                y = F.linear((h.float() * w.float()).to(x.dtype), _expert(down, local, x.dtype))
            else:
                y = F.linear(h, _expert(down, local, x.dtype)) * w.to(x.dtype)
            y_sorted[start : start + n] = y
            start += n
        return token_of, y_sorted

    def _combine_torch_ep(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        shared: torch.Tensor | None,
        ep: Communicator,
    ) -> torch.Tensor:
        """Expert parallel, torch: `shared` is given on EP rank 0 only (computed once).
        exact: every route's product and the shared rows cross in one all-reduce (a sum with
        zeros, so exact), then the one-rank summation in the one-rank order. fast: each rank
        sums its own routes (+ shared on rank 0), then one all-reduce of `[T, D]`."""
        token_of, y_sorted = self._expert_products(x, ids, weights)
        if not self.ep_exact:
            out = torch.zeros_like(x).index_add_(0, token_of, y_sorted)
            if shared is not None:
                out = out + shared
            return ep.all_reduce(out)
        routes = y_sorted.shape[0]
        payload = torch.cat((y_sorted, shared if shared is not None else torch.zeros_like(x)))
        payload = ep.all_reduce(payload)
        out = torch.zeros_like(x).index_add_(0, token_of, payload[:routes])
        return out + payload[routes:]

    def _combine_triton(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None
    ) -> torch.Tensor:
        plan = self._plan_type(self.sort_table, self._num_local, self._num_bins)
        gate_up, down = module_weight(self, "gate_up_proj"), module_weight(self, "down_proj")
        if self.ep is not None:
            return self._combine_triton_ep(
                x, ids, weights, shared, self.ep, gate_up, down, plan, self.expert_mask
            )
        return self._run_triton(x, ids, weights, shared, gate_up, down, plan, self.expert_mask)

    def _run_triton(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        shared: torch.Tensor | None,
        gate_up: ExpertStacks,
        down: ExpertStacks,
        plan: MoeSortPlan,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        x = x.contiguous()
        ids = ids.to(torch.int32).contiguous()  # no-ops for the triton router's outputs
        weights = weights.to(torch.float32).contiguous()
        if shared is not None:
            shared = shared.to(x.dtype).contiguous()
        before = self.weight_before_down
        # Weighted before the down projection (stage 1's epilogue), the routes then sum with
        # unit weights (None: the reduce multiplies by 1.0 without reading a tensor of ones, an
        # exact product, so its bits are a plain sum's).
        reduce_weights = None if before else weights
        if x.shape[0] <= token_path_max_m(gate_up):
            h = self._route_gate_up(
                x,
                gate_up,
                ids,
                plan.local_table,
                plan.num_local,
                self.limit,
                act_weights=weights if before else None,
            )
            return self._token_down_reduce(
                h,
                down,
                ids,
                reduce_weights,
                plan.local_table,
                plan.num_local,
                1.0,
                shared,
                arrivals=self._token_arrivals(gate_up, down, ids.shape[1], x.device),
            )
        # hidden_size=0: the grouped GEMMs write per-route rows, so `moe_sort`'s sum is unused.
        block = self._sort_block(x.shape[0], ids.shape[1], plan.num_local)
        routes = self._moe_sort(ids, weights, plan, 0, block_size=block)
        y = self._fused_moe(
            x,
            gate_up,
            down,
            routes,
            ids.shape[1],
            self.limit,
            block_size=block,
            weight_before_down=before,
        )
        return self._moe_reduce(y, reduce_weights, ids, mask, 1.0, shared)

    def _token_arrivals(
        self, gate_up: ExpertStacks, down: ExpertStacks, topk: int, device: torch.device
    ) -> torch.Tensor | None:
        """Stage 2's arrival counters for this layer's per-token calls (None when its launch
        shape needs none), kept for the layer's lifetime since the kernel leaves them zero:
        no memset per call. Sized on the first call, a warm-up that precedes every graph
        capture, so captured graphs keep its address."""
        count = self._arrival_count(token_path_max_m(gate_up), down, topk)
        if count == 0:
            return None
        held = self._arrivals
        if held is None or held.numel() < count or held.device != device:
            held = self._arrivals = torch.zeros(count, dtype=torch.int32, device=device)
        return held

    def _sort_block(self, num_tokens: int, topk: int, num_local: int) -> int:
        """Rows per expert block: the MX kernels' fixed tile when they run, else by batch size
        (`sort_block_size`)."""
        if self._mx_sort_block is not None:
            return self._mx_sort_block
        return self._sort_block_size(num_tokens, topk, num_local)

    def _combine_triton_ep(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        shared: torch.Tensor | None,
        ep: Communicator,
        gate_up: ExpertStacks,
        down: ExpertStacks,
        plan: MoeSortPlan,
        mask: torch.Tensor,
        shared_rows: bool = True,
    ) -> torch.Tensor:
        """Expert parallel, Triton: the kernels' local-expert table skips remote routes.
        fast: the masked local reduce (+ shared on EP rank 0), one all-reduce of `[T, D]`.
        exact: the per-route products of the sorted path, remote rows zeroed, cross with the
        shared rows in one all-reduce; then the slot-ordered reduce over every expert. With
        the shared expert folded (expert E, on EP rank 0) `shared` is None and its route is
        one more slot, as on one rank, and no shared rows cross (`shared_rows` False)."""
        if not self.ep_exact:
            return ep.all_reduce(
                self._run_triton(x, ids, weights, shared, gate_up, down, plan, mask)
            )
        x = x.contiguous()
        ids = ids.to(torch.int32).contiguous()
        weights = weights.to(torch.float32).contiguous()
        block = self._sort_block(x.shape[0], ids.shape[1], plan.num_local)
        routes = self._moe_sort(ids, weights, plan, 0, block_size=block)
        y = self._fused_moe(x, gate_up, down, routes, ids.shape[1], self.limit, block_size=block)
        local = (mask[ids.long()] == 1).unsqueeze(-1)
        t, k = ids.shape
        parts = [torch.where(local, y.view(t, k, -1), 0).view(t * k, -1)]
        if shared_rows:
            parts.append(shared.to(x.dtype) if shared is not None else torch.zeros_like(x))
        payload = ep.all_reduce(torch.cat(parts))
        every_expert = torch.ones_like(mask)
        shared_sum = payload[t * k :] if shared_rows else None
        return self._moe_reduce(
            payload[: t * k].view(t, k, -1), weights, ids, every_expert, 1.0, shared_sum
        )


def _expert(weight: WeightLike, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix in `dtype` (dequantised for this call when stored quantised)."""
    w = index_weight(weight, e)
    return dequantize_weight_ref(w, dtype) if isinstance(w, QuantizedWeight) else w


class SharedExpert(nn.Module):
    """Dense SwiGLU with the clamp; with the triton "moe" backend the activation is one kernel.
    With FP8 activations on, an FP8 down projection and more rows than the decode-size kernels
    take, that kernel writes the activation as FP8 codes and group scales (its epilogue) and the
    down projection runs the W8A8 GEMM on them."""

    def __init__(
        self, hidden_size: int, intermediate: int, limit: float, kernels: KernelChoice | None = None
    ) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden_size, bias=False)
        self.gate_up = LinearGroup([self.gate_proj, self.up_proj], kernels)  # one GEMM, fused
        mark_quantizable(self.down_proj, "weight")
        self.linear = linear_impl(kernels)
        self._activation = self._activation_torch
        self._fp8 = None
        if _uses_triton(kernels):
            from sgl_dspark.kernels import silu_mul_clamp

            self._silu_mul_clamp = silu_mul_clamp
            self._activation = self._activation_triton
            self._fp8 = fp8_linear_impl(kernels)

    def linear_groups(self) -> list[LinearGroup]:
        return [self.gate_up]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = module_weight(self.down_proj)
        if self._fp8 is not None and isinstance(down, QuantizedWeight) and self._fp8.takes(x, down):
            gate_up = self.gate_up.joint(x)
            act = self._silu_mul_clamp(
                gate_up.reshape(-1, gate_up.shape[-1]),
                self.limit,
                "fp8_group",
                self._fp8.fmt.ue8m0,
                group=self._fp8.fmt.group,
            )
            assert isinstance(act, Fp8Activation)
            out = self._fp8.apply(act, down, x.dtype)
            return out.view(*x.shape[:-1], out.shape[-1])
        return self.linear(self._activation(x), down)

    def _activation_torch(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return swiglu_clamp(gate, up, self.limit)

    def _activation_triton(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up.joint(x)
        h = self._silu_mul_clamp(gate_up.reshape(-1, gate_up.shape[-1]), self.limit)
        assert isinstance(h, torch.Tensor)  # "plain" output format
        return h.view(*x.shape[:-1], h.shape[-1])


class SparseMoE(nn.Module):
    """`mlp`: gate (router) + experts + shared_experts; output = routed + shared (with the triton
    "moe" backend the shared output is added inside the routed reduce, `moe_reduce`)."""

    def __init__(
        self,
        router: nn.Module,
        experts: RoutedExperts,
        shared: SharedExpert,
        kernels: KernelChoice | None = None,
    ) -> None:
        super().__init__()
        self.gate = router
        self.experts = experts
        self.shared_experts = shared
        self._fuse_shared_add = _uses_triton(kernels)

    def fuse_weights(self) -> None:
        """After placement (`fused_linear.fuse_after_placement`): fold the shared expert into
        the routed experts' stacks (triton backend)."""
        if self._fuse_shared_add:
            self.experts.fold_shared(self.shared_experts)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.experts.folded:
            weights, ids = self.gate(x, input_ids, with_shared=True)
            return self.experts.forward_folded(x, ids, weights)
        weights, ids = self.gate(x, input_ids)
        ep = self.experts.ep
        if ep is not None:  # the shared expert is computed once, on EP rank 0
            return self.experts(x, ids, weights, self.shared_experts(x) if ep.rank == 0 else None)
        if self._fuse_shared_add:
            return self.experts(x, ids, weights, shared=self.shared_experts(x))
        return self.experts(x, ids, weights) + self.shared_experts(x)
