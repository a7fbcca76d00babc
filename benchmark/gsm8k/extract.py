"""Numeric answer extraction for GSM8K outputs.

Priority, applied to the model output only (never to the prompt):
1. the number after the last "####";
2. the number inside the last \\boxed{...};
3. the first number after the last "answer is" / "answer:" (any case);
4. otherwise the last number in the text (SGLang's rule).
Numbers may carry thousands separators (1,234), a currency sign ($5, -$5, $-5), a sign (ASCII or
U+2212 minus), decimals (2.50) and trailing punctuation ("18."); they are returned in canonical
form: no separators, no trailing zeros, no "-0" (see `canonical_number`).
A minus counts as a sign only when it is not preceded by a word character or ")", so "10-4" is
10 and 4, not 10 and -4. Fractions like 3/4 are read as two numbers.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_NUMBER = re.compile(
    r"(?P<sign1>(?<![\w)])[-\u2212])?"  # sign before a currency symbol: -$5
    r"(?<![\w.])\$?\s?"
    r"(?P<sign2>[-\u2212])?"  # sign after it: $-5
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
    r"(?P<frac>\.\d+)?"
)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def canonical_number(text: str) -> str:
    """ "$1,234.50" -> "1234.5", "-0.0" -> "0", "007" -> "7". Raises ValueError if not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace("\u2212", "-").replace(" ", "")
    cleaned = cleaned.rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation as exc:
        raise ValueError(f"not a number: {text!r}") from exc
    if not value.is_finite():
        raise ValueError(f"not a finite number: {text!r}")
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def _numbers(text: str) -> list[str]:
    out = []
    for m in _NUMBER.finditer(text):
        negative = bool(m.group("sign1")) != bool(m.group("sign2"))  # "-$-5" reads as 5
        digits = m.group("int").replace(",", "") + (m.group("frac") or "")
        out.append(canonical_number(("-" if negative else "") + digits))
    return out


def extract_answer(output: str) -> str | None:
    """The model's final numeric answer in canonical form, or None when the output has no number."""
    if "####" in output:
        found = _numbers(output.rsplit("####", 1)[1])
        if found:
            return found[0]
    boxed = _BOXED.findall(output)
    if boxed:
        found = _numbers(boxed[-1])
        if found:
            return found[0]
    marks = list(_ANSWER_IS.finditer(output))
    if marks:
        found = _numbers(output[marks[-1].end() :])
        if found:
            return found[0]
    found = _numbers(output)
    return found[-1] if found else None


def parse_ground_truth(answer_field: str) -> str:
    """Canonical number after "####" in a GSM8K "answer" field. Raises ValueError if absent."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer has no '####' marker: {answer_field[-80:]!r}")
    return canonical_number(answer_field.rsplit("####", 1)[1])


def is_correct(predicted: str | None, truth: str) -> bool:
    """Numeric equality of two canonical answers (so "18" == "18.0"); None is never correct."""
    if predicted is None:
        return False
    return Decimal(predicted) == Decimal(truth)
