"""Grammar-constrained decoding through xgrammar.

`GrammarBackend` (one per server, built on the scheduler thread from the tokenizer) compiles a
request's grammar against the vocabulary: `json_schema` (a JSON Schema document), `regex`, `ebnf`
(xgrammar's EBNF dialect, GBNF-like, rule `root`); OpenAI's `response_format` maps onto
`json_schema` as in SGLang (`json_object` is the schema `{"type": "object"}`). A grammar that
does not compile is a `GrammarError` (a ValueError) whose message starts with the field's name
(a 400 naming it on the HTTP routes). Compiled
grammars are cached by source.

`GrammarMatcher` (one per request, host-only) holds the grammar state after the request's
output so far: `fill_mask` writes the allowed next tokens into one row of a packed bitmask (one
bit per token id, 32 per int32 word, as xgrammar lays it out); `accept` advances by one token;
`rollback` undoes the last accepted tokens. A DSpark verify window masks each of its positions
with the state after the drafted tokens before it and rolls back afterwards (the scheduler then
advances by the committed tokens only), so constrained output is the same with and without
speculation.

The vocabulary: a byte-level tokenizer (`ByteTokenizer`) maps each byte id to its raw byte and
every other id to the empty string (xgrammar's special tokens: never allowed inside the
grammar); a Hugging Face `tokenizers` vocabulary is passed with its decoder's encoding
(byte-level BPE, byte fallback or raw). Ids past the tokenizer's vocabulary (padding of the
model's vocabulary) are never allowed. The end of the grammar is marked by the EOS ids.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_CACHE_LIMIT = 256


class GrammarError(ValueError):
    """A grammar that cannot be used; `param` is the request field that carried it."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"{param} {problem}")
        self.param = param


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - the dependency is declared
        raise ValueError(
            "constrained decoding (json_schema, regex, ebnf, response_format) needs the "
            "xgrammar package, which is not installed"
        ) from exc
    return xgrammar


def _encoded_vocab(tokenizer: Any, vocab_size: int) -> tuple[list[str | bytes], str]:
    """The vocabulary as xgrammar reads it, and its encoding ("raw", "byte_level",
    "byte_fallback")."""
    from sgl_dspark.srt.tokenizer.byte_tokenizer import BYTE_OFFSET, NUM_BYTES, ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        vocab: list[str | bytes] = [""] * vocab_size
        for b in range(min(NUM_BYTES, vocab_size - BYTE_OFFSET)):
            vocab[BYTE_OFFSET + b] = bytes([b])
        return vocab, "raw"
    backend = getattr(tokenizer, "_tok", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        raise ValueError(
            "constrained decoding needs a tokenizer whose vocabulary can be read "
            f"(got {type(tokenizer).__name__})"
        )
    by_id: list[str | bytes] = [""] * vocab_size
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if 0 <= idx < vocab_size:
            by_id[idx] = token
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = json.dumps(decoder)
    if '"ByteLevel"' in kinds:
        return by_id, "byte_level"
    if '"ByteFallback"' in kinds:
        return by_id, "byte_fallback"
    return by_id, "raw"


class GrammarMatcher:
    """The grammar state of one request (module doc). Host-only; not thread-safe."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 [N, words], CPU)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(int(token)))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its end (an EOS id) was accepted."""
        return bool(self._matcher.is_terminated())


class GrammarBackend:
    """Compiles grammars against one tokenizer's vocabulary (module doc)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        xgr = _import_xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        vocab, kind = _encoded_vocab(tokenizer, vocab_size)
        vocab_type = {
            "raw": xgr.VocabType.RAW,
            "byte_level": xgr.VocabType.BYTE_LEVEL,
            "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
        }[kind]
        self._eos = sorted({int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size})
        info = xgr.TokenizerInfo(
            vocab, vocab_type=vocab_type, vocab_size=vocab_size, stop_token_ids=self._eos or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: dict[tuple[str, str], Any] = {}

    def compile(self, kind: str, source: str) -> Any:
        """The compiled grammar of `source` (kind "json_schema", "regex" or "ebnf"). Raises
        `GrammarError` naming the field."""
        key = (kind, source)
        compiled = self._cache.get(key)
        if compiled is not None:
            return compiled
        compiler = self._compiler
        try:
            if kind == "json_schema":
                compiled = compiler.compile_json_schema(source)
            elif kind == "regex":
                compiled = compiler.compile_regex(source)
            elif kind == "ebnf":
                compiled = compiler.compile_grammar(source)
            else:
                raise ValueError(f"unknown grammar kind {kind!r}")
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(kind, f"invalid grammar: {_first_line(exc)}") from None
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = compiled
        return compiled

    def matcher(self, kind: str, source: str) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (raises as `compile`)."""
        compiled = self.compile(kind, source)
        matcher = self._xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        return GrammarMatcher(matcher)


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its source location prefix ("[hh:mm:ss] file.cc:NN: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(": ", 1)[0]:
            text = text.split(": ", 1)[-1]
    return text[:300]


class Grammars:
    """The server's grammar backend, built on first use (xgrammar loads only when a request
    has a grammar). Lives on the thread that owns the tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self._backend: GrammarBackend | None = None

    def matcher_for(self, grammar: tuple[str, str] | None) -> GrammarMatcher | None:
        """A matcher for a request's (kind, source) grammar, None without one. Raises
        ValueError starting with the field's name (no tokenizer, a grammar that does not
        compile): a `GrammarError`."""
        if grammar is None:
            return None
        kind, source = grammar
        if self._tokenizer is None:
            raise GrammarError(
                kind,
                "constrained decoding needs a tokenizer; this server runs with "
                "--skip-tokenizer-init",
            )
        if self._backend is None:
            self._backend = GrammarBackend(self._tokenizer, self._vocab_size, self._eos)
        return self._backend.matcher(kind, source)
