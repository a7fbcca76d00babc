"""SPS cost tables: how many target steps per second a decode step of a given size runs at.

Two JSON formats:

- diagonal: ``{"sample_batch_tokens": [int, strictly increasing], "sample_steps_per_sec": [float],
  "max_batch_tokens": int}`` -- steps/s as a function of verify tokens per step, profiled in static
  mode (every request verifies the full window).
- additive: ``{"bias_seconds": float, "bs_probes": [int], "alpha_seconds": [float],
  "m_probes": [int], "theta_seconds": [float]}`` -- step time T(bs, M) = bias + alpha(bs) + theta(M)
  for bs requests verifying M tokens in total (off-diagonal profile).

Lookups: the budget planner reads diagonal tables through a floor-probe step function (largest
probe <= tokens, clamped to the first probe below the range); the width policy uses linear
interpolation clamped at both ends; additive tables interpolate alpha over bs and theta over M,
clamped. Lookups are vectorised over numpy arrays so the planner can score every budget at once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

ArrayLike = int | float | npt.ArrayLike

_DIAGONAL_KEYS = ("sample_batch_tokens", "sample_steps_per_sec")
_ADDITIVE_KEYS = ("bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds")


def _int_list(data: dict[str, Any], key: str, *, strictly_increasing: bool) -> tuple[int, ...]:
    values = data.get(key)
    if not isinstance(values, list) or not values:
        raise ValueError(f"SPS table field '{key}' must be a non-empty list of integers")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"SPS table field '{key}'[{i}] must be an integer, got {v!r}")
        if v < 1:
            raise ValueError(f"SPS table field '{key}'[{i}] must be >= 1, got {v}")
        if strictly_increasing and i > 0 and v <= values[i - 1]:
            raise ValueError(
                f"SPS table field '{key}' must be strictly increasing: "
                f"index {i} has {v} after {values[i - 1]}"
            )
    return tuple(values)


def _float_list(
    data: dict[str, Any], key: str, length: int, *, positive: bool
) -> tuple[float, ...]:
    values = data.get(key)
    if not isinstance(values, list):
        raise ValueError(f"SPS table field '{key}' must be a list of numbers")
    if len(values) != length:
        raise ValueError(
            f"SPS table field '{key}' has {len(values)} entries, expected {length} (one per probe)"
        )
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"SPS table field '{key}'[{i}] must be a finite number, got {v!r}")
        if positive and v <= 0:
            raise ValueError(f"SPS table field '{key}'[{i}] must be > 0, got {v}")
        out.append(float(v))
    return tuple(out)


def _interp_clamped(x: ArrayLike, xp: tuple[int, ...], fp: tuple[float, ...]) -> np.ndarray:
    # np.interp already clamps to fp[0] / fp[-1] outside [xp[0], xp[-1]].
    return np.interp(np.asarray(x, dtype=np.float64), np.asarray(xp, np.float64), np.asarray(fp))


@dataclass(frozen=True, slots=True)
class DiagonalSpsTable:
    """Steps/s of a decode step as a function of its verify-token count."""

    sample_batch_tokens: tuple[int, ...]
    sample_steps_per_sec: tuple[float, ...]
    max_batch_tokens: int

    def __post_init__(self) -> None:
        # Re-validate when built directly (not through from_json_dict).
        DiagonalSpsTable.from_json_dict(self.to_json_dict())

    @classmethod
    def uninitialised(cls) -> DiagonalSpsTable:
        """A flat table (one probe, 1 step/s): throughput then grows with every verified token,
        so every planner degenerates to verify-all."""
        return cls(sample_batch_tokens=(1,), sample_steps_per_sec=(1.0,), max_batch_tokens=1)

    @property
    def is_uninitialised(self) -> bool:
        return len(self.sample_batch_tokens) == 1

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> DiagonalSpsTable:
        """Validate and build; raises ValueError naming the offending field."""
        if not isinstance(data, dict):
            raise ValueError("SPS table must be a JSON object")
        tokens = _int_list(data, "sample_batch_tokens", strictly_increasing=True)
        sps = _float_list(data, "sample_steps_per_sec", len(tokens), positive=True)
        max_tokens = data.get("max_batch_tokens", tokens[-1])
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(
                f"SPS table field 'max_batch_tokens' must be a positive integer, got {max_tokens!r}"
            )
        table = object.__new__(cls)
        object.__setattr__(table, "sample_batch_tokens", tokens)
        object.__setattr__(table, "sample_steps_per_sec", sps)
        object.__setattr__(table, "max_batch_tokens", max_tokens)
        return table

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "sample_batch_tokens": list(self.sample_batch_tokens),
            "sample_steps_per_sec": list(self.sample_steps_per_sec),
            "max_batch_tokens": self.max_batch_tokens,
        }

    def steps_per_sec_floor(self, num_tokens: ArrayLike) -> np.ndarray:
        """Step function: value of the largest probe <= num_tokens (first probe below the range).

        Vectorised: returns a float64 array shaped like ``num_tokens`` (0-d for a scalar)."""
        tokens = np.asarray(num_tokens, dtype=np.float64)
        idx = np.searchsorted(np.asarray(self.sample_batch_tokens), tokens, side="right") - 1
        return np.asarray(self.sample_steps_per_sec)[np.clip(idx, 0, None)]

    def steps_per_sec_interp(self, num_tokens: ArrayLike) -> np.ndarray:
        """Linear interpolation between probes, clamped to the end values outside the range."""
        return _interp_clamped(num_tokens, self.sample_batch_tokens, self.sample_steps_per_sec)


@dataclass(frozen=True, slots=True)
class AdditiveSpsTable:
    """Step time T(bs, M) = bias + alpha(bs) + theta(M), alpha/theta interpolated and clamped."""

    bias_seconds: float
    bs_probes: tuple[int, ...]
    alpha_seconds: tuple[float, ...]
    m_probes: tuple[int, ...]
    theta_seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        AdditiveSpsTable.from_json_dict(self.to_json_dict())

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> AdditiveSpsTable:
        """Validate and build; raises ValueError naming the offending field."""
        if not isinstance(data, dict):
            raise ValueError("SPS table must be a JSON object")
        bias = data.get("bias_seconds")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(
                f"SPS table field 'bias_seconds' must be a finite number, got {bias!r}"
            )
        if bias <= 0:
            raise ValueError(f"SPS table field 'bias_seconds' must be > 0, got {bias}")
        bs_probes = _int_list(data, "bs_probes", strictly_increasing=True)
        alpha = _float_list(data, "alpha_seconds", len(bs_probes), positive=False)
        m_probes = _int_list(data, "m_probes", strictly_increasing=True)
        theta = _float_list(data, "theta_seconds", len(m_probes), positive=False)
        # Interpolation never leaves the hull of the probe values, so this bounds every lookup.
        if float(bias) + min(alpha) + min(theta) <= 0:
            raise ValueError(
                "SPS table fields 'bias_seconds' + min('alpha_seconds') + min('theta_seconds') "
                "must be > 0 (a step time cannot be non-positive)"
            )
        table = object.__new__(cls)
        object.__setattr__(table, "bias_seconds", float(bias))
        object.__setattr__(table, "bs_probes", bs_probes)
        object.__setattr__(table, "alpha_seconds", alpha)
        object.__setattr__(table, "m_probes", m_probes)
        object.__setattr__(table, "theta_seconds", theta)
        return table

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "bias_seconds": self.bias_seconds,
            "bs_probes": list(self.bs_probes),
            "alpha_seconds": list(self.alpha_seconds),
            "m_probes": list(self.m_probes),
            "theta_seconds": list(self.theta_seconds),
        }

    def step_seconds(self, batch_size: ArrayLike, num_tokens: ArrayLike) -> np.ndarray:
        """T(bs, M) in seconds; broadcasts ``batch_size`` against ``num_tokens``."""
        alpha = _interp_clamped(batch_size, self.bs_probes, self.alpha_seconds)
        theta = _interp_clamped(num_tokens, self.m_probes, self.theta_seconds)
        return self.bias_seconds + alpha + theta

    def steps_per_sec(self, batch_size: ArrayLike, num_tokens: ArrayLike) -> np.ndarray:
        return 1.0 / self.step_seconds(batch_size, num_tokens)


SpsTable = DiagonalSpsTable | AdditiveSpsTable


def sps_table_from_json_dict(data: dict[str, Any], kind: str = "auto") -> SpsTable:
    """Build a table from parsed JSON.

    ``kind``: "diagonal", "additive" or "auto" (additive when its keys are present -- it models
    ragged steps better -- else diagonal). Raises ValueError on a missing or malformed field."""
    if not isinstance(data, dict):
        raise ValueError("SPS table must be a JSON object")
    if kind not in ("auto", "diagonal", "additive"):
        raise ValueError(f"SPS table kind must be auto/diagonal/additive, got {kind!r}")
    has_additive = any(k in data for k in _ADDITIVE_KEYS)
    has_diagonal = any(k in data for k in _DIAGONAL_KEYS)
    if kind == "auto":
        if not has_additive and not has_diagonal:
            raise ValueError(
                "SPS table has neither diagonal fields "
                f"{_DIAGONAL_KEYS} nor additive fields {_ADDITIVE_KEYS}"
            )
        kind = "additive" if has_additive else "diagonal"
    if kind == "additive":
        return AdditiveSpsTable.from_json_dict(data)
    return DiagonalSpsTable.from_json_dict(data)


def load_sps_table(path: str | Path, kind: str = "auto") -> SpsTable:
    """Read a JSON SPS table from ``path`` (see ``sps_table_from_json_dict`` for ``kind``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"SPS table {path} is not valid JSON: {exc}") from exc
    try:
        return sps_table_from_json_dict(data, kind)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def save_sps_table(table: SpsTable, path: str | Path) -> None:
    Path(path).write_text(json.dumps(table.to_json_dict(), indent=2) + "\n")
