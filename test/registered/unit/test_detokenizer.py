"""Incremental detokenisation: UTF-8 hold-back, decoder context, and streaming stop strings.

References are independent: Python's UTF-8 codec on the byte prefix seen so far, the full-text
decode of the tokenizer, and a brute-force statement of the stop-string streaming rule.
"""

from __future__ import annotations

import random

import pytest
from sgl_dspark.srt.tokenizer import (
    ByteTokenizer,
    IncrementalDetokenizer,
    find_stop,
    stop_prefix_len,
)

_POOLS = [(0x20, 0x7E), (0xA0, 0xFF), (0x4E00, 0x9FFF), (0x1F600, 0x1F64F), (0x10000, 0x10FFFF)]


def random_text(rng: random.Random, length: int) -> str:
    return "".join(chr(rng.randint(*rng.choice(_POOLS))) for _ in range(length))


def random_chunks(rng: random.Random, ids: list[int], max_chunk: int = 4) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def byte_ids(data: bytes) -> list[int]:
    return [b + 7 for b in data]


@pytest.mark.parametrize("seed", range(25))
def test_multibyte_utf8_split_across_tokens(seed):
    rng = random.Random(seed)
    text = random_text(rng, rng.randint(1, 40))
    data = text.encode("utf-8")
    detok = IncrementalDetokenizer(ByteTokenizer())
    seen = 0
    for chunk in random_chunks(rng, byte_ids(data)):
        delta = detok.append(chunk)
        seen += len(chunk)
        assert "\ufffd" not in delta.text and delta.stop is None
        # Exactly the complete characters among the bytes seen so far, never more, never less.
        assert detok.text == data[:seen].decode("utf-8", errors="ignore")
    assert detok.finish().text == ""
    assert detok.text == text and detok.finished


@pytest.mark.parametrize("seed", range(10))
def test_skipped_specials_interleaved(seed):
    rng = random.Random(100 + seed)
    text = random_text(rng, 20)
    ids = byte_ids(text.encode("utf-8"))
    noisy = list(ids)
    for _ in range(5):  # eos/pad/role ids and reserved ids render as nothing
        noisy.insert(rng.randint(0, len(noisy)), rng.choice([1, 2, 4, 5, 300]))
    detok = IncrementalDetokenizer(ByteTokenizer())
    for chunk in random_chunks(rng, noisy):
        assert "\ufffd" not in detok.append(chunk).text
    detok.finish()
    assert detok.text == text


def test_finish_flushes_incomplete_and_invalid_bytes_stream():
    tok = ByteTokenizer()
    emoji = "😀".encode()
    detok = IncrementalDetokenizer(tok)
    assert detok.append(byte_ids(b"ok" + emoji[:2])).text == "ok"
    assert detok.finish().text == emoji[:2].decode("utf-8", errors="replace")
    assert detok.append(byte_ids(b"more")).text == ""  # ignored after finish

    detok = IncrementalDetokenizer(tok)
    assert detok.append(byte_ids(b"\xff")).text == ""  # could still be an incomplete char
    assert detok.append(byte_ids(b"a")).text == b"\xffa".decode("utf-8", errors="replace")


def test_prompt_context_changes_first_token_rendering():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "▁hi": 1, "▁hello": 2, "▁world": 3, "!": 4}
    tok_raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok_raw.decoder = tokenizers.decoders.Metaspace()

    class Wrapped:
        def decode(self, ids, skip_special_tokens=True):
            return tok_raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    prompt, output = [1, 4], [2, 3, 4]
    detok = IncrementalDetokenizer(Wrapped(), prompt_ids=prompt)  # type: ignore[arg-type]
    for token in output:
        detok.append([token])
    detok.finish()
    full = tok_raw.decode(prompt + output)
    assert detok.text == full[len(tok_raw.decode(prompt)) :] == " hello world!"
    assert tok_raw.decode(output) != detok.text  # without context the leading space is lost


