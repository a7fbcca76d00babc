"""Tokenizer loading: the byte tokenizer for the tiny model, HF `tokenizer.json` otherwise.

`get_tokenizer` resolution order (first match wins):

1. the path is a built-in model (`"tiny"`, `"tiny-v41"`)  -> `ByteTokenizer`
2. a directory holding `sgl_dspark_tokenizer.json`       -> the tokenizer it names (`{"type": "byte"}`)
3. a directory holding `tokenizer.json`                  -> `HFTokenizer` (the `tokenizers` library;
   special tokens, `add_bos_token`/`add_eos_token` and the chat template come from
   `tokenizer_config.json`, or `chat_template.jinja` when the config has no template)
4. anything else, when `transformers` is importable      -> `TransformersTokenizer` over
   `AutoTokenizer.from_pretrained` (sentencepiece-only dirs, hub ids already in the HF cache)

A path that none of these can load raises `RuntimeError` suggesting `--skip-tokenizer-init`.
"""

from __future__ import annotations

import json
import logging
import operator
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sgl_dspark.srt.tokenizer.base import TokenizerLike
from sgl_dspark.srt.tokenizer.byte_tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "tiny"
# The built-in models, whose vocabulary is the byte tokenizer's.
BYTE_TOKENIZER_MODELS = (TINY_MODEL_NAME, "tiny-v41")
MARKER_FILE = "sgl_dspark_tokenizer.json"
_SKIP_HINT = "pass --tokenizer-path, or --skip-tokenizer-init to send and receive token ids only"


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a str, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ValueError(f"special token entry must be a str or {{'content': str}}, got {value!r}")


def _select_chat_template(value: Any) -> str | None:
    """`chat_template` is a str, or a list of {"name", "template"} from which we use "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        default = named.get("default")
        if isinstance(default, str):
            return default
    raise ValueError("tokenizer_config.json: chat_template must be a str or a list with 'default'")


def _tojson(
    value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _compile_chat_template(source: str) -> Any:
    """Compile a HF-style chat template in a sandbox; jinja2 is imported only when needed."""
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise RuntimeError("rendering a chat template needs jinja2: pip install jinja2") from exc
    # Same whitespace rules as HF templates are written for.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the HF tokenizer API subset in `TokenizerLike`."""

    def __init__(
        self, tokenizer: Any, config: Mapping[str, Any], chat_template: str | None, name: str
    ) -> None:
        self._tok = tokenizer
        self._name = name
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.chat_template = chat_template
        self._compiled_template: Any = None
        # Whether tokenizer.json's post-processor already adds bos/eos (probe once).
        probe = list(tokenizer.encode("", add_special_tokens=True).ids)
        bos, eos = self.bos_token_id, self.eos_token_id
        add_bos = bool(config.get("add_bos_token", False)) and probe[:1] != [bos]
        add_eos = bool(config.get("add_eos_token", False)) and probe[-1:] != [eos]
        self._bos_to_prepend = bos if add_bos else None
        self._eos_to_append = eos if add_eos else None

    @classmethod
    def from_dir(cls, path: str) -> HFTokenizer:
        """Load `<path>/tokenizer.json` (+ optional `tokenizer_config.json`, `chat_template.jinja`)."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                raise ValueError(f"{config_path} must hold a JSON object")
        template = _select_chat_template(config.get("chat_template"))
        template_path = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                template = f.read()
        return cls(tokenizer, config, template, name=path)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Base vocabulary without added tokens, as HF's `vocab_size`; `len()` counts them."""
        return int(self._tok.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. With `add_special_tokens`, the post-processor in tokenizer.json runs, and
        `add_bos_token`/`add_eos_token` from the config add bos/eos when that post-processor
        does not add them itself."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids: list[int] = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens and self._bos_to_prepend is not None:
            ids.insert(0, self._bos_to_prepend)
        if add_special_tokens and self._eos_to_append is not None:
            ids.append(self._eos_to_append)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text; unknown ids render as nothing, broken UTF-8 as U+FFFD."""
        return str(
            self._tok.decode(
                [operator.index(i) for i in ids], skip_special_tokens=skip_special_tokens
            )
        )

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, Sequence):
            return [self._tok.id_to_token(operator.index(i)) for i in ids]
        return self._tok.id_to_token(operator.index(ids))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render the model's chat template (extra kwargs such as `tools` go to the template).

        NOTE: HF templates usually emit bos themselves, so `tokenize=True` encodes the rendered
        text WITHOUT special tokens; callers that render first must encode the same way.

        Raises:
            ValueError: no chat template, malformed messages, or the template raised.
            RuntimeError: jinja2 is not installed.
        """
        if self.chat_template is None:
            raise ValueError(
                f"the tokenizer at {self._name} has no chat template "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja)"
            )
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError(f"messages must be a list of messages, got {type(messages).__name__}")
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{index}] must be a mapping with a str 'role'")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        rendered = self._compiled_template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            unk_token=self.unk_token or "",
            **template_kwargs,
        )
        return self.encode(rendered, add_special_tokens=False) if tokenize else str(rendered)


