"""Verify-length policies behind one interface, chosen by server args.

* `full`: every request verifies its whole block (1 + gamma tokens).
* `static`: one width W for the whole batch per step, from a per-device table keyed by batch
  size, or from the online width policy (`width_policy.py`) driven by an SPS table.
* `confidence`: Algorithm 1 with early stop (`planner.plan_algorithm1`, synchronous) or the async
  top-K variant (budget from lagged confidences, allocation from the current ones).

All policies are non-anticipating: a length never depends on whether the draft it admits is
correct, which keeps DSpark lossless.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from sgl_dspark.srt.speculative.dspark.planner import (
    ConfidenceRelay,
    allocate_verify_lengths,
    budget_from_relay,
    plan_algorithm1,
)
from sgl_dspark.srt.speculative.dspark.sps import load_sps_table
from sgl_dspark.srt.speculative.dspark.width_policy import (
    VerifyWidthPolicy,
    device_table_key,
    parse_verify_widths,
    resolve_width_sps_table,
)

logger = logging.getLogger(__name__)

POLICIES = ("full", "static", "confidence")
_TUNING_DIR = Path(__file__).resolve().parents[3] / "kernels" / "tuning"


@dataclass(frozen=True)
class PolicyArgs:
    policy: str = "full"
    width_table_path: str | None = None
    online_width: bool = False
    verify_widths: str = "2,3"
    sps_table_path: str | None = None
    confidence_mode: str = "sync"  # sync (Algorithm 1) | async (top-K with lagged budget)
    device_name: str = "cpu"


class BaseVerifyPolicy(ABC):
    needs_confidence = False
    # Whether `verify_lens` returns device caps on acceptance (over a full-width verify) rather
    # than host widths: the acceptance graphs then take a cap input (`executor.py`).
    caps_acceptance = False

    @abstractmethod
    def verify_lens(
        self, confidence: torch.Tensor | None, slots: list[int], generations: list[int]
    ) -> list[int] | torch.Tensor:
        """Verify lengths (anchor included), each in [1, gamma + 1]: a host list when the
        policy decides on the host, or a `[B]` int64 device tensor (async confidence policy,
        applied as a cap on acceptance over a full-width verify)."""

    def observe(  # noqa: B027 - an optional hook: policies without feedback keep the no-op
        self,
        verify_lens: torch.Tensor,
        accept_lens: torch.Tensor,
        slots: list[int],
        generations: list[int],
    ) -> None:
        """Feed back the step's outcome (online statistics). It runs after the verify forward,
        so it takes no confidences: those of a draft graph are its outputs, valid only until
        another graph replays (`cuda_graph_runner.py`)."""

    def plain_decode(self, batch_size: int) -> bool:
        """True when a batch of this size should not speculate at all: the scheduler then runs
        plain decode steps (overlapped) that only commit the draft's context KV."""
        return False


class FullPolicy(BaseVerifyPolicy):
    def __init__(self, gamma: int, device: torch.device) -> None:
        self.gamma, self.device = gamma, device

    def verify_lens(self, confidence, slots, generations):
        return [self.gamma + 1] * len(slots)


def load_width_table(path: str | Path, full_width: int, clamp: bool = False) -> dict[int, int]:
    """`{"device": str, "widths_by_batch_size": {"<bs>": W | "full"}}` -> {bs: W}; W = 1 means
    no speculation at that batch size (plain decode steps). `clamp`: widths above this model's
    full width become the full width (a packaged per-device table serves every block size)
    instead of being rejected."""
    with open(path) as f:
        data = json.load(f)
    table = data.get("widths_by_batch_size") if isinstance(data, dict) else None
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: field 'widths_by_batch_size' must be a non-empty object")
    out = {}
    for bs, w in table.items():
        width = full_width if w == "full" else int(w)
        if clamp and width > full_width:
            width = full_width
        if not 1 <= width <= full_width:
            raise ValueError(
                f"{path}: width {w!r} for batch size {bs} must be 'full' or in "
                f"[1, {full_width}] (1: no speculation)"
            )
        out[int(bs)] = width
    return dict(sorted(out.items()))


