"""`POST /v1/completions` and `POST /v1/chat/completions` (OpenAI wire format).

Choices: one sub-request per (prompt, n); choice index = prompt_index * n + j. With `seed`,
choice j samples with `seed + j`, so the choices differ yet each is reproducible. Logprobs (of
the distribution each token was sampled from, as SGLang reports them: `srt/layers/logprobs.py`)
with top alternatives: completions `logprobs: N` (with `echo`, the prompt's tokens first, the
first one null), chat `logprobs` + `top_logprobs` (`logprob_format.py`). Penalties,
`logit_bias`, `min_tokens`, `regex` / `ebnf` / `json_schema` and `response_format` reach the
sampler and the grammar engine. `usage.prompt_tokens` counts each
prompt once (not once per choice), `completion_tokens` every generated token of every choice.
Chat without `max_tokens` may generate up to the context length.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sgl_dspark.srt.entrypoints.api_errors import ApiError
from sgl_dspark.srt.entrypoints.chat_parsers import (
    DEFAULT_TOOL_PARSER,
    ReasoningParser,
    ToolCallParser,
    thinking_requested,
)
from sgl_dspark.srt.entrypoints.logprob_format import chat_logprobs, completion_logprobs
from sgl_dspark.srt.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from sgl_dspark.srt.entrypoints.request_group import (
    GroupStreamingResponse,
    RequestGroup,
    ServingContext,
    SubResult,
    check_model_name,
    make_sampling_params,
    parse_body,
    require_tokenizer,
    sse,
    stream_events,
)
from sgl_dspark.srt.entrypoints.sglang_fields import (
    OPENAI_FIELDS,
    SAMPLING_EXTENSIONS,
    check_fields,
    sampling_dict,
)
from sgl_dspark.srt.managers.io_struct import GenerateOutput, GenerateReqInput
from sgl_dspark.srt.sampling.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "regex",
    "ebnf",
)


def _common_checks(
    ctx: ServingContext, body: CompletionRequest | ChatCompletionRequest, where: str
) -> None:
    check_model_name(ctx, body.model)
    extras = {k: v for k, v in (body.model_extra or {}).items() if k not in SAMPLING_EXTENSIONS}
    check_fields(extras, OPENAI_FIELDS, where)


def _response_format_schema(body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The JSON schema `response_format` asks for (SGLang's mapping: "json_object" is the schema
    of any object), None for "text" or none."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}'
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError(
            400,
            "response_format.json_schema.schema is required for type json_schema",
            param="response_format",
        )
    return json.dumps(fmt.json_schema.schema_)


def _names(body: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """The API's names of the scheduler's fields in refusals: a schema from `response_format`
    is reported as that field."""
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        return {**_OPENAI_NAMES, "json_schema": "response_format"}
    return _OPENAI_NAMES


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingParams:
    values: dict[str, Any] = {"max_new_tokens": max_tokens, "min_new_tokens": body.min_tokens}
    values.update({name: getattr(body, name) for name in _SAMPLING_FIELDS})
    # SGLang's sampling extensions, under their sampling_params names (neutral values of those
    # not implemented are dropped; others are refused by SamplingParams, naming them).
    extras = body.model_extra or {}
    extensions = {new: extras[old] for old, new in SAMPLING_EXTENSIONS.items() if old in extras}
    values.update(sampling_dict(extensions, "OpenAI request"))
    schema = _response_format_schema(body)
    if isinstance(body, CompletionRequest) and body.json_schema is not None:
        if schema is not None:
            raise ApiError(
                400, "send one of json_schema and response_format", param="response_format"
            )
        schema = body.json_schema
    if schema is not None:
        values["json_schema"] = schema
    return make_sampling_params(
        {k: v for k, v in values.items() if v is not None}, rename=_OPENAI_NAMES
    )


def _choice_params(params: SamplingParams, j: int) -> SamplingParams:
    if j == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % 2**63)


def _finish(out: GenerateOutput | SubResult) -> tuple[str | None, Any]:
    reason = out.finish_reason
    if reason is None:
        return None, None
    return str(reason["type"]), reason.get("matched")


def _usage(group: RequestGroup, completion_tokens: int, n: int) -> dict[str, int]:
    prompt = sum(acc.prompt_tokens for i, acc in enumerate(group.accepted) if i % n == 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


# ---- /v1/completions ----------------------------------------------------------------------------
def _completion_prompts(prompt: Any) -> list[tuple[str | None, list[int] | None]]:
    """(text, ids) per prompt; 400 for an empty prompt."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    out: list[tuple[str | None, list[int] | None]] = []
    for i, item in enumerate(items):
        if not item:
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            raise ApiError(400, f"{where} must not be empty", param="prompt")
        out.append((item, None) if isinstance(item, str) else (None, item))
    return out


