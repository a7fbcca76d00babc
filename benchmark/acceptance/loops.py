"""Repetition loops: outputs that end stuck repeating a short unit of tokens.

A small model that has lost the thread often repeats a phrase until the token limit; a draft
predicts such a loop easily, so loops inflate the acceptance length. The measurement reports the
loop rate and the acceptance with looping outputs left out.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_WINDOW = 64
DEFAULT_MAX_PERIOD = 16


def loop_definition(window: int = DEFAULT_WINDOW, max_period: int = DEFAULT_MAX_PERIOD) -> str:
    return (
        f"an output is a repetition loop when its last {window} tokens are periodic with a "
        f"period p <= {max_period} (token i equals token i + p throughout those {window} tokens, "
        f"so a unit of at most {max_period} tokens repeats at least {window // max_period} times "
        f"in a row at the end); outputs shorter than {window} tokens are never loops"
    )


def repetition_period(
    ids: Sequence[int], window: int = DEFAULT_WINDOW, max_period: int = DEFAULT_MAX_PERIOD
) -> int | None:
    """The smallest period p <= `max_period` of the last `window` tokens of `ids`, or None when
    they have none (or `ids` is shorter than `window`)."""
    if not 1 <= max_period < window:
        raise ValueError(f"need 1 <= max_period < window, got {max_period}, {window}")
    if len(ids) < window:
        return None
    tail = list(ids[-window:])
    for p in range(1, max_period + 1):
        if tail[p:] == tail[:-p]:
            return p
    return None
