"""Request bodies of the HTTP API (pydantic, validated from the raw JSON bytes in strict mode).

Fields SGLang 0.5.23 knows but this server does not implement are checked by the policies of
`sglang_fields.py` (inert ones ignored, the others accepted only at their neutral value, else a
400 naming the field). Unknown fields behave as in SGLang: ignored at the top level of a body
(the request models keep them in `model_extra` for those policies), refused inside nested
objects and inside `sampling_params`. Known OpenAI fields that this server does not implement
are accepted only at their neutral value (e.g. `suffix` null) and otherwise answered with a 400
naming the field. Strict mode:
an int is accepted where a number is expected, but strings are never coerced and bools are not
ints; NaN and infinities are refused. Null means the default wherever OpenAI allows null (a
field declared `X | None`). SGLang's sampling extensions (`top_k`, `min_p`, `stop_token_ids`,
`ignore_eos`, `skip_special_tokens`, `no_stop_trim`, `repetition_penalty`) are accepted on the
OpenAI routes; their ranges, and those of the sampling fields every route shares, are checked
once by `SamplingParams` (`srt/sampling/sampling_params.py`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_N = 128  # OpenAI's limit on choices per request
MAX_RID_CHARS = 512

TokenIds = list[int]
RequestId = Annotated[str, Field(min_length=1, max_length=MAX_RID_CHARS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _TopLevelBody(BaseModel):
    """A request body: unknown fields are kept in `model_extra` (see the module doc)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = None


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    # `schema` would shadow a pydantic method; the wire name is the alias.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's structured output: "json_object" (any JSON object) or "json_schema" (the given
    schema), enforced by the grammar engine (`srt/constrained/`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_TopLevelBody):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + SGLang extensions)."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(None)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # SGLang extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    regex: str | None = None
    ebnf: str | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    json_schema: str | None = None  # SGLang extension


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: int | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only for an assistant message (as in OpenAI)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant (SGLang's field)


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # SGLang extensions of chat.
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    continue_final_message: bool | None = None
    reasoning_effort: str | None = None


class GenerateRequest(_TopLevelBody):
    """SGLang's native `/generate`. Exactly one of `text` / `input_ids`; a list means a batch."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    stream: bool | None = None
    return_logprob: bool | None = None
    rid: RequestId | list[RequestId] | None = None
    return_text_in_logprobs: bool | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int] | None] | None = None


_TYPE_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string, a list of strings or null",
    "text": "a string or a list of strings",
    "input_ids": "a list of token ids or a list of lists of token ids",
    "sampling_params": "an object or a list of objects",
    "rid": "a string or a list of strings",
    "content": "a string or a list of {'type': 'text', 'text': str} parts",
}
_RANGE_ERRORS = {
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "too_short",
    "too_long",
    "literal_error",
}


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem in `exc`, worded for an API user."""
    err = exc.errors()[0]
    kind, loc = err["type"], [str(x) for x in err["loc"]]
    if kind == "json_invalid":
        return f"We could not parse the JSON body of your request ({err['msg']})", None
    if not loc:
        return f"The request body must be a JSON object ({err['msg']})", None
    # Drop pydantic's union-member tags ("str", "list[int]") from the location.
    path = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    param = ".".join(path) or loc[0]
    last = path[-1] if path else loc[0]
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"Missing required parameter: '{param}'", param
    if kind not in _RANGE_ERRORS and last in _TYPE_HINTS:
        return f"Invalid type for '{param}': expected {_TYPE_HINTS[last]}", param
    value = repr(err.get("input"))
    value = value if len(value) <= 60 else value[:57] + "..."
    return f"Invalid value for '{param}': {err['msg']} (got {value})", param