class StaticWidthPolicy(BaseVerifyPolicy):
    """One width for the batch: table lookup (largest batch-size key <= B) or the online policy."""

    def __init__(self, gamma: int, args: PolicyArgs, device: torch.device) -> None:
        self.gamma, self.device = gamma, device
        full = gamma + 1
        self.table: dict[int, int] | None = None
        self.online: VerifyWidthPolicy | None = None
        self._last_width = full
        if args.online_width:
            sps = resolve_width_sps_table(args.device_name, args.sps_table_path)
            if sps is None:
                raise ValueError(
                    "--speculative-dspark-online-width needs an SPS table for this "
                    "device (--speculative-dspark-sps-table-path)"
                )
            # Configured widths that a small block cannot use (>= its full width) are dropped.
            narrow = [int(w) for w in str(args.verify_widths).split(",") if w.strip()]
            narrow = [w for w in narrow if w < full]
            if not narrow:
                self.table = {1: full}
                return
            self.online = VerifyWidthPolicy(
                parse_verify_widths(narrow, full)[:-1], full, sps, device=device
            )
            return
        path = args.width_table_path
        if path is None:
            packaged = _TUNING_DIR / f"dspark_widths_{device_table_key(args.device_name)}.json"
            if not packaged.is_file():
                raise ValueError(
                    f"static verify policy: no width table for device {args.device_name!r}; pass "
                    "--speculative-dspark-width-table-path or --speculative-dspark-online-width"
                )
            path = str(packaged)
        self.table = load_width_table(path, full, clamp=args.width_table_path is None)

    def graph_widths(self) -> tuple[int, ...]:
        """Every width this policy may return (the widths to capture verify graphs for)."""
        if self.online is not None:
            return (*self.online.widths, self.gamma + 1)
        assert self.table is not None
        return tuple(sorted(set(self.table.values())))

    def width(self, batch_size: int) -> int:
        if self.online is not None:
            self._last_width = int(self.online.choose(batch_size))
            return self._last_width
        assert self.table is not None
        keys = [k for k in self.table if k <= batch_size]
        return self.table[keys[-1]] if keys else self.table[min(self.table)]

    def verify_lens(self, confidence, slots, generations):
        return [self.width(len(slots))] * len(slots)

    def plain_decode(self, batch_size: int) -> bool:
        # Only a table entry turns speculation off; the online policy always speculates.
        return self.online is None and self.width(batch_size) == 1

    def observe(self, verify_lens, accept_lens, slots, generations):
        if self.online is not None and len(slots):
            self.online.record_step(self._last_width, accept_lens)


class ConfidencePolicy(BaseVerifyPolicy):
    needs_confidence = True

    def __init__(self, gamma: int, args: PolicyArgs, device: torch.device, num_slots: int) -> None:
        if args.sps_table_path is None:
            raise ValueError("confidence verify policy needs --speculative-dspark-sps-table-path")
        if args.confidence_mode not in ("sync", "async"):
            raise ValueError(
                f"--speculative-dspark-confidence-mode {args.confidence_mode!r}: sync or async"
            )
        self.gamma, self.device, self.mode = gamma, device, args.confidence_mode
        self.caps_acceptance = self.mode == "async"
        self.table = load_sps_table(args.sps_table_path)
        self.relay = (
            ConfidenceRelay(num_slots, gamma, device=device) if self.mode == "async" else None
        )

    def verify_lens(self, confidence, slots, generations):
        assert confidence is not None
        if self.mode == "sync":
            # Algorithm 1 needs this step's confidences on the host (a sync by design).
            return list(plan_algorithm1(confidence.float().cpu(), self.table).verify_lens)
        assert self.relay is not None
        budget = self.host_budget(slots, generations)
        lens = allocate_verify_lengths(confidence, None if budget < 0 else budget)
        # The step's confidences go into the relay now, after its budget read the lagged entry
        # (the order of a publish at the end of the step) and before the verify forward, whose
        # graph may reuse a draft graph's output memory for its intermediates.
        self.relay.publish(
            torch.as_tensor(slots, device=self.device),
            torch.as_tensor(generations, device=self.device),
            confidence,
        )
        return lens

    # The async mode's plan split for the fused step graph: `host_budget` before the replay,
    # `device_caps` inside it, `snapshot` after it.
    def host_budget(self, slots: list[int], generations: list[int]) -> int:
        """The async mode's budget K for the requests planned next, from the relay's lagged
        confidences (host values only); -1 (verify every window) while the relay has none."""
        assert self.relay is not None
        budget = budget_from_relay(self.relay, slots, generations, self.table)
        return -1 if budget is None else budget.budget

    def device_caps(
        self,
        confidence: torch.Tensor,
        budget: torch.Tensor,
        row_valid: torch.Tensor,
        slot_ids: torch.Tensor,
        generations: torch.Tensor,
    ) -> torch.Tensor:
        """The async mode's caps on accepted drafts [B] int64 (device ops only; captured in the
        fused step graph): `verify_lens`' allocation from a 0-d budget tensor (-1: verify every
        window), and the step's confidences recorded in the relay. `row_valid` False marks
        padding rows (cap 0; they commit nothing)."""
        assert self.relay is not None
        lens = allocate_verify_lengths(confidence, budget.clamp_min(0), row_valid)
        full = torch.full_like(lens, self.gamma + 1)
        lens = torch.where((budget < 0) & row_valid, full, lens)
        self.relay.record(slot_ids, generations, confidence)
        return (lens - 1).clamp_min(0)

    def snapshot(self) -> None:
        """After a fused step's replay: the relay's ring entry of the step (`device_caps`
        recorded its confidences)."""
        assert self.relay is not None
        self.relay.snapshot()


def create_verify_policy(
    gamma: int, args: PolicyArgs, device: torch.device, num_slots: int
) -> BaseVerifyPolicy:
    if args.policy == "full":
        return FullPolicy(gamma, device)
    if args.policy == "static":
        return StaticWidthPolicy(gamma, args, device)
    if args.policy == "confidence":
        return ConfidencePolicy(gamma, args, device, num_slots)
    raise ValueError(f"--speculative-dspark-verify-policy {args.policy!r}: choose from {POLICIES}")
