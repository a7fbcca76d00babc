"""Tokenizers: the byte tokenizer against Python's UTF-8 codec, the HF loader against transformers."""

from __future__ import annotations

import json
import random

import pytest
from sgl_dspark.srt.tokenizer import (
    BYTE_VOCAB_SIZE,
    MARKER_FILE,
    ByteTokenizer,
    HFTokenizer,
    TokenizerLike,
    TransformersTokenizer,
    get_tokenizer,
)

# Code-point pools: ASCII, Latin-1, CJK, emoji, combining marks (no surrogates: not encodable).
_POOLS = [
    (0x20, 0x7E),
    (0x00, 0x1F),
    (0xA0, 0xFF),
    (0x4E00, 0x9FFF),
    (0x1F600, 0x1F64F),
    (0x0300, 0x036F),
    (0x10000, 0x10FFFF),
]


def random_text(rng: random.Random, length: int) -> str:
    chars = []
    for _ in range(length):
        lo, hi = rng.choice(_POOLS)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


# ---------------------------------------------------------------- byte tokenizer


def test_byte_vocab_layout():
    tok = ByteTokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 1, 2, 3)
    assert tok.vocab_size == len(tok) == BYTE_VOCAB_SIZE == 512
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 4, 5, 6]) == [
        "<bos>",
        "<eos>",
        "<pad>",
        "<mask>",
        "<|user|>",
        "<|assistant|>",
        "<|system|>",
    ]
    assert isinstance(tok, TokenizerLike)


@pytest.mark.parametrize("seed", range(20))
def test_byte_encode_matches_utf8_and_round_trips(seed):
    rng = random.Random(seed)
    text = random_text(rng, rng.randint(0, 60))
    tok = ByteTokenizer()
    expected = [b + 7 for b in text.encode("utf-8")]
    assert tok.encode(text, add_special_tokens=False) == expected
    assert tok.encode(text) == [0] + expected
    assert tok.decode(tok.encode(text)) == text


def test_byte_encode_specials_and_never_mask():
    tok = ByteTokenizer()
    ids = tok.encode("<|user|>hi<eos><mask>", add_special_tokens=False)
    assert ids == [4, ord("h") + 7, ord("i") + 7, 1] + [b + 7 for b in b"<mask>"]
    assert 3 not in tok.encode("<mask><mask>")
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>hi<eos><mask>"
    assert tok.decode(ids) == "hi<mask>"


def test_byte_decode_reserved_out_of_range_and_invalid_utf8():
    tok = ByteTokenizer()
    rng = random.Random(0)
    for _ in range(50):
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 12)))
        ids = [b + 7 for b in raw]
        noisy = list(ids)
        for _ in range(3):  # reserved/out-of-range ids anywhere render as nothing
            noisy.insert(rng.randint(0, len(noisy)), rng.choice([263, 300, 511, 512, 10**6, -1]))
        assert tok.decode(noisy) == raw.decode("utf-8", errors="replace")
        assert tok.decode(noisy, skip_special_tokens=False) == raw.decode("utf-8", errors="replace")
    # A skipped special between the bytes of one character does not split it (as in HF).
    raw = "😀".encode()
    emoji = [b + 7 for b in raw]
    assert tok.decode(emoji[:2] + [1] + emoji[2:]) == "😀"
    assert tok.decode(emoji[:2] + [1] + emoji[2:], skip_special_tokens=False) == (
        raw[:2].decode(errors="replace") + "<eos>" + raw[2:].decode(errors="replace")
    )


def test_byte_token_strings_round_trip():
    tok = ByteTokenizer()
    ids = list(range(263))
    tokens = tok.convert_ids_to_tokens(ids)
    assert tok.convert_tokens_to_ids(tokens) == ids
    assert tok.convert_ids_to_tokens(7 + ord("A")) == "A"
    assert tok.convert_ids_to_tokens(7 + 0x20) == "<0x20>"
    assert tok.convert_ids_to_tokens(400) == "<reserved_400>"
    with pytest.raises(ValueError, match="unknown token"):
        tok.convert_tokens_to_ids("<reserved_400>")


def test_byte_chat_template():
    tok = ByteTokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "ok 好"},
    ]
    expected = "<|system|>Be brief.\n<|user|>2+2?\n<|assistant|>4\n<|user|>ok 好\n<|assistant|>"
    assert tok.apply_chat_template(messages) == expected
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected[:-13]
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids == tok.encode(expected)
    assert ids[:2] == [0, 6] and ids.count(0) == 1 and ids[-1] == 5
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert tok.apply_chat_template(parts) == "<|user|>ab\n<|assistant|>"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": 3}],
            r"messages\[1\]\.content",
        ),
        ([{"role": "user", "content": 2.5}], r"messages\[0\]\.content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
            r"messages\[0\]\.content\[0\]",
        ),
        (["hello"], r"messages\[0\] must be a mapping"),
        ("hello", "messages must be a list"),
    ],
)
def test_byte_chat_template_rejects_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        ByteTokenizer().apply_chat_template(messages)


