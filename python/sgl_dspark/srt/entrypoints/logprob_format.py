"""Logprobs in the shapes clients read: SGLang's `meta_info` keys and OpenAI's completions and
chat `logprobs` objects. The values are computed by the step (`srt/layers/logprobs.py`); this
module only validates the options and lays the values out.

SGLang (`meta_info`, with `return_logprob`; every entry `[logprob, token_id, text]`, text None
unless `return_text_in_logprobs`):

* `input_token_logprobs`: prompt tokens from `logprob_start_len` (-1: none), the first one's
  logprob None; `output_token_logprobs`: every output token;
* with `top_logprobs_num` N > 0: `input_top_logprobs` / `output_top_logprobs`, per position the N
  most probable tokens (None for the first prompt position);
* with `token_ids_logprob`: `input_token_ids_logprobs` / `output_token_ids_logprobs`, per
  position the entries of those ids.

OpenAI completions `logprobs: N` (0..5): `tokens`, `token_logprobs`, `top_logprobs` (per token a
{text: logprob} of the N best; null when N = 0) and `text_offset`; with `echo` the prompt tokens come first, the first with a null logprob.
OpenAI chat `logprobs: true` + `top_logprobs` (0..20): `content` = per token {token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}, ...]}.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_TOKEN_IDS_LOGPROB = 1024


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    """SGLang's logprob request options, validated (ValueError naming the field)."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None

    @classmethod
    def parse(
        cls,
        return_logprob: Any,
        logprob_start_len: Any = -1,
        top_logprobs_num: Any = 0,
        token_ids_logprob: Any = None,
    ) -> LogprobOptions:
        def whole(name: str, value: Any, low: int) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
            return value

        ids = None
        if token_ids_logprob is not None:
            if not isinstance(token_ids_logprob, (list, tuple)):
                raise ValueError("token_ids_logprob must be a list of token ids")
            if len(token_ids_logprob) > MAX_TOKEN_IDS_LOGPROB:
                raise ValueError(
                    f"token_ids_logprob may hold at most {MAX_TOKEN_IDS_LOGPROB} ids, "
                    f"got {len(token_ids_logprob)}"
                )
            ids = tuple(whole("token_ids_logprob", t, 0) for t in token_ids_logprob)
        return cls(
            bool(return_logprob),
            whole("logprob_start_len", -1 if logprob_start_len is None else logprob_start_len, -1),
            whole("top_logprobs_num", top_logprobs_num or 0, 0),
            ids,
        )


def _entry(lp: float | None, token: int, texts: Mapping[int, str] | None) -> list[Any]:
    return [lp, token, texts.get(token) if texts is not None else None]


def _top(
    row: Sequence[tuple[int, float]] | None, texts: Mapping[int, str] | None
) -> list[list[Any]] | None:
    return None if row is None else [_entry(lp, t, texts) for t, lp in row]


def _ids(
    row: Sequence[float] | None, ids: Sequence[int], texts: Mapping[int, str] | None
) -> list[list[Any]] | None:
    return None if row is None else [_entry(lp, t, texts) for t, lp in zip(ids, row)]


