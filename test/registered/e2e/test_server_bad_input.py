"""A battery of bad requests, each answered with the right 4xx and an OpenAI-style error body
that names the problem, sent concurrently with good requests that must produce exactly the
tokens they produce when sent alone. The server requires an API key."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from server_fixture import running_server

API_KEY = "sk-e2e-test"
CTX = 256
# A KV pool smaller than the context: the good requests below must queue for memory, and a
# request that fits the context but never the pool is rejected.
KV_TOKENS = 160


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any  # dict -> JSON; str -> raw bytes
    status: int
    message: str  # substring of error.message (case-insensitive)
    param: str | None = None
    method: str = "POST"
    auth: str | None = API_KEY


def _c(prompt: Any = "hello", **kw: Any) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, **kw}


def _chat(messages: Any = None, **kw: Any) -> dict:
    if messages is None:
        messages = [{"role": "user", "content": "hi"}]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, **kw}


COMP, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
CASES = [
    Case("malformed json", COMP, '{"model": "tiny", "prompt": ', 400, "could not parse the json"),
    Case("body not an object", COMP, "[1, 2]", 400, "must be a json object"),
    Case("missing model", COMP, {"prompt": "x"}, 400, "missing required parameter", "model"),
    Case("missing prompt", COMP, {"model": "tiny"}, 400, "missing required parameter", "prompt"),
    Case("unknown model", COMP, {**_c(), "model": "gpt-9"}, 404, "does not exist", "model"),
    Case("lora adapter", COMP, _c(lora_path="adapter"), 400, "no lora adapters", "lora_path"),
    Case(
        "custom logit processor",
        GEN,
        {"text": "a", "custom_logit_processor": "x"},
        400,
        "custom logit processors",
        "custom_logit_processor",
    ),
    Case("image input", GEN, {"text": "a", "image_data": "u"}, 400, "text-only", "image_data"),
    Case(
        "beam search",
        GEN,
        {"text": "a", "sampling_params": {"beam_width": 4}},
        400,
        "beam search",
        "sampling_params.beam_width",
    ),
    Case(
        "chat tool_choice required",
        CHAT,
        _chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"),
        400,
        "constrained decoding",
        "tool_choice",
    ),
    Case("temperature str", COMP, _c(temperature="hot"), 400, "valid number", "temperature"),
    Case(
        "temperature < 0",
        COMP,
        _c(temperature=-0.5),
        400,
        "greater than or equal to 0",
        "temperature",
    ),
    Case(
        "temperature > 2", COMP, _c(temperature=2.5), 400, "less than or equal to 2", "temperature"
    ),
    Case("top_p 0", COMP, _c(top_p=0), 400, "greater than 0", "top_p"),
    Case("top_p > 1", COMP, _c(top_p=1.5), 400, "less than or equal to 1", "top_p"),
    Case("top_k 0", COMP, _c(top_k=0), 400, "top_k must be -1", "top_k"),
    Case("max_tokens 0", COMP, _c(max_tokens=0), 400, "greater than or equal to 1", "max_tokens"),
    Case("max_tokens float", COMP, _c(max_tokens=2.5), 400, "valid integer", "max_tokens"),
    Case("max_tokens bool", COMP, _c(max_tokens=True), 400, "valid integer", "max_tokens"),
    Case("n 0", COMP, _c(n=0), 400, "greater than or equal to 1", "n"),
    Case("n too large", COMP, _c(n=1000), 400, "less than or equal to 128", "n"),
    Case("seed negative", COMP, _c(seed=-1), 400, "greater than or equal to 0", "seed"),
    Case("stream not bool", COMP, _c(stream="yes"), 400, "valid boolean", "stream"),
    Case("empty prompt", COMP, _c(""), 400, "must not be empty", "prompt"),
    Case("empty prompt list", COMP, _c([]), 400, "must not be empty", "prompt"),
    Case("empty id prompt", COMP, _c([[]]), 400, "must not be empty", "prompt"),
    Case("prompt wrong type", COMP, _c(5), 400, "invalid type for 'prompt'", "prompt"),
    Case(
        "prompt too long", COMP, _c("x" * (CTX + 10)), 400, "exceeds the context length", "prompt"
    ),
    Case(
        "prompt + max_tokens too long",
        COMP,
        _c("hi", max_tokens=CTX),
        400,
        "exceeds the context length",
        "prompt",
    ),
    Case(
        "never fits the KV pool",
        COMP,
        _c("hi", max_tokens=200),
        400,
        "more than the pool holds",
        "prompt",
    ),
    Case("token id out of vocab", COMP, _c([0, 70, 99999]), 400, "out of range", "prompt"),
    Case("negative token id", COMP, _c([0, -3]), 400, "out of range", "prompt"),
    Case("stop wrong type", COMP, _c(stop=5), 400, "invalid type for 'stop'", "stop"),
    Case("stop empty string", COMP, _c(stop=[""]), 400, "non-empty strings", "stop"),
    Case("logprobs out of range", COMP, _c(logprobs=9), 400, "less than or equal to 5", "logprobs"),
    Case(
        "logit_bias out of range",
        COMP,
        _c(logit_bias={"5": 150.0}),
        400,
        "logit_bias values must be in [-100, 100]",
        "logit_bias",
    ),
    Case("logit_bias id out of vocab", COMP, _c(logit_bias={"99999": 1.0}), 400, "out of range"),
    Case("bad regex", COMP, _c(regex="(ab"), 400, "regex invalid grammar", "regex"),
    Case("bad ebnf", COMP, _c(ebnf="root ::= nothing"), 400, "ebnf invalid grammar", "ebnf"),
    Case(
        "bad json_schema",
        COMP,
        _c(json_schema="{not json"),
        400,
        "json_schema invalid grammar",
        "json_schema",
    ),
    Case(
        "two grammars",
        COMP,
        _c(regex="a+", ebnf='root ::= "a"'),
        400,
        "cannot be combined",
        "ebnf",
    ),
    Case(
        "min_tokens above max_tokens",
        COMP,
        _c(min_tokens=9, max_tokens=4),
        400,
        "min_tokens must be in [0, max_new_tokens",
        "min_tokens",
    ),
    Case("suffix", COMP, _c(suffix="end"), 400, "not supported", "suffix"),
    Case("bad api key", COMP, _c(), 401, "incorrect api key", auth="sk-wrong"),
    Case("missing api key", COMP, _c(), 401, "incorrect api key", auth=None),
    Case("chat no messages", CHAT, _chat([]), 400, "at least 1", "messages"),
    Case(
        "chat bad role",
        CHAT,
        _chat([{"role": "robot", "content": "x"}]),
        400,
        "'system'",
        "messages.0.role",
    ),
    Case(
        "chat content int",
        CHAT,
        _chat([{"role": "user", "content": 5}]),
        400,
        "invalid type for 'messages.0.content'",
        "messages.0.content",
    ),
    Case(
        "chat tools",
        CHAT,
        _chat(tools=[{"type": "function"}]),
        400,
        "missing required parameter",
        "tools.0.function",
    ),
    Case(
        "chat top_logprobs out of range",
        CHAT,
        _chat(logprobs=True, top_logprobs=21),
        400,
        "less than or equal to 20",
        "top_logprobs",
    ),
    Case(
        "chat json_schema without schema",
        CHAT,
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "schema is required",
        "response_format",
    ),
    Case(
        "chat max tokens disagree",
        CHAT,
        _chat(max_completion_tokens=9),
        400,
        "disagree",
        "max_completion_tokens",
    ),
    Case("chat unknown model", CHAT, {**_chat(), "model": "x"}, 404, "does not exist", "model"),
    Case("generate text and ids", GEN, {"text": "a", "input_ids": [1]}, 400, "exactly one"),
    Case("generate nothing", GEN, {"sampling_params": {}}, 400, "exactly one"),
    Case(
        "generate bad sampling value",
        GEN,
        {"text": "a", "sampling_params": {"temperature": -1}},
        400,
        "temperature must be",
        "temperature",
    ),
    Case(
        "generate unknown sampling key",
        GEN,
        {"text": "a", "sampling_params": {"tmp": 1}},
        400,
        "unknown sampling_params key",
        "sampling_params",
    ),
    Case(
        "generate sampling list mismatch",
        GEN,
        {"text": ["a", "b"], "sampling_params": [{}]},
        400,
        "1 entries for 2 prompts",
        "sampling_params",
    ),
    Case(
        "generate n > 1",
        GEN,
        {"text": "a", "sampling_params": {"n": 2}},
        400,
        "not supported on /generate",
        "n",
    ),
    Case(
        "generate duplicate rids",
        GEN,
        {"text": ["a", "b"], "rid": ["r", "r"]},
        400,
        "unique",
        "rid",
    ),
    Case("generate empty text", GEN, {"text": ""}, 400, "must not be empty", "text"),
    Case("wrong method", COMP, None, 405, "method not allowed", method="GET"),
    Case("unknown route", "/v1/embeddings", {}, 404, "not found"),
]

# Good requests: (path, body, streaming). Outputs must not depend on what else is in flight.
GOOD = [
    (COMP, _c("good one", max_tokens=12, temperature=0, ignore_eos=True), False),
    (COMP, _c("good two", max_tokens=20, temperature=0.8, seed=3, ignore_eos=True), False),
    (COMP, _c([0, 80, 90, 100], max_tokens=9, temperature=0, ignore_eos=True), True),
    (COMP, _c(["a batch", "of two"], max_tokens=7, temperature=0.7, seed=9, n=2), False),
    (CHAT, _chat([{"role": "user", "content": "good chat"}], max_tokens=15, temperature=0), False),
    (
        CHAT,
        _chat(
            [{"role": "user", "content": "streamed chat"}], max_tokens=11, temperature=1.0, seed=4
        ),
        True,
    ),
    (
        GEN,
        {"text": "native good", "sampling_params": {"max_new_tokens": 13, "temperature": 0}},
        False,
    ),
    (
        GEN,
        {
            "input_ids": [[0, 60], [0, 61, 62]],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.5, "seed": 1},
        },
        True,
    ),
]


def _headers(auth: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {auth}"} if auth is not None else {}


async def _send_case(client: httpx.AsyncClient, case: Case) -> tuple[int, dict]:
    kw: dict[str, Any] = {"headers": _headers(case.auth)}
    if isinstance(case.body, str):
        kw["content"] = case.body.encode()
    elif case.body is not None:
        kw["json"] = case.body
    r = await client.request(case.method, case.path, **kw)
    return r.status_code, r.json()


async def _send_good(client: httpx.AsyncClient, path: str, body: dict, stream: bool) -> Any:
    """The produced output in a comparable form (texts per choice / output ids)."""
    if not stream:
        r = await client.post(path, json=body, headers=_headers(API_KEY))
        assert r.status_code == 200, r.text
        out = r.json()
        if path == GEN:
            return out["output_ids"] if isinstance(out, dict) else [o["output_ids"] for o in out]
        key = "text" if path == COMP else "message"
        return [c[key] if key == "text" else c[key]["content"] for c in out["choices"]]
    async with client.stream(
        "POST", path, json={**body, "stream": True}, headers=_headers(API_KEY)
    ) as r:
        assert r.status_code == 200
        payloads = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    if path == GEN:
        last: dict[int, list[int]] = {}
        for e in events:
            last[e.get("index", 0)] = e["output_ids"]
        return [last[i] for i in sorted(last)]
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            piece = c["text"] if path == COMP else c["delta"].get("content", "")
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return [texts[i] for i in sorted(texts)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("bad_input") / "server.log"
    with running_server(
        log, "--context-length", str(CTX), "--max-total-tokens", str(KV_TOKENS), api_key=API_KEY
    ) as srv:
        yield srv


def test_bad_inputs_alongside_good_requests(server):
    assert len(CASES) >= 30 and len(GOOD) >= 8

    async def run() -> tuple[list, list, list]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            alone = [await _send_good(client, *g) for g in GOOD]
            tasks = [_send_good(client, *g) for g in GOOD] + [_send_case(client, c) for c in CASES]
            results = await asyncio.gather(*tasks)
        return alone, results[: len(GOOD)], results[len(GOOD) :]

    alone, together, answers = asyncio.run(run())
    assert together == alone
    failures = []
    for case, (status, body) in zip(CASES, answers):
        err = body.get("error", {})
        ok = (
            status == case.status
            and case.message.lower() in str(err.get("message")).lower()
            and set(err) == {"message", "type", "param", "code"}
            and err["type"] == "invalid_request_error"
            and (case.param is None or err.get("param") == case.param)
        )
        if not ok:
            failures.append(
                f"{case.name}: expected {case.status} {case.message!r} "
                f"param={case.param!r}, got {status} {body}"
            )
    assert not failures, "\n".join(failures)
    info = server.wait_idle()
    assert info["kv_free_pages"] == info["kv_total_pages"]
    # /health and /metrics need no key; everything else does.
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
