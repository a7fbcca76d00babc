"""Static per-step verify width.

Every request of a step verifies the same W tokens (anchor + first W-1 drafts), so the verify maps
onto one captured graph per (width, batch bucket). The width depends only on the batch size and on
lagged acceptance statistics, never on this step's drafts, so the policy is exact and
deterministic across TP ranks that see the same histograms.

Hardware tables: the width policy needs a diagonal SPS table. A user table (JSON path) wins; else a
packaged table for the *named* device, ``sgl_dspark/kernels/tuning/dspark_sps_<device>.json``. No
default table ships: numbers profiled on one accelerator say nothing about another, so without a
table the caller must keep full width.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from sgl_dspark.srt.speculative.dspark.sps import DiagonalSpsTable, load_sps_table

logger = logging.getLogger(__name__)

PACKAGED_TABLE_DIR = Path(__file__).resolve().parents[3] / "kernels" / "tuning"


def device_table_key(device_name: str) -> str:
    """Normalise a device name ("NVIDIA H200", "AMD Instinct MI355X") to a file key."""
    key = re.sub(r"[^0-9a-z]+", "_", device_name.lower()).strip("_")
    if not key:
        raise ValueError(f"device name {device_name!r} has no alphanumeric characters")
    return key


def packaged_sps_table_path(device_name: str, tables_dir: Path | None = None) -> Path | None:
    """Path of the packaged diagonal table for exactly this device, or None if none ships."""
    path = (tables_dir or PACKAGED_TABLE_DIR) / f"dspark_sps_{device_table_key(device_name)}.json"
    return path if path.is_file() else None


def resolve_width_sps_table(
    device_name: str, user_path: str | Path | None = None, tables_dir: Path | None = None
) -> DiagonalSpsTable | None:
    """User table if given, else the packaged table for ``device_name``, else None (keep full width)."""
    path = Path(user_path) if user_path else packaged_sps_table_path(device_name, tables_dir)
    if path is None:
        logger.warning(
            "no DSpark SPS table for device %r: narrow verify widths disabled "
            "(profile one and pass --speculative-dspark-sps-table-path)",
            device_name,
        )
        return None
    table = load_sps_table(path, kind="diagonal")
    assert isinstance(table, DiagonalSpsTable)
    logger.info("DSpark verify-width SPS table: %s", path)
    return table


def parse_verify_widths(widths: str | Sequence[int], full_width: int) -> tuple[int, ...]:
    """Validate configured narrow widths; returns sorted(narrow ∪ {full_width}).

    Each narrow width must satisfy 2 <= w < full_width (1 verifies no draft; full_width is always
    present; larger widths do not exist). Accepts a comma list ("2,3") or a sequence of ints."""
    if full_width < 2:
        raise ValueError(f"verify widths: full width must be >= 2, got {full_width}")
    if isinstance(widths, str):
        items = [w.strip() for w in widths.split(",") if w.strip()]
        try:
            parsed = [int(w) for w in items]
        except ValueError as exc:
            raise ValueError(
                f"verify widths must be a comma list of integers, got {widths!r}"
            ) from exc
    else:
        parsed = [int(w) for w in widths]
    for w in parsed:
        if not 2 <= w < full_width:
            raise ValueError(
                f"verify widths: each width must satisfy 2 <= w < {full_width} "
                f"(full width is implicit), got {w}"
            )
    return tuple(sorted(set(parsed) | {full_width}))


class VerifyWidthPolicy:
    """Online width choice from decayed hazard estimates and a diagonal SPS table.

    Hazard h_j = P(draft j+1 accepted | drafts 1..j accepted), estimated from a histogram
    cnt[width][correct_len] accumulated on the device and consumed once per ``update_interval``
    steps with a one-interval lag. Narrow widths censor deep positions, so the policy returns full
    width every ``explore_every`` decisions (and while any hazard is still undefined).
    """

    def __init__(
        self,
        widths: Sequence[int],
        full_width: int,
        sps_table: DiagonalSpsTable,
        *,
        update_interval: int = 32,
        decay: float = 0.9,
        explore_every: int = 64,
        switch_margin: float = 1.02,
        forced_width: int | None = None,
        device: torch.device | str = "cpu",
    ):
        if not isinstance(sps_table, DiagonalSpsTable):
            raise ValueError("verify width policy needs a diagonal SPS table (tokens -> steps/s)")
        self.widths = parse_verify_widths(list(widths), full_width)
        self.full_width = full_width
        if forced_width is not None and forced_width not in self.widths:
            raise ValueError(f"forced verify width {forced_width} is not one of {self.widths}")
        if update_interval < 1 or explore_every < 1 or not 0 < decay <= 1 or switch_margin < 1:
            raise ValueError(
                "verify width policy: need update_interval >= 1, explore_every >= 1, "
                "0 < decay <= 1, switch_margin >= 1"
            )
        self.sps_table = sps_table
        self.update_interval = update_interval
        self.decay = decay
        self.explore_every = explore_every
        self.switch_margin = switch_margin
        self.forced_width = forced_width
        self.current = full_width
        self.num_decisions = 0
        num_drafts = full_width - 1
        self._reached = [0.0] * num_drafts
        self._correct = [0.0] * num_drafts
        self.device = torch.device(device)
        self._counts = torch.zeros(
            (len(self.widths), full_width), dtype=torch.int64, device=self.device
        )
        self._steps_in_interval = 0
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    # ---- hazards -----------------------------------------------------------------------------
    @property
    def hazards(self) -> list[float | None]:
        """h_j for j = 0..full_width-2 (None while no request has reached draft j+1)."""
        return [c / r if r > 0 else None for c, r in zip(self._correct, self._reached)]

    def update_hazards(self, counts: torch.Tensor | Sequence[Sequence[int]]) -> None:
        """Fold one interval's histogram into the decayed estimates.

        counts: [len(widths), full_width] -- counts[i][k] = #requests of a widths[i] step whose
        correct_len was k. Positions a width does not verify contribute nothing (censoring)."""
        table = counts.tolist() if isinstance(counts, torch.Tensor) else [list(r) for r in counts]
        if len(table) != len(self.widths) or any(len(r) != self.full_width for r in table):
            raise ValueError(
                f"width histogram must be [{len(self.widths)}, {self.full_width}], "
                f"got {len(table)} rows"
            )
        for j in range(self.full_width - 1):
            reached = correct = 0
            for width, row in zip(self.widths, table):
                if j <= width - 2:
                    reached += sum(row[j:])
                    correct += sum(row[j + 1 :])
            if reached > 0:
                self._reached[j] = self.decay * self._reached[j] + reached
                self._correct[j] = self.decay * self._correct[j] + correct

    # ---- device histogram ---------------------------------------------------------------------
    def record_step(
        self, width: int, correct_lens: torch.Tensor, row_mask: torch.Tensor | None = None
    ) -> None:
        """Count one verified step without a host sync. correct_lens [B] int (accepted drafts),
        row_mask [B] bool (False = padding). Every ``update_interval`` calls the histogram is
        snapshotted to the host and the previous interval's snapshot is consumed."""
        idx = self.widths.index(width)
        ones = torch.ones_like(correct_lens, dtype=torch.int64)
        if row_mask is not None:
            ones = ones * row_mask.to(torch.int64)
        lens = correct_lens.to(torch.int64).clamp(0, self.full_width - 1)
        self._counts[idx].index_add_(0, lens, ones)
        self._steps_in_interval += 1
        if self._steps_in_interval >= self.update_interval:
            self._rotate_interval()

    def _rotate_interval(self) -> None:
        if self._pending is not None:
            snapshot, event = self._pending
            if event is not None:
                # Recorded a whole interval ago; waiting keeps the lag fixed on every rank.
                event.synchronize()
            self.update_hazards(snapshot)
        on_cuda = self.device.type == "cuda"
        snapshot = torch.empty(self._counts.shape, dtype=torch.int64, pin_memory=on_cuda)
        snapshot.copy_(self._counts, non_blocking=on_cuda)
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending = (snapshot, event)
        self._counts.zero_()
        self._steps_in_interval = 0

    # ---- decision ---------------------------------------------------------------------------
    def expected_tokens(self, width: int) -> float:
        """E(w) = 1 + sum_{j<=w-2} prod_{i<=j} h_i (requires every hazard to be defined)."""
        total, survival = 1.0, 1.0
        for h in self.hazards[: width - 1]:
            assert h is not None, "expected_tokens needs defined hazards"
            survival *= h
            total += survival
        return total

    def predicted_throughput(self, batch_size: int, width: int) -> float:
        return (
            batch_size
            * self.expected_tokens(width)
            * float(self.sps_table.steps_per_sec_interp(batch_size * width))
        )

    def choose(self, batch_size: int, force_full: bool = False) -> int:
        """Width for the next step of ``batch_size`` requests. ``force_full`` (a request with a
        grammar or logprobs this step) returns full width without counting as a decision."""
        if self.forced_width is not None:
            return self.forced_width
        if force_full:
            return self.full_width
        self.num_decisions += 1
        if any(h is None for h in self.hazards) or self.num_decisions % self.explore_every == 0:
            return self.full_width
        preds = {w: self.predicted_throughput(batch_size, w) for w in self.widths}
        best = max(self.widths, key=lambda w: preds[w])  # first (narrowest) maximum
        if best != self.current and preds[best] > self.switch_margin * preds[self.current]:
            self.current = best
        return self.current
