"""A small deterministic stand-in for an SGLang / OpenAI-compatible server, for harness tests.

Routes: /health, /v1/models, /v1/completions, /v1/chat/completions, /generate (SGLang format,
cumulative streamed text), /metrics (prometheus text). Outputs depend only on the prompt.

Timing model: each request sleeps `--prefill-delay-ms`, then emits its tokens in decode steps of
`--delay-ms` each. Without speculation a step emits one token; with `--speculative-algorithm DSpark`
a step emits on average `--speculative-dspark-simulate-accept-len` tokens (default 3), so
throughput scales with the acceptance length as it does on a real server.

GSM8K mode (`--solve-gsm8k FILE`): a prompt whose last question is in FILE gets a short worked
answer; the question is answered wrong when `gsm8k_is_wrong(question, rate, seed)` says so.

Run: python test/registered/unit/fake_openai_server.py --port 30000 [--delay-ms 2] [...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import re
import shlex
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

# Module level on purpose: with postponed annotations FastAPI resolves `Request` in module globals.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

# fmt: off
_ANSWER_FORMS = (
    "The answer is {v}.",
    "#### {v}",
    "So the total is {v} dollars.",
    "Therefore, the final answer is ${v}.",
)
# fmt: on


def _hash01(*parts: str) -> float:
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def gsm8k_is_wrong(question: str, error_rate: float, error_seed: int) -> bool:
    """Whether the fake answers `question` wrong (a deterministic coin with P = error_rate)."""
    return _hash01("wrong", str(error_seed), question) < error_rate


def _format_number(value: str, question: str) -> str:
    """Writes the number the way models do: thousands separators for big integers, sometimes."""
    if (
        re.fullmatch(r"-?\d+", value)
        and abs(int(value)) >= 1000
        and _hash01("comma", question) < 0.5
    ):
        return f"{int(value):,}"
    return value


def gsm8k_answer_text(question: str, truth: str, error_rate: float, error_seed: int) -> str:
    """A worked answer that ends with the (possibly wrong) final number, then a new question."""
    value = truth.replace(",", "")
    if gsm8k_is_wrong(question, error_rate, error_seed):
        value = str(int(float(value)) + 7)
    form = _ANSWER_FORMS[int(_hash01("form", question) * len(_ANSWER_FORMS))]
    final = form.format(v=_format_number(value, question))
    # Distractor numbers before the final one exercise the "last number" rule.
    return f" First, 2 + 3 = 5 and 10 - 4 = 6. {final}\n\nQuestion: a new one"


class FakeEngine:
    """Turns a prompt into deterministic output tokens and paces them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.spec = (args.speculative_algorithm or "").lower() == "dspark"
        self.accept_len = args.speculative_dspark_simulate_accept_len or 3.0
        self.solutions: dict[str, str] = {}
        if args.solve_gsm8k:
            with open(args.solve_gsm8k, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        row = json.loads(line)
                        self.solutions[row["question"].strip()] = (
                            row["answer"].split("####")[-1].strip()
                        )

    def output_words(self, prompt: str | list[int], max_tokens: int) -> list[str]:
        if isinstance(prompt, str) and self.solutions:
            question = prompt.rsplit("Question:", 1)[-1].split("\nAnswer:", 1)[0].strip()
            if question in self.solutions:
                text = gsm8k_answer_text(
                    question,
                    self.solutions[question],
                    self.args.gsm8k_error_rate,
                    self.args.gsm8k_error_seed,
                )
                return re.findall(r"\s*\S+", text)[:max_tokens]
        seed = hashlib.sha256(repr(prompt).encode()).hexdigest()
        return [
            f" t{int(seed[(2 * i) % 60 : (2 * i) % 60 + 4], 16) % 997}" for i in range(max_tokens)
        ]

    def step_sizes(self, n_tokens: int) -> list[int]:
        """Tokens per decode step: 1, or a deterministic mix averaging the acceptance length."""
        if not self.spec:
            return [1] * n_tokens
        sizes, done, step = [], 0, 0
        while done < n_tokens:
            step += 1
            size = max(1, int(step * self.accept_len) - int((step - 1) * self.accept_len))
            sizes.append(min(size, n_tokens - done))
            done += sizes[-1]
        return sizes

    async def generate(
        self, prompt: str | list[int], max_tokens: int, stop: list[str]
    ) -> AsyncIterator[tuple[str, int, int]]:
        """Yields (text delta, tokens so far, steps so far) once per decode step."""
        words = self.output_words(prompt, max_tokens)
        full = "".join(words)
        cut = min((full.find(s) for s in stop if s and s in full), default=-1)
        if cut >= 0:  # stop strings end generation and are not returned, as in SGLang/OpenAI
            kept, total = [], 0
            for w in words:
                if total + len(w) > cut:
                    break
                kept.append(w)
                total += len(w)
            words = kept
        await asyncio.sleep(self.args.prefill_delay_ms / 1000.0)
        done = 0
        for step, size in enumerate(self.step_sizes(len(words)), 1):
            await asyncio.sleep(self.args.delay_ms / 1000.0)
            yield "".join(words[done : done + size]), done + size, step
            done += size


def _prompt_tokens(prompt: str | list[int]) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def build_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI()
    engine = FakeEngine(args)
    model = args.model_path

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def spec_meta(tokens: int, steps: int) -> dict[str, Any]:
        if not engine.spec:
            return {}
        return {"spec_verify_ct": steps, "spec_accept_length": tokens / max(steps, 1)}

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = [
            "# TYPE sglang:num_requests_total counter",
            f'sglang:num_requests_total{{model_name="{model}"}} 1',
        ]
        if engine.spec:
            lines += [
                "# TYPE sglang:spec_accept_length gauge",
                f'sglang:spec_accept_length{{model_name="{model}"}} {engine.accept_len}',
            ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def openai_route(body: dict[str, Any], chat: bool) -> Any:
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        gen = engine.generate(prompt, int(body.get("max_tokens") or 16), stop)
        n_prompt = _prompt_tokens(prompt)
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            key = {"delta": {"content": text}} if chat else {"text": text}
            return {"index": 0, **key, "finish_reason": finish}

        if not body.get("stream"):
            text, tokens = "", 0
            async for delta, so_far, _ in gen:
                text, tokens = text + delta, so_far
            msg = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            usage = {
                "prompt_tokens": n_prompt,
                "completion_tokens": tokens,
                "total_tokens": n_prompt + tokens,
            }
            return JSONResponse(
                {
                    "object": kind,
                    "model": model,
                    "choices": [{"index": 0, **msg, "finish_reason": "length"}],
                    "usage": usage,
                }
            )

        async def stream() -> AsyncIterator[str]:
            tokens = 0
            async for delta, so_far, _ in gen:
                tokens = so_far
                yield sse({"object": kind, "model": model, "choices": [choice(delta, None)]})
            yield sse({"object": kind, "model": model, "choices": [choice("", "length")]})
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": tokens,
                    "total_tokens": n_prompt + tokens,
                }
                yield sse({"object": kind, "model": model, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await openai_route(await request.json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await openai_route(await request.json(), chat=True)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        prompt = body.get("input_ids") if body.get("input_ids") is not None else body["text"]
        params = body.get("sampling_params") or {}
        stop = params.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        gen = engine.generate(prompt, int(params.get("max_new_tokens") or 16), stop)
        base = {"id": f"req-{time.perf_counter_ns()}", "prompt_tokens": _prompt_tokens(prompt)}

        def meta(tokens: int, steps: int, finish: Any) -> dict[str, Any]:
            return {
                **base,
                "completion_tokens": tokens,
                "finish_reason": finish,
                **spec_meta(tokens, steps),
            }

        if not body.get("stream"):
            text, tokens, steps = "", 0, 0
            async for delta, so_far, step in gen:
                text, tokens, steps = text + delta, so_far, step
            return JSONResponse(
                {"text": text, "meta_info": meta(tokens, steps, {"type": "length"})}
            )

        async def stream() -> AsyncIterator[str]:
            text = ""
            async for delta, tokens, steps in gen:
                text += delta
                yield sse({"text": text, "meta_info": meta(tokens, steps, None)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="deterministic fake OpenAI/SGLang server for tests")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", default="tiny")
    p.add_argument("--delay-ms", type=float, default=1.0, help="sleep per decode step")
    p.add_argument(
        "--prefill-delay-ms", type=float, default=1.0, help="sleep before the first step"
    )
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-dspark-simulate-accept-len", type=float, default=None)
    p.add_argument("--solve-gsm8k", default=None, help="jsonl whose questions get worked answers")
    p.add_argument("--gsm8k-error-rate", type=float, default=0.0)
    p.add_argument("--gsm8k-error-seed", type=int, default=0)
    return p.parse_args(argv)


def fake_command(*flags: str) -> str:
    """Shell command template (with "{port}") that launches this server with `flags`."""
    parts = [sys.executable, str(Path(__file__).resolve()), "--port", "{port}", *flags]
    return " ".join(p if p == "{port}" else shlex.quote(p) for p in parts)


@contextlib.contextmanager
def running_fake(log_path: str | Path, *flags: str) -> Iterator[str]:
    """Runs the fake server on a free port for the duration of the block; yields its base URL."""
    from benchmark.serving.launch import ServerProcess, find_free_port

    port = find_free_port()
    cmd = fake_command(*flags).replace("{port}", str(port))
    with ServerProcess(cmd, f"http://127.0.0.1:{port}", log_path, ready_timeout_s=60.0):
        yield f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
