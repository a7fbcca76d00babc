"""The target's training text as token batches: every record `[bos] + text + [eos]` starting at
position 0 (as a served prompt does), records of similar length batched together under a token
budget, padded at the end, and a fixed held-out share for the validation loss."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
from dataclasses import dataclass

import torch

PAD_MULTIPLE = 16  # padded lengths are multiples of this (few distinct shapes)


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, S] int64, padded with pad_id
    lengths: torch.Tensor  # [B] int64

    def to(self, device: str | torch.device) -> TokenBatch:
        return TokenBatch(self.input_ids.to(device), self.lengths.to(device))

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def _held_out(text: str, share: float) -> bool:
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < share


def load_records(
    corpus_dir: str,
    tokenizer_file: str,
    bos_id: int,
    eos_id: int,
    max_len: int,
    held_out_share: float,
) -> tuple[list[list[int]], list[list[int]], int]:
    """(train sequences, held-out sequences, records dropped as longer than max_len) of
    `corpus_dir/corpus.jsonl` (or `corpus.jsonl.gz`)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_file)
    texts = []
    path = os.path.join(corpus_dir, "corpus.jsonl")
    opened = open(path) if os.path.isfile(path) else gzip.open(path + ".gz", "rt")
    with opened as f:
        for line in f:
            if line.strip():
                texts.append(json.loads(line)["text"])
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    train, held, dropped = [], [], 0
    for text, enc in zip(texts, encoded):
        ids = [bos_id, *enc.ids, eos_id]
        if len(ids) > max_len:
            dropped += 1
            continue
        (held if _held_out(text, held_out_share) else train).append(ids)
    return train, held, dropped


def make_batches(
    seqs: list[list[int]], tokens_per_batch: int, pad_id: int, seed: int
) -> list[TokenBatch]:
    """Length-bucketed batches of at most `tokens_per_batch` padded tokens, in seeded random
    order (one epoch)."""
    rng = random.Random(seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    # Sort within large windows: similar lengths batch together, the epoch stays shuffled.
    window = 64 * max(1, tokens_per_batch // 128)
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: len(seqs[i]))
        current: list[int] = []
        longest = 0
        for i in chunk:
            padded = -(-max(longest, len(seqs[i])) // PAD_MULTIPLE) * PAD_MULTIPLE
            if current and padded * (len(current) + 1) > tokens_per_batch:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, len(seqs[i]))
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return [_pad([seqs[i] for i in b], pad_id) for b in batches]


def _pad(rows: list[list[int]], pad_id: int) -> TokenBatch:
    S = -(-max(len(r) for r in rows) // PAD_MULTIPLE) * PAD_MULTIPLE
    ids = torch.full((len(rows), S), pad_id, dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    return TokenBatch(ids, torch.tensor([len(r) for r in rows]))


__all__ = ["TokenBatch", "load_records", "make_batches"]
