"""Per-request sampling parameters: SGLang's names and defaults, validated once at construction.

Validation is one table, `FIELD_RULES`: per field, the type it accepts and the range, worded for
the error message. The ranges are SGLang's (`SamplingParams.verify`: temperature finite >= 0, top_p
in (0, 1], top_k -1 or >= 1, min_p in [0, 1], penalties in [-2, 2] / (0, 2], at most 32 stop
strings, `min_new_tokens` <= `max_new_tokens`, logit biases in [-100, 100] keyed by token id, at
most one of `json_schema` / `regex` / `ebnf`), plus our own where we are stricter: a seed in [0, 2**63), stop strings non-empty and at
most `MAX_STOP_STRING_CHARS` long, at most `MAX_STOP_TOKEN_IDS` stop token ids. Every value the
table accepts is one the sampler can run (`srt/layers/sampler.py` is total over them). A new
field needs a rule: `test_sampling_params` checks that every field has one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

# Below this temperature a request is greedy (SGLang's threshold).
GREEDY_TEMPERATURE_EPS = 1e-6
TOP_K_OFF = -1
MAX_SEED = 2**63
MAX_STOP_STRINGS = 32  # SGLang's limit
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each bias
MAX_LOGIT_BIAS_ENTRIES = 4096
MAX_GRAMMAR_CHARS = 1 << 20
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        as_float = float(value)
    except OverflowError:  # an int past the double range
        raise ValueError(f"{name} must be finite, got {value!r}") from None
    if not math.isfinite(as_float):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return as_float


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _optional_int(name: str, value: Any) -> int | None:
    return None if value is None else _int(name, value)


def _stop_strings(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{name} must be a str, a list of str or null, got {value!r}")
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"{name} may hold at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{name} must hold non-empty strings, got {_short(item)}")
        if len(item) > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"{name} strings may be at most {MAX_STOP_STRING_CHARS} characters long, "
                f"got {len(item)}"
            )
    return tuple(items)


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"{name} must be a list of int, got {_short(value)}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{name} may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}")
    ids = tuple(_int(name, v) for v in value)
    if any(v < 0 for v in ids):
        raise ValueError(f"{name} must be >= 0, got {_short(list(ids))}")
    return ids


def _logit_bias(name: str, value: Any) -> tuple[tuple[int, float], ...]:
    """{token id (int or its decimal string): bias} -> sorted ((id, bias), ...); a key given
    twice ("7" and "07") keeps the last value, as a dict would."""
    if value is None:
        return ()
    if isinstance(value, tuple) and all(isinstance(x, tuple) and len(x) == 2 for x in value):
        value = dict(value)  # the stored form ((id, bias), ...)
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be an object of token id -> bias, got {_short(value)}")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"{name} may hold at most {MAX_LOGIT_BIAS_ENTRIES} ids, got {len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, bool):
            raise ValueError(f"{name} keys must be token ids, got {_short(key)}")
        if isinstance(key, str):
            text = key.strip()
            if not (text.isascii() and text.isdigit()):
                raise ValueError(f"{name} keys must be token ids >= 0, got {_short(key)}")
            key = int(text)
        if not isinstance(key, int) or key < 0:
            raise ValueError(f"{name} keys must be token ids >= 0, got {_short(key)}")
        bias = _float(f"{name} values", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"{name} values must be in [-100, 100], got {_short(bias)} for token {key}"
            )
        out[key] = bias
    return tuple(sorted(out.items()))


def _grammar(name: str, value: Any) -> str | None:
    if value is None or value == "":
        return None  # SGLang treats an empty grammar as none
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {_short(value)}")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{name} may be at most {MAX_GRAMMAR_CHARS} characters long")
    return value


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class FieldRule:
    """How one field is validated: `parse(name, value)` checks the type and returns the value to
    store (raising ValueError naming the field); `in_range` checks that value; `expected` words
    the range for the message ("in (0, 1]")."""

    parse: Callable[[str, Any], Any]
    in_range: Callable[[Any], bool] | None = None
    expected: str = ""


FIELD_RULES: dict[str, FieldRule] = {
    "max_new_tokens": FieldRule(_int, lambda v: v >= 0, ">= 0"),
    "temperature": FieldRule(_float, lambda v: v >= 0.0, ">= 0"),
    "top_p": FieldRule(_float, lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": FieldRule(_int, lambda v: v == TOP_K_OFF or v >= 1, "-1 (off) or >= 1"),
    "min_p": FieldRule(_float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "stop": FieldRule(_stop_strings),
    "stop_token_ids": FieldRule(_token_ids),
    "ignore_eos": FieldRule(_bool),
    "skip_special_tokens": FieldRule(_bool),
    "no_stop_trim": FieldRule(_bool),
    "n": FieldRule(_int, lambda v: v >= 1, ">= 1"),
    "seed": FieldRule(_optional_int, lambda v: v is None or 0 <= v < MAX_SEED, "in [0, 2**63)"),
    "frequency_penalty": FieldRule(_float, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "presence_penalty": FieldRule(_float, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "repetition_penalty": FieldRule(_float, lambda v: 0.0 < v <= 2.0, "in (0, 2]"),
    "min_new_tokens": FieldRule(_int, lambda v: v >= 0, "in [0, max_new_tokens]"),
    "logit_bias": FieldRule(_logit_bias),
    "json_schema": FieldRule(_grammar),
    "regex": FieldRule(_grammar),
    "ebnf": FieldRule(_grammar),
}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters of one request.

    `stop` accepts a str, a list of str or None and is stored as a tuple; `stop_token_ids`
    likewise. `logit_bias` accepts {token id or its decimal string: bias} and is stored as sorted
    (id, bias) pairs. At most one grammar (`json_schema`, `regex`, `ebnf`) constrains the output
    (`srt/constrained/`); `min_new_tokens` suppresses the stop tokens and EOS until that many
    tokens are out. A temperature below `GREEDY_TEMPERATURE_EPS` is normalised as in SGLang to
    `temperature=1.0, top_k=1`, so greedy is exactly `top_k == 1` (`is_greedy`).
    Raises ValueError whose message starts with the field's name.
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
    min_new_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        # Construction-time normalisation of a frozen record: the only place fields are written.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name, rule in FIELD_RULES.items():
            value = rule.parse(name, getattr(self, name))
            if rule.in_range is not None and not rule.in_range(value):
                raise ValueError(f"{name} must be {rule.expected}, got {_short(value)}")
            put(name, value)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens ({self.max_new_tokens})], "
                f"got {self.min_new_tokens}"
            )
        grammars = [g for g in GRAMMAR_FIELDS if getattr(self, g) is not None]
        if len(grammars) > 1:
            raise ValueError(
                f"{grammars[1]} cannot be combined with {grammars[0]}: only one of "
                "json_schema, regex, ebnf can be set"
            )
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            put("temperature", 1.0)
            put("top_k", 1)

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding (temperature 0 was normalised to top_k 1)."""
        return self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the output grammar: kind is "json_schema", "regex" or "ebnf"."""
        for kind in GRAMMAR_FIELDS:
            source = getattr(self, kind)
            if source is not None:
                return kind, source
        return None

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, biases, min_new_tokens,
        a grammar): such a request needs the host's view of its output every step."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.min_new_tokens > 0
            or self.grammar is not None
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict (SGLang's `sampling_params`). A null value means the
        default. Raises ValueError for unknown keys, wrong types or out-of-range values."""
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k)[:40] for k in d if k not in known)
        if unknown:
            shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            raise ValueError(f"unknown sampling_params key(s): {shown}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict that `from_dict` maps back to an equal record."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = {str(k): v for k, v in self.logit_bias} or None
        return out