def test_hf_byte_level_bpe_stream():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(["héllo wörld 你好 😀 🎉 done"] * 10, trainer)

    class Wrapped:
        def decode(self, ids, skip_special_tokens=True):
            return raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    rng = random.Random(7)
    for _ in range(10):
        text = random_text(rng, 30) + " 你好 😀"
        ids = raw.encode(text).ids
        final = raw.decode(ids)
        detok = IncrementalDetokenizer(Wrapped())  # type: ignore[arg-type]
        for chunk in random_chunks(rng, ids, max_chunk=2):
            delta = detok.append(chunk)
            assert "\ufffd" not in delta.text
            assert final.startswith(detok.text)
        detok.finish()
        assert detok.text == final == text


def test_find_stop_and_prefix_len_hand_cases():
    assert find_stop("hello world", ["o w", "wor"]) == (4, "o w")
    assert find_stop("abcabc", ["bc", "c"]) == (1, "bc")
    assert find_stop("xab", ["a", "ab"]) == (1, "ab")  # same start: longest wins
    assert find_stop("abcabc", ["ab"], start=1) == (3, "ab")
    assert find_stop("abc", ["z"]) is None and find_stop("abc", []) is None
    assert stop_prefix_len("hello wo", ["world", "xyz"]) == 2
    assert stop_prefix_len("aab", ["abc", "aabd"]) == 3
    assert stop_prefix_len("abc", ["abc"]) == 0  # a full match is not a proper prefix
    assert stop_prefix_len("", ["abc"]) == 0


def test_stop_hold_back_hand_case():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["ab"])
    assert [detok.append(byte_ids(c)).text for c in (b"x", b"a", b"c")] == ["x", "", "ac"]
    detok = IncrementalDetokenizer(tok, stop=["ab"])
    deltas = [detok.append(byte_ids(c)) for c in (b"x", b"a", b"b", b"y")]
    assert [d.text for d in deltas] == ["x", "", "", ""]
    assert deltas[2].stop == "ab" and detok.matched_stop == "ab" and detok.finished
    detok = IncrementalDetokenizer(tok, stop=["ab"], no_stop_trim=True)
    assert "".join(detok.append(byte_ids(c)).text for c in (b"x", b"a", b"b")) == "xab"
    detok = IncrementalDetokenizer(tok, stop=["ab"])
    detok.append(byte_ids(b"xa"))
    assert detok.finish().text == "a"  # an unresolved prefix at the end is plain text


def _expected_visible(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Brute force streaming rule on the complete text seen so far."""
    hits = [(text.find(s), -len(s), s) for s in stops if s in text]
    if hits:
        index, _, stop = min(hits)
        return text[:index], stop
    hold = max((j for s in stops for j in range(1, len(s)) if text.endswith(s[:j])), default=0)
    return text[: len(text) - hold], None


@pytest.mark.parametrize("seed", range(40))
def test_streaming_stop_strings_property(seed):
    rng = random.Random(1000 + seed)
    alphabet = ["a", "b", "c", "😀", "好"]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
    stops = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        for _ in range(rng.randint(1, 3))
    ]
    no_stop_trim = rng.random() < 0.3
    data = text.encode("utf-8")
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=stops, no_stop_trim=no_stop_trim)
    seen, matched = 0, None
    for chunk in random_chunks(rng, byte_ids(data)):
        delta = detok.append(chunk)
        seen += len(chunk)
        if matched is not None:
            assert delta.text == "" and delta.stop is None
            continue
        visible, stop = _expected_visible(data[:seen].decode("utf-8", errors="ignore"), stops)
        if stop is not None:
            matched = stop
            assert delta.stop == stop
            visible += stop if no_stop_trim else ""
        assert detok.text == visible
    final = detok.finish()
    if matched is None:
        assert detok.text == text and final.stop is None and detok.matched_stop is None
    else:
        assert detok.matched_stop == matched and final.text == ""


def test_rejects_empty_stop_string():
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(ByteTokenizer(), stop=["ok", ""])