class TransformersTokenizer:
    """Adapter over a `transformers` tokenizer so it returns the same types as `HFTokenizer`."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf_tokenizer = tokenizer

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id  # type: ignore[no-any-return]

    @property
    def eos_token_id(self) -> int | None:
        return self.hf_tokenizer.eos_token_id  # type: ignore[no-any-return]

    @property
    def pad_token_id(self) -> int | None:
        return self.hf_tokenizer.pad_token_id  # type: ignore[no-any-return]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_tokenizer.vocab_size)

    def __len__(self) -> int:
        return len(self.hf_tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(
            self.hf_tokenizer.decode(
                [operator.index(i) for i in ids], skip_special_tokens=skip_special_tokens
            )
        )

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        return self.hf_tokenizer.convert_ids_to_tokens(ids)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        out = self.hf_tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            return_dict=False,
            **template_kwargs,
        )
        return list(out) if tokenize else str(out)


def _load_marker(marker_path: str) -> TokenizerLike:
    try:
        with open(marker_path, encoding="utf-8") as f:
            spec = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{marker_path} is not valid JSON: {exc}") from exc
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind != "byte":
        raise ValueError(f"{marker_path}: 'type' must be 'byte', got {kind!r}")
    return ByteTokenizer()


def _load_with_transformers(path: str, trust_remote_code: bool) -> TokenizerLike:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise RuntimeError(
            f"no tokenizer.json found for {path!r} and transformers is not installed; {_SKIP_HINT}"
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise RuntimeError(
            f"could not load a tokenizer from {path!r} ({exc}); {_SKIP_HINT}"
        ) from exc
    logger.info("Loaded tokenizer %s from %s through transformers", type(tokenizer).__name__, path)
    return TransformersTokenizer(tokenizer)


def get_tokenizer(
    model_path_or_dir: str,
    tokenizer_path: str | None = None,
    trust_remote_code: bool = False,
) -> TokenizerLike:
    """Load the tokenizer for a model (resolution order in the module doc).

    Args:
        model_path_or_dir: a built-in model name, a local model directory, or an HF hub id.
        tokenizer_path: overrides `model_path_or_dir` when given.
        trust_remote_code: forwarded to `transformers.AutoTokenizer` only.

    Raises:
        ValueError: a marker file or tokenizer_config.json is malformed.
        RuntimeError: no tokenizer can be loaded from the path (message suggests
            `--skip-tokenizer-init`).
    """
    path = tokenizer_path if tokenizer_path is not None else model_path_or_dir
    if not isinstance(path, str) or not path:
        raise ValueError(f"tokenizer path must be a non-empty str, got {path!r}")
    if path in BYTE_TOKENIZER_MODELS:
        return ByteTokenizer()
    if os.path.isdir(path):
        marker = os.path.join(path, MARKER_FILE)
        if os.path.isfile(marker):
            return _load_marker(marker)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return HFTokenizer.from_dir(path)
    elif os.path.isabs(path) or path.startswith("."):
        raise RuntimeError(f"tokenizer path {path!r} does not exist; {_SKIP_HINT}")
    return _load_with_transformers(path, trust_remote_code)