def test_byte_encode_rejects_non_str():
    with pytest.raises(ValueError, match="text"):
        ByteTokenizer().encode(b"bytes")  # type: ignore[arg-type]


# ---------------------------------------------------------------- get_tokenizer


def test_get_tokenizer_tiny_and_marker(tmp_path):
    assert isinstance(get_tokenizer("tiny"), ByteTokenizer)
    (tmp_path / MARKER_FILE).write_text(json.dumps({"type": "byte"}))
    assert isinstance(get_tokenizer(str(tmp_path)), ByteTokenizer)
    assert isinstance(get_tokenizer("/nonexistent/model", tokenizer_path="tiny"), ByteTokenizer)


@pytest.mark.parametrize("content", ['{"type": "sentencepiece"}', "[1]", "{not json"])
def test_get_tokenizer_bad_marker(tmp_path, content):
    (tmp_path / MARKER_FILE).write_text(content)
    with pytest.raises(ValueError, match=MARKER_FILE):
        get_tokenizer(str(tmp_path))


def test_get_tokenizer_missing_suggests_skip(tmp_path):
    with pytest.raises(RuntimeError, match="--skip-tokenizer-init"):
        get_tokenizer(str(tmp_path / "does-not-exist"))
    with pytest.raises(RuntimeError, match="--skip-tokenizer-init"):
        get_tokenizer(str(tmp_path))  # exists but holds no tokenizer


# ---------------------------------------------------------------- HF tokenizer.json

_TEMPLATE = (
    "{% for message in messages %}\n"
    "  {% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "  {% if loop.first %}{{ bos_token }}{% endif %}\n"
    "  <{{ message['role'] }}>{{ message['content'] }}{{ eos_token }}\n"
    "  {% if message['role'] == 'system' %}{% continue %}{% endif %}\n"
    "  [{{ loop.index }}]\n"
    "{% endfor %}\n"
    "{% if tools %}{{ tools | tojson }}{% endif %}\n"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
_CORPUS = ["hello world 😀 你好世界 the quick brown fox", "naïve café — ünïcödé", "1 + 2 = 3"]


def _train_bpe(post_processor: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tok")
    _train_bpe(post_processor=True).save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "pad_token": "<pad>",
        "chat_template": _TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _texts():
    rng = random.Random(1)
    return _CORPUS + ["", "<s>inline special</s>"] + [random_text(rng, 25) for _ in range(10)]


def test_hf_tokenizer_matches_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    ours = get_tokenizer(str(hf_dir))
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert isinstance(ours, HFTokenizer) and isinstance(ours, TokenizerLike)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )
    assert (ours.vocab_size, len(ours)) == (ref.vocab_size, len(ref))
    for text in _texts():
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip
                )
        assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


def test_hf_chat_template_matches_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    ours = get_tokenizer(str(hf_dir))
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "héllo 😀"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "ünï"}}]
    for gen in (True, False):
        for kwargs in ({}, {"tools": tools}):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
            assert text == ref.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False, **kwargs
            )
            ids = ours.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=True, **kwargs
            )
            assert ids == ref.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=True, return_dict=False, **kwargs
            )
    assert text.count("<s>") == 1 and "[2]" in text and "[1]" not in text  # continue + trim
    with pytest.raises(ValueError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        ours.apply_chat_template([{"content": "x"}])


def test_hf_add_bos_token_and_template_file(tmp_path):
    raw = _train_bpe(post_processor=False)
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    tok = get_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    bos = raw.token_to_id("<s>")
    for text in _texts():
        plain = raw.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special_tokens=False) == plain
        assert tok.encode(text) == [bos] + plain
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }};{% endfor %}"
    )
    tok = get_tokenizer(str(tmp_path))
    assert (
        tok.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        )
        == "a;b;"
    )


def test_hf_add_bos_token_with_post_processor_adds_one_bos(tmp_path):
    raw = _train_bpe(post_processor=True)
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "add_bos_token": True})
    )
    tok = get_tokenizer(str(tmp_path))
    for text in _texts():
        assert tok.encode(text) == raw.encode(text).ids
        assert tok.encode(text)[:1] == [raw.token_to_id("<s>")]


def test_transformers_fallback_for_dirs_without_tokenizer_json(tmp_path):
    pytest.importorskip("transformers")
    raw = _train_bpe(post_processor=False)
    raw.model.save(str(tmp_path))  # vocab.json + merges.txt: a slow GPT-2 tokenizer
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
            }
        )
    )
    tok = get_tokenizer(str(tmp_path))
    assert isinstance(tok, TransformersTokenizer) and isinstance(tok, TokenizerLike)
    assert tok.eos_token_id == raw.token_to_id("</s>")
    for text in _texts():
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == raw.decode(ids)
    messages = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(messages) == "<user>hello"
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert isinstance(ids, list) and ids == raw.encode("<user>hello").ids
