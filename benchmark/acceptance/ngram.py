"""The n-gram lookup control: how long an acceptance prompt-lookup decoding would get, computed
exactly from a greedy output.

Prompt-lookup decoding drafts without a model: at each verify step it takes the last n tokens of
the context (prompt + output so far), finds their most recent earlier occurrence in the context,
and proposes the tokens that followed that occurrence (n from `max_ngram` down to `min_ngram`; the
first n that recurs wins; nothing is proposed when none recurs). Under greedy verification the
target accepts the longest prefix of the proposal that equals its own greedy continuation and adds
one bonus token, so a step commits accepted + 1 tokens. Because the target's greedy continuation is
exactly its greedy output, replaying the output gives the acceptance exactly, with no engine.

As in the engine, the output's first token comes from the prefill, not from a verify step, and a
step never commits past the end of the output (the output ends where the request ended: EOS, a
stop string or the token limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LookupAcceptance:
    """Verify steps and the tokens they committed (accepted drafts + bonus tokens)."""

    committed: int
    steps: int

    @property
    def accept_length(self) -> float | None:
        return self.committed / self.steps if self.steps else None


class NgramIndex:
    """The most recent start of every n-gram (n in [min_ngram, max_ngram]) of a growing context,
    counting only occurrences that end before the context's last token, so the context's own
    suffix never matches itself."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context: list[int] = []
        self._last_start: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        old = len(self.context)
        self.context.extend(tokens)
        # n-grams that end (exclusive) at positions old .. len - 1 become matchable; the one
        # ending at len (the suffix) waits for the next extend.
        for end in range(max(old, 1), len(self.context)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n >= 0:
                    self._last_start[tuple(self.context[end - n : end])] = end - n

    def propose(self, num_draft_tokens: int) -> list[int]:
        """Up to `num_draft_tokens` tokens that followed the most recent earlier occurrence of
        the longest recurring suffix n-gram; empty when none recurs."""
        ctx = self.context
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ctx) <= n:
                continue
            start = self._last_start.get(tuple(ctx[len(ctx) - n :]))
            if start is not None:
                return ctx[start + n : start + n + num_draft_tokens]
        return []


def propose_prompt_lookup(
    context: Sequence[int], num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 1
) -> list[int]:
    """One prompt-lookup proposal for `context` (see the module docstring)."""
    index = NgramIndex(max_ngram, min_ngram)
    index.extend(context)
    return index.propose(num_draft_tokens)


def prompt_lookup_acceptance(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    num_draft_tokens: int,
    max_ngram: int = 3,
    min_ngram: int = 1,
) -> LookupAcceptance:
    """Verify steps and committed tokens of prompt-lookup decoding that reproduces `output_ids`
    (the target's greedy output for `prompt_ids`) proposing up to `num_draft_tokens` per step."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if not output_ids:
        return LookupAcceptance(0, 0)
    index = NgramIndex(max_ngram, min_ngram)
    index.extend([*prompt_ids, output_ids[0]])  # the first token comes from the prefill
    pos, committed, steps = 1, 0, 0
    while pos < len(output_ids):
        draft = index.propose(num_draft_tokens)
        room = len(output_ids) - pos - 1  # drafts that can be accepted before the bonus token
        accepted = 0
        while accepted < min(len(draft), room) and draft[accepted] == output_ids[pos + accepted]:
            accepted += 1
        step = accepted + 1
        index.extend(output_ids[pos : pos + step])
        pos += step
        committed += step
        steps += 1
    return LookupAcceptance(committed, steps)
