"""Incremental (streaming) detokenisation with UTF-8 hold-back and stop strings.

Per request we keep the ids decoded so far and two offsets into them, as SGLang does:
`surr_offset..read_offset` is a few already-committed ids that give the decoder context (some
decoders render a token differently at the start of a string), `read_offset..` the ids whose text
is not committed yet. Each step decodes `ids[surr:read]` and `ids[surr:]`; the difference is the
new text. If it ends in U+FFFD, a multi-byte character is probably still incomplete: the offsets
stay put and only the text before the trailing U+FFFD run is visible.

Stop strings (streaming semantics): text is emitted only up to the point where no stop string can
still begin; a suffix that is a proper prefix of some stop string is held back until the next
ids resolve it. On a match the stream ends at the start of the earliest match (or after it with
`no_stop_trim`). Because nothing that could start a stop string is ever emitted, every match
starts at or after the emitted length, so each step searches only the new tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from sgl_dspark.srt.tokenizer.base import TokenizerLike

REPLACEMENT_CHAR = "\ufffd"
# Prompt ids kept as decoder context for the first output tokens (SGLang uses the same count).
CONTEXT_IDS = 5


def find_stop(text: str, stop_strings: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence at or after `start` of any stop string, as (index, stop string).

    Ties at the same index go to the longest stop string. Returns None when none occurs.
    """
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        index = text.find(stop, start)
        if index < 0:
            continue
        if best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1])):
            best = (index, stop)
    return best


def stop_prefix_len(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class StreamDelta(NamedTuple):
    """New text for one `append`; `stop` is the matched stop string when the stream just ended."""

    text: str
    stop: str | None


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas for one request.

    Args:
        tokenizer: any `TokenizerLike`.
        skip_special_tokens: forwarded to `tokenizer.decode`.
        stop: stop strings (non-empty); the stream ends at the earliest match.
        no_stop_trim: keep the matched stop string in the output.
        prompt_ids: the prompt; its last `CONTEXT_IDS` ids are decoder context, never emitted.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty str, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._no_stop_trim = no_stop_trim
        self._ids: list[int] = list(prompt_ids[max(0, len(prompt_ids) - CONTEXT_IDS) :])
        self._surr_offset = 0
        self._read_offset = len(self._ids)
        self._committed = ""  # text of ids[context:read_offset]
        self._emitted = ""  # what the caller has received; always a prefix of the visible text
        self._matched_stop: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._emitted

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the stream, if any."""
        return self._matched_stop

    @property
    def finished(self) -> bool:
        """True after a stop string matched or `finish()` was called."""
        return self._finished

    def append(self, new_ids: Sequence[int]) -> StreamDelta:
        """Add newly generated ids; return the text that became safe to emit.

        Ids appended after the stream finished are ignored (the scheduler may run one step
        ahead of the stop-string decision).
        """
        if self._finished:
            return StreamDelta("", None)
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        """End of generation: emit everything held back (incomplete UTF-8 as U+FFFD)."""
        if self._finished:
            return StreamDelta("", None)
        delta = self._advance(final=True)
        self._finished = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, final: bool) -> StreamDelta:
        prefix_text = self._decode(self._ids[self._surr_offset : self._read_offset])
        full_text = self._decode(self._ids[self._surr_offset :])
        new_text = full_text[len(prefix_text) :]
        if new_text and not new_text.endswith(REPLACEMENT_CHAR):
            self._committed += new_text
            self._surr_offset = self._read_offset
            self._read_offset = len(self._ids)
            visible = self._committed
        elif final:
            visible = self._committed + new_text
        else:
            visible = self._committed + new_text.rstrip(REPLACEMENT_CHAR)

        limit = len(visible)
        if self._stop:
            hit = find_stop(visible, self._stop, start=len(self._emitted))
            if hit is not None:
                index, stop = hit
                end = index + len(stop) if self._no_stop_trim else index
                self._matched_stop = stop
                self._finished = True
                return self._emit(visible[:end], stop)
            if not final:
                limit -= stop_prefix_len(visible, self._stop)
        return self._emit(visible[:limit], None)

    def _emit(self, visible_prefix: str, stop: str | None) -> StreamDelta:
        # A decoder whose output is not prefix-stable could shrink the text; never un-emit.
        if len(visible_prefix) <= len(self._emitted):
            return StreamDelta("", stop)
        delta = visible_prefix[len(self._emitted) :]
        self._emitted = visible_prefix
        return StreamDelta(delta, stop)