def sglang_logprob_meta(
    *,
    output_ids: Sequence[int],
    output_logprobs: Sequence[float],
    output_top: Sequence[Sequence[tuple[int, float]]],
    output_token_ids: Sequence[Sequence[float]],
    input_ids: Sequence[int],
    input_logprobs: Sequence[float | None],
    input_top: Sequence[Sequence[tuple[int, float]] | None],
    input_token_ids: Sequence[Sequence[float] | None],
    top_logprobs_num: int,
    token_ids_logprob: Sequence[int] | None,
    texts: Mapping[int, str] | None,
) -> dict[str, Any]:
    """SGLang's `meta_info` logprob keys (module doc). `input_ids`: the prompt tokens from
    `logprob_start_len`, aligned with `input_logprobs`; `texts`: token id -> text when
    `return_text_in_logprobs`, else None (texts are null)."""
    meta: dict[str, Any] = {
        "input_token_logprobs": [_entry(lp, t, texts) for lp, t in zip(input_logprobs, input_ids)],
        "output_token_logprobs": [
            _entry(lp, t, texts) for lp, t in zip(output_logprobs, output_ids)
        ],
    }
    if top_logprobs_num > 0:
        meta["input_top_logprobs"] = [_top(row, texts) for row in input_top]
        meta["output_top_logprobs"] = [_top(row, texts) for row in output_top]
    if token_ids_logprob is not None:
        meta["input_token_ids_logprobs"] = [
            _ids(row, token_ids_logprob, texts) for row in input_token_ids
        ]
        meta["output_token_ids_logprobs"] = [
            _ids(row, token_ids_logprob, texts) for row in output_token_ids
        ]
    return meta


def completion_logprobs(
    tokens: Sequence[int],
    logprobs: Sequence[float | None],
    tops: Sequence[Sequence[tuple[int, float]] | None],
    texts: Mapping[int, str],
    top_n: int,
    text_start: int,
) -> dict[str, Any]:
    """OpenAI completions `logprobs` for `tokens` (the prompt's, with echo, then the output's):
    `text_offset` counts characters from `text_start`."""
    strings = [texts.get(t, "") for t in tokens]
    offsets = []
    at = text_start
    for s in strings:
        offsets.append(at)
        at += len(s)
    top_logprobs: list[dict[str, float] | None] | None = None
    if top_n > 0:
        top_logprobs = []
        for row in tops:
            if row is None:
                top_logprobs.append(None)
                continue
            best: dict[str, float] = {}
            for t, lp in row[:top_n]:
                best.setdefault(texts.get(t, ""), lp)  # several ids may render alike
            top_logprobs.append(best)
    return {
        "tokens": strings,
        "token_logprobs": list(logprobs),
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(
    tokens: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[Sequence[tuple[int, float]]],
    texts: Mapping[int, str],
    top_n: int,
) -> list[dict[str, Any]]:
    """OpenAI chat `logprobs.content` for `tokens`: per token its text, logprob, UTF-8 bytes and
    its `top_n` most probable alternatives."""

    def item(token: int, lp: float) -> dict[str, Any]:
        text = texts.get(token, "")
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    out = []
    for i, (token, lp) in enumerate(zip(tokens, logprobs)):
        row = tops[i] if i < len(tops) else ()
        entry = item(token, lp)
        entry["top_logprobs"] = [item(t, v) for t, v in row[:top_n]] if top_n > 0 else []
        out.append(entry)
    return out


def req_logprob_meta(req: Any, tokenizer: Any | None) -> dict[str, Any]:
    """`sglang_logprob_meta` of a finished `Req` (the offline Engine); texts decoded with
    `tokenizer` when given (`return_text_in_logprobs`)."""
    start = max(req.logprob_start_len, 0)
    input_ids = req.prompt_ids[start:] if req.input_logprobs else []
    ids = set(req.output_ids) | set(input_ids)
    for rows in (req.output_top_logprobs, req.input_top_logprobs):
        for row in rows:
            ids.update(t for t, _ in row or ())
    ids.update(req.token_ids_logprob or ())
    texts = None
    if tokenizer is not None:
        texts = {t: tokenizer.decode([t], skip_special_tokens=False) for t in ids}
    return sglang_logprob_meta(
        output_ids=req.output_ids,
        output_logprobs=req.output_logprobs,
        output_top=req.output_top_logprobs,
        output_token_ids=req.output_token_ids_logprobs,
        input_ids=input_ids,
        input_logprobs=req.input_logprobs,
        input_top=req.input_top_logprobs,
        input_token_ids=req.input_token_ids_logprobs,
        top_logprobs_num=req.top_logprobs_num,
        token_ids_logprob=req.token_ids_logprob,
        texts=texts,
    )
