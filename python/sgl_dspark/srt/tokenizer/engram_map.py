"""The compressed token map of Engram: token ids whose text is the same after normalisation
share one compressed id, so n-gram hashes ignore case, accents and whitespace variants.

Each id is decoded alone (special tokens kept); a text holding U+FFFD (a partial UTF-8 byte
sequence) is keyed by the raw token string instead; otherwise the key is the text after NFKC,
NFD, accent stripping, lower-casing, collapsing runs of spaces/tabs/newlines to one space,
protecting a lone space, and stripping; an empty key falls back to the decoded text. Compressed
ids are given in first-seen order of the keys.
"""

from __future__ import annotations

import os

import torch

_LONE_SPACE_SENTINEL = "\ue000"  # a private-use character: the key of a whitespace-only token


def _normalizer():  # type: ignore[no-untyped-def]
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _LONE_SPACE_SENTINEL),
            normalizers.Strip(),
        ]
    )


def compressed_token_map(
    tokenizer_file: str, vocab_size: int, compressed_size: int, pad_id: int
) -> torch.Tensor:
    """`[vocab_size]` int64: the compressed id of every token id of the model's vocabulary.

    Ids the tokenizer does not define (a vocabulary padded beyond it) get the compressed id of
    `pad_id`, the filler of missing history. Raises ValueError naming `engram_compressed_vocab_size` when the map's size
    differs from the config's.
    """
    from tokenizers import Tokenizer

    if not os.path.isfile(tokenizer_file):
        raise ValueError(
            f"Engram layers need the model's tokenizer for their compressed token map: no "
            f"{tokenizer_file!r}"
        )
    tok = Tokenizer.from_file(tokenizer_file)
    norm = _normalizer()
    keys: dict[str, int] = {}
    ids = []
    n_defined = tok.get_vocab_size(with_added_tokens=True)
    for i in range(n_defined):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(i) or text
        else:
            key = norm.normalize_str(text) or text
        ids.append(keys.setdefault(key, len(keys)))
    if len(keys) != compressed_size:
        raise ValueError(
            f"config field 'engram_compressed_vocab_size'={compressed_size} does not match the "
            f"tokenizer's compressed token map ({len(keys)} distinct normalised tokens)"
        )
    if vocab_size > n_defined:
        ids.extend([ids[pad_id]] * (vocab_size - n_defined))
    return torch.tensor(ids[:vocab_size], dtype=torch.int64)


__all__ = ["compressed_token_map"]
