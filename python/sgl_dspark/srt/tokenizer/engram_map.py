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
from collections.abc import Callable

import torch

from sgl_dspark.srt.tokenizer.byte_tokenizer import ByteTokenizer

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
    """`[vocab_size]` int64: the compressed id of every token id of the model's vocabulary, from
    the HF `tokenizer.json` at `tokenizer_file` (`compressed_token_map_of`)."""
    from tokenizers import Tokenizer

    if not os.path.isfile(tokenizer_file):
        raise ValueError(
            f"Engram layers need the model's tokenizer for their compressed token map: no "
            f"{tokenizer_file!r}"
        )
    tok = Tokenizer.from_file(tokenizer_file)
    return compressed_token_map_of(
        lambda i: tok.decode([i], skip_special_tokens=False),
        tok.id_to_token,
        tok.get_vocab_size(with_added_tokens=True),
        vocab_size,
        compressed_size,
        pad_id,
    )


def tokenizer_compressed_size(tokenizer_file: str) -> int:
    """The size of the compressed token map of the HF `tokenizer.json` at `tokenizer_file`: the
    `engram_compressed_vocab_size` a config for that tokenizer states."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_file)
    key = _key_fn(lambda i: tok.decode([i], skip_special_tokens=False), tok.id_to_token)
    return len({key(i) for i in range(tok.get_vocab_size(with_added_tokens=True))})


def byte_tokenizer_token_map(vocab_size: int, compressed_size: int, pad_id: int) -> torch.Tensor:
    """`compressed_token_map_of` the byte tokenizer of the built-in models (every id it defines,
    reserved ids included)."""
    return compressed_token_map_of(*_byte_tokenizer(), vocab_size, compressed_size, pad_id)


def byte_tokenizer_compressed_size() -> int:
    """The size of the byte tokenizer's compressed token map."""
    decode_one, token_of, n_defined = _byte_tokenizer()
    key = _key_fn(decode_one, token_of)
    return len({key(i) for i in range(n_defined)})


def _byte_tokenizer() -> tuple[Callable[[int], str], Callable[[int], str | None], int]:
    tok = ByteTokenizer()

    def token_of(i: int) -> str:
        token = tok.convert_ids_to_tokens(i)
        assert isinstance(token, str)
        return token

    return (lambda i: tok.decode([i], skip_special_tokens=False)), token_of, tok.vocab_size


def compressed_token_map_of(
    decode_one: Callable[[int], str],
    token_of: Callable[[int], str | None],
    n_defined: int,
    vocab_size: int,
    compressed_size: int,
    pad_id: int,
) -> torch.Tensor:
    """`[vocab_size]` int64: the compressed id of every token id (module doc), for a tokenizer
    given as `decode_one(id)` (special tokens kept), `token_of(id)` (its token string) and its
    number of ids `n_defined`.

    Ids the tokenizer does not define (a vocabulary padded beyond it) get the compressed id of
    `pad_id`, the filler of missing history. Raises ValueError naming
    `engram_compressed_vocab_size` when the map's size differs from the config's.
    """
    key = _key_fn(decode_one, token_of)
    keys: dict[str, int] = {}
    ids = [keys.setdefault(key(i), len(keys)) for i in range(n_defined)]
    if len(keys) != compressed_size:
        raise ValueError(
            f"config field 'engram_compressed_vocab_size'={compressed_size} does not match the "
            f"tokenizer's compressed token map ({len(keys)} distinct normalised tokens)"
        )
    if vocab_size > n_defined:
        ids.extend([ids[pad_id]] * (vocab_size - n_defined))
    return torch.tensor(ids[:vocab_size], dtype=torch.int64)


def _key_fn(
    decode_one: Callable[[int], str], token_of: Callable[[int], str | None]
) -> Callable[[int], str]:
    norm = _normalizer()

    def key(i: int) -> str:
        text = decode_one(i)
        if "\ufffd" in text:
            return token_of(i) or text
        return norm.normalize_str(text) or text

    return key


__all__ = [
    "byte_tokenizer_compressed_size",
    "byte_tokenizer_token_map",
    "compressed_token_map",
    "compressed_token_map_of",
    "tokenizer_compressed_size",
]
