"""Confidence-scheduled verify lengths: Algorithm 1 of the DSpark paper (`plan_algorithm1`, a
greedy walk over the ordered candidates with early stop) and its async top-K variant.

Every policy here is non-anticipating: the decision to verify draft x_{r,k} may depend on
x_{r,<k} and on independent draws, never on x_{r,k} itself. That is what keeps speculative
sampling exact, and it is why Algorithm 1 must stop at the first non-improving candidate and why
the async variant takes its budget from lagged confidences.

Conventions: confidences ``c`` are [R, gamma] with c[:, k-1] = P(x_k accepted | x_<k accepted);
survival a = cumprod(c, dim=1). A request's ``verify length`` counts the anchor: 1 + drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from sgl_dspark.srt.speculative.dspark.sps import AdditiveSpsTable, SpsTable

VALID_SURVIVAL_EPS = 1e-6


def predicted_throughput(
    table: SpsTable,
    num_requests: int,
    num_tokens: np.ndarray | int,
    expected_tokens: np.ndarray | float,
) -> np.ndarray:
    """Theta = expected committed tokens x steps/s of a step verifying ``num_tokens`` rows.

    Diagonal tables use the floor-probe lookup; additive tables T(R, M)."""
    if isinstance(table, AdditiveSpsTable):
        return np.asarray(expected_tokens) / table.step_seconds(num_requests, num_tokens)
    return np.asarray(expected_tokens) * table.steps_per_sec_floor(num_tokens)


def order_candidates(
    survival: Sequence[Sequence[float]], eps: float = VALID_SURVIVAL_EPS
) -> list[tuple[int, int]]:
    """Valid candidates (r, j), j 1-based, in order: survival descending, then j ascending,
    then r ascending. Candidates with survival < eps (or NaN) are dropped.

    Because survival is non-increasing in j and ties go to the smaller j, every set made of the
    first K candidates is a per-request prefix."""
    cands = []
    for r, row in enumerate(survival):
        for j, a in enumerate(row, start=1):
            if a >= eps:  # False for NaN
                cands.append((-float(a), j, r))
    cands.sort()
    return [(r, j) for _, j, r in cands]


class Algorithm1Result(NamedTuple):
    verify_lens: list[int]  # per request, 1 + drafts verified
    theta: float  # predicted throughput of the chosen plan
    num_tokens: int  # total verify rows, sum(verify_lens)


def plan_algorithm1(
    confidence: torch.Tensor | Sequence[Sequence[float]],
    table: SpsTable,
    eps: float = VALID_SURVIVAL_EPS,
) -> Algorithm1Result:
    """Algorithm 1 of the DSpark paper: greedy walk over the candidates in `order_candidates`'s
    order, stopping at the first one that does not raise the predicted throughput.

    Args:
        confidence: [R, gamma] per-position conditional acceptance estimates (host data; a device
            tensor is copied to the host, which is why this policy is only an oracle/eager mode).
        table: SPS table (diagonal: floor-probe lookup; additive: T(R, M)).
    Returns:
        per-request verify lengths (1 + l_r), the best predicted throughput and the token count.
    """
    rows = (
        confidence.tolist()
        if isinstance(confidence, torch.Tensor)
        else [list(r) for r in confidence]
    )
    survival = [list(np.cumprod(np.asarray(r, dtype=np.float64))) for r in rows]
    num_requests = len(survival)
    drafts = [0] * num_requests
    best_drafts = list(drafts)
    num_tokens = num_requests
    tau = float(num_requests)
    best_theta = float(predicted_throughput(table, num_requests, num_tokens, tau))
    for r, j in order_candidates(survival, eps):
        drafts[r] = j
        num_tokens += 1
        tau += survival[r][j - 1]
        theta = float(predicted_throughput(table, num_requests, num_tokens, tau))
        if theta > best_theta:
            best_theta = theta
            best_drafts = list(drafts)
        else:
            # Causality barrier: this candidate's value depends on draws the plan has not yet
            # committed to verifying; looking further would make the plan anticipate them.
            break
    verify_lens = [1 + d for d in best_drafts]
    return Algorithm1Result(verify_lens, best_theta, sum(verify_lens))


class BudgetResult(NamedTuple):
    budget: int  # K: total draft tokens to verify this step
    theta: float  # predicted throughput at K


def compute_verify_budget(
    lagged_survival: torch.Tensor,
    table: SpsTable,
    eps: float = VALID_SURVIVAL_EPS,
) -> BudgetResult:
    """Host budget K_t of the async top-K policy, from lagged survival rows.

    Args:
        lagged_survival: [R, gamma] CPU tensor, survival rows of the R scheduled requests taken
            from the confidence relay (all ones for requests without lagged data).
        table: SPS table (diagonal floor lookup or additive).
    Returns:
        K = argmax_k Theta(k) over k = 0..N (N = number of valid values; global search, first
        maximum on ties), Theta(k) = (R + S_k) * SPS(R + k), S_k = sum of the k largest values.
    """
    num_requests = int(lagged_survival.shape[0])
    values = lagged_survival.detach().to("cpu", torch.float64).flatten().numpy()
    values = np.sort(values[values >= eps])[::-1]
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    ks = np.arange(prefix.size)
    theta = predicted_throughput(table, num_requests, num_requests + ks, num_requests + prefix)
    best = int(np.argmax(theta))  # first maximum on ties
    return BudgetResult(best, float(theta[best]))


def budget_from_relay(
    relay: ConfidenceRelay,
    slot_ids: Sequence[int],
    generations: Sequence[int],
    table: SpsTable,
    eps: float = VALID_SURVIVAL_EPS,
) -> BudgetResult | None:
    """Budget for the next step from the relay's lagged snapshot; None (= verify all) when the
    snapshot is not available yet."""
    survival = relay.lagged_survival(slot_ids, generations)
    if survival is None:
        return None
    return compute_verify_budget(survival, table, eps)


def align_budget_to_graph_tier(
    budget: int, num_requests: int, gamma: int, token_tiers: Sequence[int]
) -> int:
    """Spend the padding a captured graph pays for anyway: K <- min(tier, R(gamma+1)) - R with tier
    the smallest captured token bucket >= R + K. Unchanged when no tier is large enough."""
    need = num_requests + budget
    fitting = [t for t in token_tiers if t >= need]
    if not fitting:
        return budget
    return min(min(fitting), num_requests * (gamma + 1)) - num_requests


def allocate_verify_lengths(
    confidence: torch.Tensor,
    budget: torch.Tensor | int | None,
    row_valid: torch.Tensor | None = None,
    eps: float = VALID_SURVIVAL_EPS,
) -> torch.Tensor:
    """Device-side allocation of the async top-K policy: verify the first K candidates
    (`order_candidates`'s order).

    Vectorised, no host sync (safe inside a CUDA graph when ``budget`` is a device tensor).

    Args:
        confidence: [B, gamma] float, current step confidences.
        budget: K, a Python int or a 0-d/[1] integer tensor on the same device; None (no lagged
            budget: relay not ready) verifies every request's full window.
        row_valid: optional [B] bool; False marks padding rows (no candidates, verify length 0).
    Returns:
        [B] int64 verify lengths, 1 + l_r in [1, gamma+1] for real rows, 0 for padding rows.
    """
    batch, gamma = confidence.shape
    if budget is None:
        verify_lens = full_verify_lengths(batch, gamma, confidence.device)
        if row_valid is not None:
            verify_lens = torch.where(row_valid, verify_lens, torch.zeros_like(verify_lens))
        return verify_lens
    survival = torch.nan_to_num(torch.cumprod(confidence.float(), dim=1), nan=0.0)
    valid = survival >= eps
    if row_valid is not None:
        valid &= row_valid.view(batch, 1)
    # Rank = number of candidates ordered before each one. Flatten position-major (index j*B + r)
    # so a stable descending sort breaks value ties by j, then r, exactly as `order_candidates`.
    keys = torch.where(valid, survival, torch.full_like(survival, -1.0)).t().reshape(-1)
    order = torch.sort(keys, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(order.numel(), device=order.device)
    budget_t = torch.as_tensor(budget, device=confidence.device).reshape(())
    selected = (ranks.view(gamma, batch).t() < budget_t) & valid
    verify_lens = (1 + selected.sum(dim=1)).clamp(1, gamma + 1)
    if row_valid is not None:
        verify_lens = torch.where(row_valid, verify_lens, torch.zeros_like(verify_lens))
    return verify_lens


def full_verify_lengths(batch: int, gamma: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Verify-all lengths (relay not ready / no budget): [B] int64 filled with gamma + 1."""
    return torch.full((batch,), gamma + 1, dtype=torch.int64, device=device)


def survival_or_ones(rows: torch.Tensor, usable: torch.Tensor) -> torch.Tensor:
    """cumprod of lagged confidence rows where ``usable`` ([R] bool), all ones elsewhere."""
    surv = torch.cumprod(rows.double(), dim=1)
    return torch.where(usable.view(-1, 1), surv, torch.ones_like(surv))


class ConfidenceRelay:
    """Per-slot confidence buffer plus a ring of ``lag + 1`` host snapshots (the async budget's
    lagged confidences).

    ``publish`` runs once per decode step, after the step's budget is read: it scatters the
    step's confidences into a per-slot device buffer and copies the whole buffer (with slot
    generations) into the next ring entry -- asynchronously into pinned memory on CUDA, guarded
    by an event. ``lagged_survival`` reads the entry published ``lag`` steps before the step being
    planned, waiting for its copy: the budget is then a function of the step count alone, the
    same on every rank and in every run (a "use it if it has landed" query would make it follow
    the timing, and ranks could cap differently). The wait costs nothing at the default lag of
    2: the entry's copy was issued before the results of a step the scheduler has read already
    (the eager step reads its results at its end; the overlap schedule reads step N - 1 before
    it plans step N + 1). On a CPU device the copy is synchronous.

    Slot generations are >= 1 for live requests (bumped on slot reuse); a lagged row is used only
    if its stored generation equals the request's current one, so a request never inherits the
    confidences of a previous occupant of its slot.
    """

    def __init__(
        self, num_slots: int, gamma: int, lag: int = 2, device: torch.device | str = "cpu"
    ):
        if lag < 1:
            raise ValueError(f"confidence relay lag must be >= 1, got {lag}")
        self.gamma = gamma
        self.lag = lag
        self.device = torch.device(device)
        self._confidence = torch.zeros((num_slots, gamma), dtype=torch.float32, device=self.device)
        self._generation = torch.zeros((num_slots,), dtype=torch.int64, device=self.device)
        pin = self.device.type == "cuda"
        self._ring_conf = [torch.zeros((num_slots, gamma), pin_memory=pin) for _ in range(lag + 1)]
        self._ring_gen = [
            torch.zeros((num_slots,), dtype=torch.int64, pin_memory=pin) for _ in range(lag + 1)
        ]
        self._ring_event: list[torch.cuda.Event | None] = [None] * (lag + 1)
        self._num_published = 0

    def publish(
        self, slot_ids: torch.Tensor, generations: torch.Tensor, confidence: torch.Tensor
    ) -> None:
        """Record one step and snapshot it (`record`, then `snapshot`)."""
        self.record(slot_ids, generations, confidence)
        self.snapshot()

    def record(
        self, slot_ids: torch.Tensor, generations: torch.Tensor, confidence: torch.Tensor
    ) -> None:
        """Scatter one step's confidences into the per-slot device buffer (device ops only: it
        runs inside the fused step graph). slot_ids [B] int64, generations [B] int64, confidence
        [B, gamma] on the relay device (padding rows may point at a dummy slot with generation
        0)."""
        self._confidence.index_copy_(0, slot_ids, confidence.float())
        self._generation.index_copy_(0, slot_ids, generations.to(torch.int64))

    def snapshot(self) -> None:
        """Copy the per-slot buffer into the next ring entry (host side, once per step, after
        the step's `record` was issued: the copy is ordered after it on the stream)."""
        entry = self._num_published % (self.lag + 1)
        non_blocking = self.device.type == "cuda"
        self._ring_conf[entry].copy_(self._confidence, non_blocking=non_blocking)
        self._ring_gen[entry].copy_(self._generation, non_blocking=non_blocking)
        if non_blocking:
            event = torch.cuda.Event()
            event.record()
            self._ring_event[entry] = event
        self._num_published += 1

    def lagged_survival(
        self, slot_ids: Sequence[int], generations: Sequence[int]
    ) -> torch.Tensor | None:
        """[R, gamma] float64 CPU survival rows for the requests planned next, or None while the
        lagged snapshot does not exist yet (the first `lag` steps)."""
        step = self._num_published - self.lag
        if step < 0:
            return None
        entry = step % (self.lag + 1)
        event = self._ring_event[entry]
        if event is not None:
            event.synchronize()  # already complete at lag >= 2 (class doc)
        slots = torch.as_tensor(list(slot_ids), dtype=torch.int64)
        gens = torch.as_tensor(list(generations), dtype=torch.int64)
        stored_gen = self._ring_gen[entry][slots]
        usable = (stored_gen == gens) & (gens >= 1)
        return survival_or_ones(self._ring_conf[entry][slots], usable)


__all__ = [
    "VALID_SURVIVAL_EPS",
    "Algorithm1Result",
    "BudgetResult",
    "ConfidenceRelay",
    "align_budget_to_graph_tier",
    "allocate_verify_lengths",
    "budget_from_relay",
    "compute_verify_budget",
    "full_verify_lengths",
    "order_candidates",
    "plan_algorithm1",
    "predicted_throughput",
    "survival_or_ones",
]
