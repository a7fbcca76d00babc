"""DSpark acceptance and timing metrics.

``record_step`` only launches device ops (in-place adds into device counters, plus small per-step
tensors kept for lazy reduction); nothing is read back inside the decode step. ``summary``,
``step_records`` and ``request_metrics`` are the sync points -- call them from a reporter, not
from the step function.

Definitions (l = verify_len - 1 drafts verified, n = accepted drafts):
- accept length = sum(n + 1) / request-steps; accept rate = correct / verified drafts (and
  correct / (request-steps * gamma), the SGLang convention).
- conditional acceptance A_k = #(l >= k and n >= k) / #(l >= k and n >= k-1), k = 1..gamma --
  censored by verify length, so narrow verifies do not count as rejections.
- prefix survival S_k = #(n >= k) / #(l >= k).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

TimeValue = float | tuple[torch.cuda.Event, torch.cuda.Event]
_TOTAL_FIELDS = (
    "request_steps",
    "verified_drafts",
    "correct_drafts",
    "committed_tokens",
    "verify_tokens",
    "block_committed_tokens",
)


@dataclass(frozen=True, slots=True)
class StepRecord:
    request_steps: int
    verified_drafts: int
    correct_drafts: int
    committed_tokens: int
    verify_tokens: int  # real verify rows (anchor included)
    padded_verify_tokens: int | None  # rows the graph ran, padding included (if reported)
    timing_ms: dict[str, float] = field(default_factory=dict)
    extras: dict[str, float] = field(default_factory=dict)  # budget K, predicted theta, width...

    @property
    def accept_length(self) -> float:
        return self.committed_tokens / self.request_steps if self.request_steps else 0.0


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    steps: int
    verified_drafts: int
    correct_drafts: int
    committed_tokens: int

    @property
    def accept_length(self) -> float:
        return self.committed_tokens / self.steps if self.steps else 0.0


@dataclass(frozen=True, slots=True)
class MetricsSummary:
    num_steps: int
    request_steps: int
    verified_drafts: int
    correct_drafts: int
    committed_tokens: int
    verify_tokens: int
    accept_length: float
    accept_rate: float  # correct / verified drafts
    accept_rate_per_gamma: float  # correct / (request-steps * gamma)
    mean_verify_len: float  # scheduled length incl. anchor
    block_accept_length: float  # accept length before cap-accept trimming
    conditional_acceptance: tuple[float | None, ...]
    prefix_survival: tuple[float | None, ...]
    mean_timing_ms: dict[str, float]  # over the kept step records
    mean_extras: dict[str, float]  # over the kept step records


def _resolve_ms(value: TimeValue) -> float:
    if isinstance(value, tuple):
        start, end = value
        return float(start.elapsed_time(end))
    return float(value)


def _means(records: list[dict[str, float]]) -> dict[str, float]:
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for record in records:
        for key, value in record.items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


def _ratio(num: int, den: int) -> float | None:
    return num / den if den > 0 else None


class DSparkMetrics:
    """Accumulates per-step and per-request DSpark metrics; owned by the speculative worker."""

    def __init__(self, gamma: int, device: torch.device | str = "cpu", max_records: int = 4096):
        self.gamma = gamma
        self.device = torch.device(device)
        self._max_records = max_records
        self.reset()

    def reset(self) -> None:
        self._num_steps = 0
        self._totals = torch.zeros(len(_TOTAL_FIELDS), dtype=torch.int64, device=self.device)
        # rows: l >= k & n >= k, l >= k & n >= k-1, l >= k, n >= k
        self._positions = torch.zeros((4, self.gamma), dtype=torch.int64, device=self.device)
        self._steps: deque[
            tuple[torch.Tensor, int | None, dict[str, TimeValue], dict[str, float]]
        ] = deque(maxlen=self._max_records)
        self._requests: deque[tuple[list[str], torch.Tensor]] = deque(maxlen=self._max_records)

    def record_step(
        self,
        verify_lens: torch.Tensor,
        accept_lens: torch.Tensor,
        row_mask: torch.Tensor | None = None,
        request_ids: Sequence[str] | None = None,
        padded_verify_tokens: int | None = None,
        timing: Mapping[str, TimeValue] | None = None,
        extras: Mapping[str, float] | None = None,
        cap_trim: torch.Tensor | None = None,
    ) -> None:
        """Record one decode step without a host sync.

        Args:
            verify_lens: [B] int, verified rows per request incl. the anchor (0 = padding row).
            accept_lens: [B] int, accepted drafts n per request.
            row_mask: optional [B] bool, False for padding rows (default: verify_lens > 0).
            request_ids: optional host ids of the B rows, for per-request statistics.
            timing: host milliseconds or (start, end) CUDA event pairs, e.g. "draft", "verify",
                "step", "host" -- events are resolved lazily, after they have completed.
            extras: host scalars to average (budget, predicted theta, width, ...).
            cap_trim: optional [B] drafts removed by cap-accept; gives the uncapped block
                accept length.
        """
        mask = (verify_lens > 0) if row_mask is None else row_mask.to(torch.bool)
        m = mask.to(torch.int64)
        drafts = (verify_lens.to(torch.int64) - 1).clamp(min=0) * m
        n = accept_lens.to(torch.int64) * m
        trim = torch.zeros_like(n) if cap_trim is None else cap_trim.to(torch.int64) * m
        per_request = torch.stack(
            [m, drafts, n, (n + 1) * m, verify_lens.to(torch.int64) * m, (n + trim + 1) * m]
        )
        step_totals = per_request.sum(dim=1)
        self._totals += step_totals
        ks = torch.arange(1, self.gamma + 1, device=verify_lens.device).view(1, -1)
        reached = (drafts.view(-1, 1) >= ks) & mask.view(-1, 1)
        accepted_k = n.view(-1, 1) >= ks
        positions = torch.stack(
            [
                reached & accepted_k,
                reached & (n.view(-1, 1) >= ks - 1),
                reached,
                accepted_k & mask.view(-1, 1),
            ]
        )
        self._positions += positions.to(torch.int64).sum(dim=1)
        self._num_steps += 1
        self._steps.append(
            (step_totals, padded_verify_tokens, dict(timing or {}), dict(extras or {}))
        )
        if request_ids is not None:
            if len(request_ids) != verify_lens.shape[0]:
                raise ValueError(
                    f"request_ids has {len(request_ids)} ids for {verify_lens.shape[0]} rows"
                )
            self._requests.append((list(request_ids), per_request[:4]))

    def step_records(self) -> list[StepRecord]:
        """Per-step records kept so far (at most ``max_records``). Syncs with the device."""
        if not self._steps:
            return []
        totals = torch.stack([s[0] for s in self._steps]).tolist()
        return [
            StepRecord(
                request_steps=vals[0],
                verified_drafts=vals[1],
                correct_drafts=vals[2],
                committed_tokens=vals[3],
                verify_tokens=vals[4],
                padded_verify_tokens=padded,
                timing_ms={k: _resolve_ms(v) for k, v in timing.items()},
                extras=extras,
            )
            for vals, (_, padded, timing, extras) in zip(totals, self._steps)
        ]

    def request_metrics(self) -> dict[str, RequestMetrics]:
        """Per-request sums over the kept steps (rows flagged as padding are skipped)."""
        acc: dict[str, list[int]] = {}
        for ids, per_request in self._requests:
            cols = per_request.t().tolist()
            for rid, (valid, drafts, correct, committed) in zip(ids, cols):
                if not valid:
                    continue
                entry = acc.setdefault(rid, [0, 0, 0, 0])
                entry[0] += 1
                entry[1] += drafts
                entry[2] += correct
                entry[3] += committed
        return {rid: RequestMetrics(*vals) for rid, vals in acc.items()}

    def summary(self) -> MetricsSummary:
        """Aggregate over every recorded step since the last ``reset``. Syncs with the device."""
        req, verified, correct, committed, verify_tokens, block = self._totals.tolist()
        num, den, reached, survived = self._positions.tolist()
        return MetricsSummary(
            num_steps=self._num_steps,
            request_steps=req,
            verified_drafts=verified,
            correct_drafts=correct,
            committed_tokens=committed,
            verify_tokens=verify_tokens,
            accept_length=committed / req if req else 0.0,
            accept_rate=correct / verified if verified else 0.0,
            accept_rate_per_gamma=correct / (req * self.gamma) if req else 0.0,
            mean_verify_len=verify_tokens / req if req else 0.0,
            block_accept_length=block / req if req else 0.0,
            conditional_acceptance=tuple(_ratio(a, b) for a, b in zip(num, den)),
            prefix_survival=tuple(_ratio(a, b) for a, b in zip(survived, reached)),
            mean_timing_ms=_means(
                [{k: _resolve_ms(v) for k, v in t.items()} for *_, t, _ in self._steps]
            ),
            mean_extras=_means([extras for *_, extras in self._steps]),
        )
