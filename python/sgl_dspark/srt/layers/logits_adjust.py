"""What a request changes in the logits before sampling: penalties, logit biases,
`min_new_tokens` and a grammar mask. One record per batch of logits rows; the reference path is
this torch code, shared by plain decoding and every DSpark verify position.

Per row, with `count[t]` the occurrences of token t in the request's output before the row's
position (SGLang's penalizers count output tokens only, never the prompt):

1. additive: `logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)`,
   and `-inf` at the stop token ids and EOS ids while fewer than `min_new_tokens` tokens are out;
2. repetition (multiplicative) on tokens with `count[t] > 0`: a negative logit is multiplied by
   `repetition_penalty`, a positive one divided by it;
3. grammar: `-inf` outside the tokens the request's grammar allows next (where it allows only
   tokens that `min_new_tokens` holds back, the grammar wins: the request ends);
4. `logit_bias[t]` is added (after the mask, so a bias never re-allows a masked token).

This is SGLang's order (its overlap schedule accumulates the additive penalizers before the
scaling one; the grammar mask follows; the logit bias comes last). A DSpark verify window of W
positions per request has one row per position: position j counts the drafted tokens d_1..d_j
as output, checks `min_new_tokens` against the output length plus j, and is masked with the
grammar state after d_1..d_j, so every position sees exactly what plain decoding would see if
the drafts before it were accepted. Counts come from the host's output ids and, inside a
window, from the drafts on the device (no host synchronisation); only a grammar needs the
drafts on the host (its matcher is a CPU automaton).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_dspark.srt.core.host_copy import to_device_packed

if TYPE_CHECKING:
    from sgl_dspark.srt.core.req import Req


@dataclass(frozen=True, slots=True)
class LogitsAdjust:
    """Per-row logits changes of N rows (module doc); None fields change nothing."""

    frequency: torch.Tensor | None  # [N, 1] fp32
    presence: torch.Tensor | None  # [N, 1] fp32
    repetition: torch.Tensor | None  # [N, 1] fp32 > 0
    counts: torch.Tensor | None  # [N, V] fp32, output occurrences before the row
    suppress: torch.Tensor | None  # [N, V] bool, stop tokens held back by min_new_tokens
    allowed: torch.Tensor | None  # [N, V] bool, the grammar's next tokens
    bias: torch.Tensor | None  # [N, V] fp32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The adjusted logits [N, V] fp32 (a new tensor; `logits` is not written).

        Totality: only the grammar mask and `min_new_tokens` write -inf, and a row where they
        leave nothing (the grammar can only end, the request may not end yet) keeps the
        grammar's tokens: the grammar wins, so every row has a token to sample."""
        out = self._apply(logits, self.suppress)
        if self.suppress is not None and self.allowed is not None:
            empty = torch.isneginf(out).all(dim=-1, keepdim=True)
            out = torch.where(empty, self._apply(logits, None), out)
        return out

    def _apply(self, logits: torch.Tensor, suppress: torch.Tensor | None) -> torch.Tensor:
        out = logits.float().clone()
        if self.counts is not None:
            assert self.frequency is not None and self.presence is not None
            seen = self.counts > 0
            out -= self.frequency * self.counts + self.presence * seen.float()
        if suppress is not None:
            out = out.masked_fill(suppress, float("-inf"))
        if self.counts is not None and self.repetition is not None:
            scaled = torch.where(out < 0, out * self.repetition, out / self.repetition)
            out = torch.where(self.counts > 0, scaled, out)
        if self.allowed is not None:
            out = out.masked_fill(~self.allowed, float("-inf"))
        if self.bias is not None:
            out = out + self.bias
        return out


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed token bitmask int32 [N, ceil(V / 32)] (bit t % 32 of word t // 32) -> bool [N, V]."""
    ids = torch.arange(vocab_size, device=bitmask.device)
    words = bitmask.to(torch.int64)[:, ids >> 5]
    return ((words >> (ids & 31)) & 1).bool()


def build_logits_adjust(
    reqs: Sequence[Req],
    vocab_size: int,
    device: torch.device,
    eos_token_ids: Sequence[int],
    width: int = 1,
    drafts: torch.Tensor | None = None,
    drafts_host: Sequence[Sequence[int]] | None = None,
) -> LogitsAdjust | None:
    """The record of `len(reqs) * width` rows, row r * width + j for position j of request r
    (plain decoding: width 1). None when no request adjusts its logits.

    Args:
        reqs: the requests, their output ids as the host knows them (no token in flight).
        eos_token_ids: the model's EOS ids (held back by `min_new_tokens` with the request's
            `stop_token_ids`).
        drafts: [B, >= width - 1] int64 on the device: position j > 0 counts drafts[:, :j].
        drafts_host: the same drafts on the host; needed only when a request has a grammar.
    """
    if not any(r.params.adjusts_logits for r in reqs):
        return None
    B, W, V = len(reqs), width, vocab_size
    params = [r.params for r in reqs]
    frequency = presence = repetition = counts = suppress = allowed = bias = None
    if any(
        p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0
        for p in params
    ):
        penalised = [
            p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0
            for p in params
        ]
        history = [r.output_ids if on else [] for r, on in zip(reqs, penalised)]
        longest = max(1, max(len(h) for h in history))
        (ids_t,) = to_device_packed(
            [[t for h in history for t in (*h, *[0] * (longest - len(h)))]], torch.int64, device
        )
        weights_t, rows_t = to_device_packed(
            [
                [w for h in history for w in [1.0] * len(h) + [0.0] * (longest - len(h))],
                [
                    v
                    for p in params
                    for v in (p.frequency_penalty, p.presence_penalty, p.repetition_penalty)
                ],
            ],
            torch.float32,
            device,
        )
        base = torch.zeros((B, V), dtype=torch.float32, device=device)
        base.scatter_add_(1, ids_t.view(B, longest), weights_t.view(B, longest))
        per_position = base[:, None, :].expand(B, W, V)
        if W > 1:
            assert drafts is not None, "a verify window's penalties count its drafts"
            onehot = torch.zeros((B, W - 1, V), dtype=torch.float32, device=device)
            onehot.scatter_(2, drafts[:, : W - 1, None].clamp(0, V - 1), 1.0)
            drafted = torch.cat([onehot.new_zeros((B, 1, V)), onehot.cumsum(dim=1)], dim=1)
            on = torch.tensor(penalised, device=device).view(B, 1, 1)
            per_position = per_position + torch.where(on, drafted, torch.zeros_like(drafted))
        counts = per_position.reshape(B * W, V)
        rows = rows_t.view(B, 3).repeat_interleave(W, dim=0)
        frequency, presence, repetition = rows[:, 0:1], rows[:, 1:2], rows[:, 2:3]
    if any(p.min_new_tokens > 0 for p in params):
        stop_rows: list[int] = []
        stop_cols: list[int] = []
        for r, (req, p) in enumerate(zip(reqs, params)):
            held = sorted({t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < V})
            for j in range(W):
                if len(req.output_ids) + j < p.min_new_tokens:
                    stop_rows += [r * W + j] * len(held)
                    stop_cols += held
        suppress = torch.zeros((B * W, V), dtype=torch.bool, device=device)
        if stop_rows:
            idx_r, idx_c = to_device_packed([stop_rows, stop_cols], torch.int64, device)
            suppress[idx_r, idx_c] = True
    if any(p.logit_bias for p in params):
        rows_b: list[int] = []
        cols_b: list[int] = []
        vals_b: list[float] = []
        for r, p in enumerate(params):
            for tok, value in p.logit_bias:
                if tok < V:
                    for j in range(W):
                        rows_b.append(r * W + j)
                        cols_b.append(tok)
                        vals_b.append(value)
        bias = torch.zeros((B * W, V), dtype=torch.float32, device=device)
        idx_r, idx_c = to_device_packed([rows_b, cols_b], torch.int64, device)
        (vals_t,) = to_device_packed([vals_b], torch.float32, device)
        bias[idx_r, idx_c] = vals_t
    if any(r.grammar is not None for r in reqs):
        allowed = unpack_bitmask(
            grammar_bitmask(reqs, V, W, drafts_host).to(device, non_blocking=True), V
        )
    return LogitsAdjust(frequency, presence, repetition, counts, suppress, allowed, bias)


def grammar_bitmask(
    reqs: Sequence[Req], vocab_size: int, width: int, drafts_host: Sequence[Sequence[int]] | None
) -> torch.Tensor:
    """Packed allowed-token bitmask int32 [B * width, words] (CPU): per request with a grammar,
    position j holds the tokens allowed after its output and drafts d_1..d_j (the matcher
    advances through them and rolls back); rows without a grammar allow every token. After a
    draft the grammar rejects, later positions repeat the last valid row: acceptance stops at
    that draft anyway (the position before it gives it no mass); likewise after a draft that
    ends the grammar (the request ends with it)."""
    words = (vocab_size + 31) // 32
    mask = torch.full((len(reqs) * width, words), -1, dtype=torch.int32)
    for r, req in enumerate(reqs):
        matcher = req.grammar
        if matcher is None:
            continue
        base = r * width
        matcher.fill_mask(mask, base)
        advanced = 0
        for j in range(1, width):
            assert drafts_host is not None, "a grammar in a verify window needs its drafts"
            if not matcher.accept(drafts_host[r][j - 1]):
                mask[base + j : base + width] = mask[base + j - 1]
                break
            advanced += 1
            if matcher.terminated:
                # The draft ended the grammar (an EOS id): the request ends there if it is
                # accepted, so the positions after it are never used.
                mask[base + j : base + width] = mask[base + j - 1]
                break
            matcher.fill_mask(mask, base + j)
        matcher.rollback(advanced)
    return mask
