"""A byte-level tokenizer for the built-in tiny model: needs no files, covers every string.

Vocabulary (512 ids):

| ids      | meaning                                                              |
|----------|----------------------------------------------------------------------|
| 0        | `<bos>`                                                              |
| 1        | `<eos>`                                                              |
| 2        | `<pad>`                                                              |
| 3        | `<mask>` (DSpark's mask/noise token; `encode` never produces it)     |
| 4, 5, 6  | `<|user|>`, `<|assistant|>`, `<|system|>` (chat role markers)        |
| 7..262   | the bytes 0..255 of the UTF-8 text                                   |
| 263..511 | reserved: `decode` renders them as nothing                           |

Chat template (`apply_chat_template`, also written as Jinja in `TINY_CHAT_TEMPLATE` for the
model's `tokenizer_config.json`): with `tools`, first `<|system|>tools: ` + the tools as JSON +
`"\\n"`; then for each message its role marker + content + `"\\n"` (`developer` messages take
the system marker, `tool` results the user marker, a null content is empty), then
`<|assistant|>` when `add_generation_prompt`. The template holds no `<bos>`; `tokenize=True`
encodes with `add_special_tokens=True`, so the ids start with exactly one `<bos>` either way
(render then `encode`, or `tokenize=True`).

`encode` maps the literal strings of the special tokens other than `<mask>` to their ids (as HF
tokenizers do for added special tokens); `<mask>` in text is encoded as its bytes.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

BOS_ID = 0
EOS_ID = 1
PAD_ID = 2
MASK_ID = 3
USER_ID = 4
ASSISTANT_ID = 5
SYSTEM_ID = 6
BYTE_OFFSET = 7
NUM_BYTES = 256
BYTE_VOCAB_SIZE = 512

SPECIAL_TOKENS: dict[int, str] = {
    BOS_ID: "<bos>",
    EOS_ID: "<eos>",
    PAD_ID: "<pad>",
    MASK_ID: "<mask>",
    USER_ID: "<|user|>",
    ASSISTANT_ID: "<|assistant|>",
    SYSTEM_ID: "<|system|>",
}
CHAT_ROLES: dict[str, int] = {
    "system": SYSTEM_ID,
    "developer": SYSTEM_ID,
    "user": USER_ID,
    "tool": USER_ID,
    "assistant": ASSISTANT_ID,
}
# `apply_chat_template` as a Hugging Face chat template (Jinja): the same text after `<bos>`
# (HF templates emit bos themselves and are encoded without special tokens), so the same ids.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>tools: {{ tools | tojson }}{{ '\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] in ['system', 'developer'] %}{{ '<|system|>' }}"
    "{%- elif message['role'] == 'assistant' %}{{ '<|assistant|>' }}"
    "{%- else %}{{ '<|user|>' }}{% endif %}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- elif message['content'] %}{% for part in message['content'] %}{{ part['text'] }}"
    "{%- endfor %}{% endif %}"
    "{{ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# Special strings `encode` recognises in text; longest first so the alternation never stops early.
_ENCODABLE_SPECIALS = {s: i for i, s in SPECIAL_TOKENS.items() if i != MASK_ID}
_SPECIAL_PATTERN = re.compile(
    "|".join(re.escape(s) for s in sorted(_ENCODABLE_SPECIALS, key=len, reverse=True))
)
_BYTE_TOKEN_PATTERN = re.compile(r"<0x([0-9A-F]{2})>")


def _is_byte_id(token_id: int) -> bool:
    return BYTE_OFFSET <= token_id < BYTE_OFFSET + NUM_BYTES


def _message_text(index: int, message: Any) -> tuple[int, str]:
    """Validate one chat message; return (role token id, text). Raises ValueError naming the field."""
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a mapping, got {type(message).__name__}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(
            f"messages[{index}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}"
        )
    content = message.get("content")
    if content is None:
        return CHAT_ROLES[role], ""
    if isinstance(content, str):
        return CHAT_ROLES[role], content
    # OpenAI-style list of parts: only text parts are meaningful to a text-only model.
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise ValueError(
                    f"messages[{index}].content[{j}] must be {{'type': 'text', 'text': str}}"
                )
            texts.append(part["text"])
        return CHAT_ROLES[role], "".join(texts)
    raise ValueError(
        f"messages[{index}].content must be a str or a list of text parts, "
        f"got {type(content).__name__}"
    )


class ByteTokenizer:
    """UTF-8 byte tokenizer with the HF tokenizer methods the runtime uses (see module doc)."""

    bos_token = SPECIAL_TOKENS[BOS_ID]
    eos_token = SPECIAL_TOKENS[EOS_ID]
    pad_token = SPECIAL_TOKENS[PAD_ID]
    mask_token = SPECIAL_TOKENS[MASK_ID]

    @property
    def bos_token_id(self) -> int:
        return BOS_ID

    @property
    def eos_token_id(self) -> int:
        return EOS_ID

    @property
    def pad_token_id(self) -> int:
        return PAD_ID

    @property
    def mask_token_id(self) -> int:
        return MASK_ID

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(SPECIAL_TOKENS)

    def __len__(self) -> int:
        return BYTE_VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids; prepends `<bos>` when `add_special_tokens`. Never produces `<mask>`."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = [BOS_ID] if add_special_tokens else []
        start = 0
        for match in _SPECIAL_PATTERN.finditer(text):
            ids.extend(b + BYTE_OFFSET for b in text[start : match.start()].encode("utf-8"))
            ids.append(_ENCODABLE_SPECIALS[match.group()])
            start = match.end()
        ids.extend(b + BYTE_OFFSET for b in text[start:].encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text. Invalid UTF-8 becomes U+FFFD (like HF); reserved and out-of-range ids
        render as nothing. Skipped specials do not split a multi-byte character."""
        pieces: list[str] = []
        pending = bytearray()
        for raw in ids:
            token_id = operator.index(raw)
            if _is_byte_id(token_id):
                pending.append(token_id - BYTE_OFFSET)
            elif token_id in SPECIAL_TOKENS and not skip_special_tokens:
                pieces.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                pieces.append(SPECIAL_TOKENS[token_id])
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Token strings: specials by name, printable ASCII bytes as themselves, other bytes as
        `<0xNN>`, reserved and out-of-range ids as `<reserved_N>`."""
        if isinstance(ids, Sequence):
            return [self._id_to_token(operator.index(i)) for i in ids]
        return self._id_to_token(operator.index(ids))

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        """Inverse of `convert_ids_to_tokens` for specials and byte tokens."""
        if isinstance(tokens, str):
            return self._token_to_id(tokens)
        return [self._token_to_id(t) for t in tokens]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the template in the module doc; ids when `tokenize`. Other
        template arguments (`chat_template_kwargs`) have no effect on this template.

        Raises:
            ValueError: a message is not a mapping, has an unknown role, or non-text content.
        """
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError(f"messages must be a list of messages, got {type(messages).__name__}")
        parts = []
        if tools:
            parts.append(
                f"{SPECIAL_TOKENS[SYSTEM_ID]}tools: {json.dumps(list(tools), ensure_ascii=False)}\n"
            )
        for index, message in enumerate(messages):
            role_id, text = _message_text(index, message)
            parts.append(f"{SPECIAL_TOKENS[role_id]}{text}\n")
        if add_generation_prompt:
            parts.append(SPECIAL_TOKENS[ASSISTANT_ID])
        rendered = "".join(parts)
        return self.encode(rendered, add_special_tokens=True) if tokenize else rendered

    @staticmethod
    def _id_to_token(token_id: int) -> str:
        if token_id in SPECIAL_TOKENS:
            return SPECIAL_TOKENS[token_id]
        if _is_byte_id(token_id):
            byte = token_id - BYTE_OFFSET
            return chr(byte) if 0x21 <= byte <= 0x7E else f"<0x{byte:02X}>"
        return f"<reserved_{token_id}>"

    @staticmethod
    def _token_to_id(token: str) -> int:
        for token_id, name in SPECIAL_TOKENS.items():
            if token == name:
                return token_id
        if len(token) == 1 and 0x21 <= ord(token) <= 0x7E:
            return ord(token) + BYTE_OFFSET
        match = _BYTE_TOKEN_PATTERN.fullmatch(token)
        if match is None:
            raise ValueError(f"unknown token {token!r}")
        return int(match.group(1), 16) + BYTE_OFFSET
