"""Per-request sampling parameters: SGLang's names and defaults, validated once at construction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# Below this temperature a request is greedy (SGLang's threshold).
GREEDY_TEMPERATURE_EPS = 1e-6
TOP_K_OFF = -1
_MAX_SEED = 2**63


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _normalise_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a str, a list of str or null, got {value!r}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must hold non-empty strings, got {item!r}")
    return tuple(items)


def _normalise_stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"stop_token_ids must be a list of int, got {value!r}")
    ids = tuple(_check_int("stop_token_ids", v) for v in value)
    if any(v < 0 for v in ids):
        raise ValueError(f"stop_token_ids must be >= 0, got {list(ids)}")
    return ids


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters of one request.

    `stop` accepts a str, a list of str or None and is stored as a tuple; `stop_token_ids`
    likewise. A temperature below `GREEDY_TEMPERATURE_EPS` is normalised as in SGLang to
    `temperature=1.0, top_k=1`, so greedy is exactly `top_k == 1` (`is_greedy`).
    Penalties accept only their neutral value for now. Raises ValueError naming the field.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_OFF
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        # Construction-time normalisation of a frozen record: the only place fields are written.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("max_new_tokens", _check_int("max_new_tokens", self.max_new_tokens))
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        put("temperature", _check_float("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        put("top_p", _check_float("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        put("top_k", _check_int("top_k", self.top_k))
        if self.top_k != TOP_K_OFF and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        put("min_p", _check_float("min_p", self.min_p))
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        put("stop", _normalise_stop(self.stop))
        put("stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            _check_bool(name, getattr(self, name))
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < _MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name, neutral in (
            ("frequency_penalty", 0.0),
            ("presence_penalty", 0.0),
            ("repetition_penalty", 1.0),
        ):
            value = _check_float(name, getattr(self, name))
            if value != neutral:
                raise ValueError(f"{name}={value} is not supported yet (only {neutral})")
            put(name, value)
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            put("temperature", 1.0)
            put("top_k", 1)

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding (temperature 0 was normalised to top_k 1)."""
        return self.top_k == 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict (SGLang's `sampling_params`). A null value means the
        default. Raises ValueError for unknown keys, wrong types or out-of-range values."""
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"unknown sampling_params key(s): {', '.join(unknown)}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict that `from_dict` maps back to an equal record."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out