def _completion_logprobs(
    res: SubResult | GenerateOutput, top_n: int, start: int, echo: bool
) -> dict[str, Any]:
    """The completions `logprobs` object of `res`'s tokens (with `echo`, the prompt's first)."""
    texts: dict[int, str] = dict(res.id_texts or {})
    texts.update(zip(res.token_ids, res.token_texts))
    tokens: list[int] = []
    values: list[float | None] = []
    tops: list[Any] = []
    prompt = res.prompt_logprobs
    if echo and prompt is not None:
        tokens += prompt.token_ids
        values += prompt.logprobs
        tops += prompt.top or [None] * len(prompt.token_ids)
    tokens += res.token_ids
    values += res.logprobs
    tops += res.top_logprobs or [()] * len(res.token_ids)
    return completion_logprobs(tokens, values, tops, texts, top_n, start)


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    _common_checks(ctx, body, "/v1/completions")
    require_tokenizer(ctx, "/v1/completions")
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise ApiError(
            400, "best_of must equal n (best-of ranking is not supported)", param="best_of"
        )
    if body.suffix is not None:
        raise ApiError(400, "suffix is not supported", param="suffix")
    prompts = _completion_prompts(body.prompt)
    max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    params = _sampling_params(body, max_tokens)
    want_lp = body.logprobs is not None
    top_n = body.logprobs or 0
    echo = bool(body.echo)
    base = uuid.uuid4().hex
    inputs = [
        GenerateReqInput(
            rid=f"{base}-{p}-{j}",
            sampling_params=_choice_params(params, j),
            text=text,
            input_ids=ids,
            return_logprob=want_lp,
            logprob_start_len=0 if echo and want_lp else -1,
            top_logprobs_num=top_n,
            return_prompt_text=echo,
        )
        for p, (text, ids) in enumerate(prompts)
        for j in range(n)
    ]
    group = RequestGroup(ctx, request, "/v1/completions", inputs, "prompt", _names(body))
    meta = {
        "id": f"cmpl-{base}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
    }
    if not body.stream:
        async with group:
            await group.start()
            results = await group.collect()
        choices = []
        for i, res in enumerate(results):
            prompt_text = (res.accepted.prompt_text or "") if echo else ""
            reason, matched = _finish(res)
            choices.append(
                {
                    "index": i,
                    "text": prompt_text + res.text,
                    "finish_reason": reason,
                    "matched_stop": matched,
                    "logprobs": _completion_logprobs(res, top_n, 0, echo) if want_lp else None,
                }
            )
        usage = _usage(group, sum(r.completion_tokens for r in results), n)
        return JSONResponse({**meta, "choices": choices, "usage": usage})

    await group.start()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        offsets = [0] * len(inputs)
        completion_tokens = [0] * len(inputs)
        if echo:
            for i, acc in enumerate(group.accepted):
                offsets[i] = len(acc.prompt_text or "")
                yield sse(
                    {
                        **meta,
                        "choices": [
                            {
                                "index": i,
                                "text": acc.prompt_text or "",
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
        async for i, out in group.outputs():
            completion_tokens[i] = out.completion_tokens
            if not (out.text or out.finished or (want_lp and out.token_ids)):
                continue
            reason, matched = _finish(out)
            logprobs = None
            if want_lp:
                # The prompt's logprobs (echo) were not known when its text was sent: they
                # lead the first chunk that carries tokens, their offsets from 0.
                with_prompt = echo and out.prompt_logprobs is not None
                start = 0 if with_prompt else offsets[i]
                logprobs = _completion_logprobs(out, top_n, start, echo)
                offsets[i] = start + sum(len(t) for t in logprobs["tokens"])
            choice = {"index": i, "text": out.text, "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                choice["matched_stop"] = matched
            yield sse({**meta, "choices": [choice]})
        if include_usage:
            yield sse({**meta, "choices": [], "usage": _usage(group, sum(completion_tokens), n)})

    return GroupStreamingResponse(stream_events(group, events), group)


# ---- /v1/chat/completions -----------------------------------------------------------------------
def _chat_logprobs(res: SubResult | GenerateOutput, top_n: int) -> list[dict[str, Any]]:
    texts: dict[int, str] = dict(res.id_texts or {})
    texts.update(zip(res.token_ids, res.token_texts))
    return chat_logprobs(res.token_ids, res.logprobs, res.top_logprobs, texts, top_n)


def _chat_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """The template's form of one message; null content only for an assistant message. Tool
    calls, tool call ids, names and reasoning go to the template as the OpenAI fields."""
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise ApiError(
                400,
                f"messages[{index}].content may be null only in an assistant message",
                param=f"messages.{index}.content",
            )
        content = ""
    elif not isinstance(content, str):
        content = "".join(part.text for part in content)
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]
    for name in ("tool_call_id", "name", "reasoning_content"):
        value = getattr(message, name)
        if value is not None:
            out[name] = value
    return out


@dataclass
class _ChatParsing:
    """How a chat response's text is split: reasoning (`--reasoning-parser`) and tool calls
    (`--tool-call-parser`, when the request offers tools)."""

    reasoning: str | None
    thinking: bool
    tools: str | None

    def reasoning_parser(self) -> ReasoningParser | None:
        return None if self.reasoning is None else ReasoningParser(self.reasoning, self.thinking)

    def tool_parser(self) -> ToolCallParser | None:
        return None if self.tools is None else ToolCallParser(self.tools)


def _chat_template_kwargs(
    ctx: ServingContext, body: ChatCompletionRequest
) -> tuple[dict[str, Any], _ChatParsing]:
    kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice_name = choice.function.name
        if not body.tools or choice_name not in {t.function.name for t in body.tools}:
            raise ApiError(
                400, f"tool_choice names the unknown tool {choice_name!r}", param="tool_choice"
            )
    if body.tools and choice not in (None, "none", "auto"):
        raise ApiError(
            400,
            "tool_choice 'required' or a named function needs constrained decoding of the tool "
            "call, which this server does not run; use 'auto'",
            param="tool_choice",
        )
    if body.continue_final_message:
        raise ApiError(
            400,
            "continue_final_message is not supported (the prompt always ends with the "
            "assistant's generation prompt)",
            param="continue_final_message",
        )
    # stream_reasoning=false asks for the reasoning in one piece; streaming it as it comes
    # changes no text, so it is accepted.
    use_tools = bool(body.tools) and choice != "none"
    if use_tools:
        kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    tool_parser = None
    if use_tools:
        tool_parser = ctx.args.tool_call_parser or DEFAULT_TOOL_PARSER.get(ctx.model_type)
    reasoning = ctx.args.reasoning_parser if body.separate_reasoning is not False else None
    return kwargs, _ChatParsing(reasoning, thinking_requested(kwargs), tool_parser)


def _split_chat_text(parsing: _ChatParsing, text: str) -> dict[str, Any]:
    """The assistant message of a whole chat output."""
    reasoning = None
    rp = parsing.reasoning_parser()
    if rp is not None:
        reasoning, text = rp.feed(text, final=True)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if rp is not None:
        message["reasoning_content"] = reasoning or None
    tp = parsing.tool_parser()
    if tp is not None:
        parsed = tp.parse(text)
        if parsed.calls:
            message["content"] = parsed.content or None
            message["tool_calls"] = parsed.calls
    return message


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    _common_checks(ctx, body, "/v1/chat/completions")
    require_tokenizer(ctx, "/v1/chat/completions")
    template_kwargs, parsing = _chat_template_kwargs(ctx, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    if (
        body.max_tokens is not None
        and body.max_completion_tokens is not None
        and body.max_tokens != body.max_completion_tokens
    ):
        raise ApiError(
            400,
            "max_tokens and max_completion_tokens disagree; send one",
            param="max_completion_tokens",
        )
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = _sampling_params(body, max_tokens or 1)  # 1 is replaced by fill_context
    messages = [_chat_message(i, m) for i, m in enumerate(body.messages)]
    want_lp = bool(body.logprobs)
    top_n = body.top_logprobs or 0
    n = body.n or 1
    base = uuid.uuid4().hex
    inputs = [
        GenerateReqInput(
            rid=f"{base}-{j}",
            sampling_params=_choice_params(params, j),
            messages=messages,
            return_logprob=want_lp,
            top_logprobs_num=top_n,
            fill_context=max_tokens is None,
            chat_template_kwargs=template_kwargs or None,
        )
        for j in range(n)
    ]
    group = RequestGroup(ctx, request, "/v1/chat/completions", inputs, "messages", _names(body))
    meta = {"id": f"chatcmpl-{base}", "created": int(time.time()), "model": body.model}
    if not body.stream:
        async with group:
            await group.start()
            results = await group.collect()
        choices = []
        for i, res in enumerate(results):
            reason, matched = _finish(res)
            message = _split_chat_text(parsing, res.text)
            if message.get("tool_calls") and reason == "stop":
                reason = "tool_calls"
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": {"content": _chat_logprobs(res, top_n)} if want_lp else None,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            )
        usage = _usage(group, sum(r.completion_tokens for r in results), n)
        return JSONResponse(
            {**meta, "object": "chat.completion", "choices": choices, "usage": usage}
        )

    await group.start()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_meta = {**meta, "object": "chat.completion.chunk"}

    async def events() -> AsyncIterator[str]:
        completion_tokens = [0] * n
        reasoning_parsers = [parsing.reasoning_parser() for _ in range(n)]
        tool_parsers = [parsing.tool_parser() for _ in range(n)]
        for i in range(n):
            yield sse(
                {
                    **chunk_meta,
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
        async for i, out in group.outputs():
            completion_tokens[i] = out.completion_tokens
            if not (out.text or out.finished or (want_lp and out.token_ids)):
                continue
            reason, matched = _finish(out)
            delta: dict[str, Any] = {}
            text = out.text
            rp, tp = reasoning_parsers[i], tool_parsers[i]
            if rp is not None:
                reasoning, text = rp.feed(text, final=out.finished)
                if reasoning:
                    delta["reasoning_content"] = reasoning
            if tp is not None:
                text = tp.feed(text)
                if out.finished:
                    parsed = tp.finish()
                    text += parsed.content
                    if parsed.calls:
                        delta["tool_calls"] = parsed.calls
                        if reason == "stop":
                            reason = "tool_calls"
            if text:
                delta["content"] = text
            if not (delta or out.finished or (want_lp and out.token_ids)):
                continue
            choice: dict[str, Any] = {
                "index": i,
                "delta": delta,
                "logprobs": {"content": _chat_logprobs(out, top_n)} if want_lp else None,
                "finish_reason": reason,
            }
            if reason is not None:
                choice["matched_stop"] = matched
            yield sse({**chunk_meta, "choices": [choice]})
        if include_usage:
            yield sse(
                {**chunk_meta, "choices": [], "usage": _usage(group, sum(completion_tokens), n)}
            )

    return GroupStreamingResponse(stream_events(group, events), group)
