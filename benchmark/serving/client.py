"""One HTTP request against an OpenAI-compatible or SGLang `/generate` endpoint, timed per chunk.

Backends:
- "openai": POST /v1/completions (prompt as text or as a list of token ids).
- "openai-chat": POST /v1/chat/completions (text prompt as one user message).
- "sglang": POST /generate (`text` or `input_ids`, `sampling_params`), cumulative or incremental
  streamed text, `meta_info` with token counts and speculative-decoding counters.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger(__name__)

BACKENDS = ("openai", "openai-chat", "sglang")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What to send. `prompt` is text or token ids; `output_len` is max new tokens."""

    prompt: str | list[int]
    output_len: int
    ignore_eos: bool = True
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    prompt_len: int = 0  # known input length in tokens (0 = unknown; taken from the response)


@dataclass(slots=True)
class RequestResult:
    """What came back. Times are seconds from `start` (a perf_counter stamp)."""

    ok: bool = False
    error: str = ""
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between successive content chunks
    accept_length: float | None = None  # per-request speculative acceptance, when reported
    verify_ct: int | None = None  # speculative verify steps, when reported
    tokens_counted_by_chunks: bool = False  # True when the server gave no token count


def _payload(
    backend: str, model: str, spec: RequestSpec, stream: bool
) -> tuple[str, dict[str, Any]]:
    if backend == "sglang":
        body: dict[str, Any] = {
            "sampling_params": {
                "max_new_tokens": spec.output_len,
                "temperature": spec.temperature,
                "ignore_eos": spec.ignore_eos,
            },
            "stream": stream,
        }
        if spec.stop:
            body["sampling_params"]["stop"] = list(spec.stop)
        body["input_ids" if isinstance(spec.prompt, list) else "text"] = spec.prompt
        return "/generate", body
    body = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": spec.temperature,
        "stream": stream,
        "ignore_eos": spec.ignore_eos,  # SGLang / vLLM extension; ignored by strict servers
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if spec.stop:
        body["stop"] = list(spec.stop)
    if backend == "openai-chat":
        if not isinstance(spec.prompt, str):
            raise ValueError("backend 'openai-chat' needs text prompts (pass --tokenizer)")
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", body
    if backend != "openai":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    body["prompt"] = spec.prompt
    return "/v1/completions", body


def _find_accept(obj: dict[str, Any]) -> tuple[float | None, int | None]:
    """Speculative counters wherever a server puts them: top level, `meta_info` or `usage`."""
    accept, verify = None, None
    for holder in (obj, obj.get("meta_info") or {}, obj.get("usage") or {}):
        if not isinstance(holder, dict):
            continue
        if holder.get("spec_accept_length") is not None:
            accept = float(holder["spec_accept_length"])
        if holder.get("spec_verify_ct") is not None:
            verify = int(holder["spec_verify_ct"])
    return accept, verify


class _ChunkParser:
    """Turns decoded JSON chunks into text deltas and counters for one backend."""

    def __init__(self, backend: str, result: RequestResult) -> None:
        self.backend = backend
        self.result = result
        self.cumulative = ""
        self.last_completion_tokens = 0

    def feed(self, obj: dict[str, Any]) -> str:
        """Updates counters from one chunk (or one whole non-streamed body); returns new text."""
        if obj.get("error"):
            # SGLang and OpenAI servers report mid-stream failures as an "error" object.
            raise ValueError(f"server error: {obj['error']}")
        res = self.result
        accept, verify = _find_accept(obj)
        res.accept_length = accept if accept is not None else res.accept_length
        res.verify_ct = verify if verify is not None else res.verify_ct
        if self.backend == "sglang":
            meta = obj.get("meta_info") or {}
            res.prompt_tokens = int(meta.get("prompt_tokens", res.prompt_tokens))
            res.output_tokens = int(meta.get("completion_tokens", res.output_tokens))
            text = obj.get("text") or ""
            # Default SGLang streams the text so far; some builds stream increments instead.
            if text.startswith(self.cumulative):
                delta = text[len(self.cumulative) :]
                self.cumulative = text
            else:
                delta = text
                self.cumulative += text
            return delta
        usage = obj.get("usage")
        if isinstance(usage, dict):
            res.prompt_tokens = int(usage.get("prompt_tokens") or res.prompt_tokens)
            res.output_tokens = int(usage.get("completion_tokens") or res.output_tokens)
        delta = ""
        for choice in obj.get("choices") or []:
            if "text" in choice:
                delta += choice.get("text") or ""
            elif "delta" in choice:
                delta += (choice["delta"] or {}).get("content") or ""
            elif "message" in choice:
                delta += (choice["message"] or {}).get("content") or ""
        self.cumulative += delta
        return delta


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    backend: str,
    model: str,
    spec: RequestSpec,
    stream: bool = True,
) -> RequestResult:
    """Sends one request and times it. Never raises for server-side failures: they come back as
    `ok=False` with `error` set, so one bad request does not hide the others' timings."""
    path, body = _payload(backend, model, spec, stream)
    res = RequestResult(prompt_tokens=spec.prompt_len)
    parser = _ChunkParser(backend, res)
    res.start = time.perf_counter()
    last_event = 0.0
    content_chunks = 0
    try:
        async with client.stream("POST", base_url.rstrip("/") + path, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
            if not stream:
                parser.feed(json.loads(await resp.aread()))
                res.latency = res.ttft = time.perf_counter() - res.start
                content_chunks = 1
            else:
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    delta = parser.feed(json.loads(data))
                    now = time.perf_counter() - res.start
                    if delta:
                        if content_chunks == 0:
                            res.ttft = now
                        else:
                            res.itl.append(now - last_event)
                        last_event = now
                        content_chunks += 1
                res.latency = time.perf_counter() - res.start
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.text = parser.cumulative
    if res.output_tokens == 0 and content_chunks > 0:
        # No token count from the server: one chunk per token is the best available guess.
        res.output_tokens = content_chunks
        res.tokens_counted_by_chunks = True
    if res.accept_length is None and res.verify_ct:
        res.accept_length = res.output_tokens / res.verify_ct
    res.ok = True
    return res


async def first_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    """The first id listed by `/v1/models`, or "default" when the server has no such route."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/v1/models")
        if resp.status_code == 200:
            data = resp.json().get("data") or []
            if data:
                return str(data[0]["id"])
    except httpx.HTTPError as exc:
        # The route is optional; SGLang /generate needs no model name.
        logger.debug("GET /v1/models failed (%s); using model 'default'", exc)
    return "default"
