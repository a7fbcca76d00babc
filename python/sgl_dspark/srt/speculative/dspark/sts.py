"""Sequential Temperature Scaling of the confidence head.

The confidence head emits raw logits raw_k per draft position; the runtime uses
c_k = sigmoid(raw_k / T_k). STS fits T_1..T_gamma left to right so that the cumulative product
prod_{i<=k} c_i (the predicted prefix survival) is calibrated against the observed prefix mask.
Calibration changes efficiency only, never exactness.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

NUM_ECE_BINS = 15
GRID_SIZE = 41
GRID_MIN, GRID_MAX = 0.1, 10.0
_PROB_CLAMP = 1e-8


def sts_temperature_grid() -> torch.Tensor:
    """41 log-spaced temperatures in [0.1, 10] (float64)."""
    return torch.logspace(
        math.log10(GRID_MIN), math.log10(GRID_MAX), GRID_SIZE, dtype=torch.float64
    )


def expected_calibration_error(
    probs: torch.Tensor, labels: torch.Tensor, num_bins: int = NUM_ECE_BINS
) -> torch.Tensor:
    """ECE with equal-width bins over [0, 1].

    Args:
        probs: [n] or [n, m] predicted probabilities (clamped to [1e-8, 1 - 1e-8]).
        labels: [n] 0/1 labels (shared by every column of ``probs``).
    Returns:
        float64 tensor, shape [] or [m]: sum over bins of (count/n) * |mean prob - mean label|.
    """
    if probs.shape[0] != labels.shape[0]:
        raise ValueError(f"ECE: probs has {probs.shape[0]} rows but labels has {labels.shape[0]}")
    squeeze = probs.dim() == 1
    p = probs.double().reshape(probs.shape[0], -1).clamp(_PROB_CLAMP, 1.0 - _PROB_CLAMP)
    y = labels.double().reshape(-1, 1).expand_as(p)
    n, m = p.shape
    if n == 0:
        raise ValueError("ECE needs at least one sample")
    bins = (p * num_bins).long().clamp_(0, num_bins - 1)
    # Bin index per column, offset so one scatter_add handles all m columns.
    flat = (bins + torch.arange(m).view(1, m) * num_bins).reshape(-1)
    size = m * num_bins
    sum_p = torch.zeros(size, dtype=torch.float64).scatter_add_(0, flat, p.reshape(-1))
    sum_y = torch.zeros(size, dtype=torch.float64).scatter_add_(0, flat, y.reshape(-1))
    # |mean p - mean y| * count / n == |sum p - sum y| / n, and empty bins contribute 0.
    ece = ((sum_p - sum_y).abs().view(m, num_bins).sum(dim=1)) / n
    return ece[0] if squeeze else ece


def apply_sts(
    raw: torch.Tensor, temperatures: torch.Tensor | list[float] | tuple[float, ...]
) -> torch.Tensor:
    """c = sigmoid(raw / T) per position. raw [..., gamma]; temperatures [gamma] > 0. fp32 out."""
    temps = torch.as_tensor(temperatures, dtype=torch.float32, device=raw.device)
    return torch.sigmoid(raw.float() / temps)


@dataclass(frozen=True, slots=True)
class StsCalibration:
    """Per-position STS temperatures plus fit diagnostics (the STS JSON record)."""

    temperatures: tuple[float, ...]
    dataset: str = ""
    num_samples: int = 0
    ece_before: tuple[float, ...] = ()
    ece_after: tuple[float, ...] = ()

    @classmethod
    def identity(cls, gamma: int) -> StsCalibration:
        return cls(temperatures=(1.0,) * gamma)

    @classmethod
    def from_json_dict(cls, data: dict[str, Any], gamma: int | None = None) -> StsCalibration:
        """Validate (raises ValueError naming the field); ``gamma`` checks the runtime block size."""
        if not isinstance(data, dict):
            raise ValueError("STS file must be a JSON object")
        temps = data.get("temperatures")
        if not isinstance(temps, list) or not temps:
            raise ValueError("STS field 'temperatures' must be a non-empty list of numbers")
        for i, t in enumerate(temps):
            if (
                isinstance(t, bool)
                or not isinstance(t, (int, float))
                or not math.isfinite(t)
                or t <= 0
            ):
                raise ValueError(
                    f"STS field 'temperatures'[{i}] must be a finite number > 0, got {t!r}"
                )
        if gamma is not None and len(temps) != gamma:
            raise ValueError(
                f"STS field 'temperatures' has {len(temps)} entries but the draft block size is {gamma}"
            )
        dataset = data.get("dataset", "")
        if not isinstance(dataset, str):
            raise ValueError(f"STS field 'dataset' must be a string, got {dataset!r}")
        num_samples = data.get("num_samples", 0)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(
                f"STS field 'num_samples' must be a non-negative integer, got {num_samples!r}"
            )
        eces = {}
        for key in ("ece_before", "ece_after"):
            values = data.get(key, [])
            if not isinstance(values, list) or (values and len(values) != len(temps)):
                raise ValueError(f"STS field '{key}' must be a list with one value per position")
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
                raise ValueError(f"STS field '{key}' must hold numbers")
            eces[key] = tuple(float(v) for v in values)
        return cls(
            temperatures=tuple(float(t) for t in temps),
            dataset=dataset,
            num_samples=num_samples,
            ece_before=eces["ece_before"],
            ece_after=eces["ece_after"],
        )

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "temperatures": list(self.temperatures),
            "dataset": self.dataset,
            "num_samples": self.num_samples,
            "ece_before": list(self.ece_before),
            "ece_after": list(self.ece_after),
        }

    @classmethod
    def load(cls, path: str | Path, gamma: int | None = None) -> StsCalibration:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"STS file {path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_json_dict(data, gamma)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        return apply_sts(raw, self.temperatures)


def fit_sts(
    raw: torch.Tensor,
    prefix_mask: torch.Tensor,
    num_bins: int = NUM_ECE_BINS,
    grid: torch.Tensor | None = None,
    dataset: str = "",
) -> StsCalibration:
    """Left-to-right grid fit of per-position temperatures.

    Args:
        raw: [n, gamma] raw confidence logits (identity temperatures at collection).
        prefix_mask: [n, gamma] 1 where the position lies inside the accepted prefix.
    Returns:
        StsCalibration with T_k = argmin over the grid (first on ties) of the ECE of
        prod_{i<=k} sigmoid(raw_i / T_i) against prefix_mask[:, k], T_<k already fixed.
    """
    if raw.dim() != 2 or raw.shape != prefix_mask.shape:
        raise ValueError(
            f"STS fit: 'raw' and 'prefix_mask' must both be [n, gamma], got "
            f"{tuple(raw.shape)} and {tuple(prefix_mask.shape)}"
        )
    if raw.shape[0] == 0:
        raise ValueError("STS fit: no samples")
    if not torch.isfinite(raw).all():
        raise ValueError("STS fit: 'raw' contains non-finite values")
    grid = sts_temperature_grid() if grid is None else grid.double()
    raw64 = raw.double()
    labels = prefix_mask.double()
    gamma = raw.shape[1]
    cum_fit = torch.ones(raw.shape[0], dtype=torch.float64)
    cum_identity = torch.ones_like(cum_fit)
    temps, before, after = [], [], []
    for k in range(gamma):
        cum_identity = cum_identity * torch.sigmoid(raw64[:, k])
        before.append(float(expected_calibration_error(cum_identity, labels[:, k], num_bins)))
        candidates = cum_fit.view(-1, 1) * torch.sigmoid(raw64[:, k : k + 1] / grid.view(1, -1))
        eces = expected_calibration_error(candidates, labels[:, k], num_bins)
        best = int(torch.argmin(eces))  # first minimum on ties
        temps.append(float(grid[best]))
        after.append(float(eces[best]))
        cum_fit = candidates[:, best]
    return StsCalibration(
        temperatures=tuple(temps),
        dataset=dataset,
        num_samples=int(raw.shape[0]),
        ece_before=tuple(before),
        ece_after=tuple(after),
    )
