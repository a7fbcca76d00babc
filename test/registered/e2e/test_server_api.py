"""End-to-end API tests against the real server process (tiny model, CPU): the OpenAI client and
raw HTTP; outputs are compared with the offline `Engine` and with hand-derived token counts of
the byte tokenizer (1 `<bos>` + one id per UTF-8 byte; chat template in `byte_tokenizer.py`)."""

from __future__ import annotations

import json
import random
import shlex
import shutil
import signal
import subprocess
import threading

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_fixture import running_server
from sgl_dspark import Engine
from sgl_dspark.launch_server import EXAMPLE_QUESTION

CTX, KV = "512", "8192"
BOS, USER, ASSISTANT, SYSTEM, BYTE0 = 0, 4, 5, 6, 7
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("api") / "server.log"
    with running_server(log, "--context-length", CTX, "--max-total-tokens", KV) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine():
    # One intra-op thread: on a busy 2-core box, OpenMP spinning makes 2 threads ~100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = Engine(model_path="tiny", context_length=int(CTX), max_total_tokens=int(KV))
    yield eng
    eng.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _text_ids(text: str) -> list[int]:
    return [BOS] + [BYTE0 + b for b in text.encode()]


def _random_prompts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.!?ÄéЖ"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def _ref(engine, max_tokens: int, **kw) -> dict:
    return engine.generate(sampling_params={"max_new_tokens": max_tokens, **GREEDY}, **kw)


def _sse_events(response: httpx.Response) -> list[str]:
    payloads = [
        line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
    ]
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    assert "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def test_ready_line_curl_works(server):
    assert shutil.which("curl"), "curl is needed to check the printed command"
    out = subprocess.run(
        shlex.split(server.curl_line()), capture_output=True, text=True, timeout=60, check=True
    )
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] <= 128
    # the question through the documented template: <bos><|user|>question\n<|assistant|>
    assert body["usage"]["prompt_tokens"] == 1 + 1 + len(EXAMPLE_QUESTION + "\n") + 1


def test_info_routes(server):
    url = server.base_url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["model_path"] == "tiny" and info["vocab_size"] == 512
    assert info["context_length"] == int(CTX)
    srv = server.wait_idle()
    assert srv["kv_total_pages"] * srv["page_size"] >= int(KV)
    assert srv["kv_free_pages"] == srv["kv_total_pages"]
    assert srv["context_length"] == int(CTX) and srv["speculative_algorithm"] is None


def test_completions_greedy_equal_engine(client, engine):
    prompts = _random_prompts(1, 4)
    for i, prompt in enumerate(prompts):
        max_tokens = 5 + 7 * i
        ref = _ref(engine, max_tokens, prompt=prompt)
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == ref["text"]
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(_text_ids(prompt))
        assert out.usage.completion_tokens == max_tokens
    # A list of prompts answers in order; token-id prompts are used as given.
    rng = random.Random(2)
    id_prompts = [[rng.randrange(BYTE0, BYTE0 + 256) for _ in range(n)] for n in (3, 17)]
    out = client.completions.create(
        model="tiny",
        prompt=id_prompts,
        max_tokens=9,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    refs = _ref(engine, 9, input_ids=id_prompts)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [r["text"] for r in refs]
    assert out.usage.prompt_tokens == 3 + 17 and out.usage.completion_tokens == 18
    out = client.completions.create(
        model="tiny",
        prompt=prompts[:2],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in out.choices] == [r["text"] for r in _ref(engine, 6, prompt=prompts[:2])]


def test_streaming_completion_raw_and_client(server, client, engine):
    prompt = "stream me"
    ref = _ref(engine, 20, prompt=prompt)
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = [json.loads(e) for e in _sse_events(r)]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20
    assert usage["usage"]["prompt_tokens"] == len(_text_ids(prompt))
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == ref["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream) == ref["text"]


def _chat_ids(system: str, user: str) -> list[int]:
    def body(text: str) -> list[int]:
        return [BYTE0 + b for b in (text + "\n").encode()]

    return [BOS, SYSTEM, *body(system), USER, *body(user), ASSISTANT]


def test_chat_greedy_equal_engine(client, engine):
    system, user = "You are tiny.", "Say something, ÄéЖ!"
    ids = _chat_ids(system, user)
    ref = _ref(engine, 24, input_ids=ids)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref["text"]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 24
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == len(ids)
    # Content given as text parts renders like the plain string.
    parts = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": [{"type": "text", "text": user[:5]}, {"type": "text", "text": user[5:]}],
        },
    ]
    out = client.chat.completions.create(
        model="tiny", messages=parts, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].message.content == ref["text"]


def test_chat_without_max_tokens_fills_the_context(client):
    content = "x" * (int(CTX) - 17)
    out = client.chat.completions.create(
        model="tiny", temperature=0, messages=[{"role": "user", "content": content}]
    )
    prompt = len(_chat_ids("", content)) - 2  # no system message
    assert out.usage.prompt_tokens == prompt
    if out.choices[0].finish_reason == "length":
        assert out.usage.completion_tokens == int(CTX) - prompt
    else:
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens < int(CTX) - prompt


def test_generate_native(server, engine):
    url = f"{server.base_url}/generate"
    sp = {"max_new_tokens": 12, **GREEDY}
    ref = engine.generate(prompt="native", sampling_params=sp, return_logprob=True)
    out = httpx.post(
        url, json={"text": "native", "sampling_params": sp, "return_logprob": True}, timeout=60
    ).json()
    assert out["text"] == ref["text"] and out["output_ids"] == ref["output_ids"]
    meta, ref_meta = out["meta_info"], ref["meta_info"]
    for key in ("prompt_tokens", "completion_tokens", "finish_reason"):
        assert meta[key] == ref_meta[key], key
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    for (lp, _, s), (ref_lp, _, ref_s) in zip(
        meta["output_token_logprobs"], ref_meta["output_token_logprobs"]
    ):
        assert lp == pytest.approx(ref_lp, abs=1e-4) and lp <= 0 and s == ref_s
    batch = [[BOS, 50, 60, 70], [BOS, 80]]
    outs = httpx.post(url, json={"input_ids": batch, "sampling_params": sp}, timeout=60).json()
    refs = engine.generate(input_ids=batch, sampling_params=sp)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in refs]
    with httpx.stream(
        "POST", url, json={"text": "native", "sampling_params": sp, "stream": True}, timeout=60
    ) as r:
        events = [json.loads(e) for e in _sse_events(r)]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert events[-1]["text"] == ref["text"] and events[-1]["output_ids"] == ref["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == ref_meta["finish_reason"]


def test_stop_strings_and_stop_tokens(server, client, engine):
    prompt = "stop test"
    ref = _ref(engine, 40, prompt=prompt)
    text = ref["text"]
    stop = text[12:14]
    cut = text.find(stop)
    assert cut >= 0
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == text[:cut]
    assert out.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=40,
        stream=True,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream) == text[:cut]
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "no_stop_trim": True},
    )
    assert out.choices[0].text == text[: cut + len(stop)]
    # A stop token ends the output right after its first occurrence.
    tok = ref["output_ids"][9]
    first = ref["output_ids"].index(tok)
    out = httpx.post(
        f"{server.base_url}/generate",
        timeout=60,
        json={
            "text": prompt,
            "sampling_params": {"max_new_tokens": 40, "stop_token_ids": [tok], **GREEDY},
        },
    ).json()
    assert out["output_ids"] == ref["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}


def test_logprobs_and_echo(client, engine):
    prompt = "logprob"
    ref = engine.generate(
        prompt=prompt, sampling_params={"max_new_tokens": 10, **GREEDY}, return_logprob=True
    )
    ref_lps = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref_lps, abs=1e-4)
    assert len(lp.tokens) == out.usage.completion_tokens == 10
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    chat = client.chat.completions.create(
        model="tiny",
        max_tokens=7,
        temperature=0,
        logprobs=True,
        messages=[{"role": "user", "content": "hi"}],
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(c.logprob <= 0 and c.bytes == list(c.token.encode()) for c in content)
    echo = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert echo.choices[0].text == prompt + ref["text"]


def test_n_choices_use_consecutive_seeds(client):
    kw = {
        "model": "tiny",
        "prompt": "sample",
        "max_tokens": 12,
        "temperature": 0.9,
        "extra_body": {"ignore_eos": True},
    }
    multi = client.completions.create(n=3, seed=11, **kw)
    singles = [client.completions.create(seed=11 + j, **kw) for j in range(3)]
    assert [c.index for c in multi.choices] == [0, 1, 2]
    assert [c.text for c in multi.choices] == [s.choices[0].text for s in singles]
    assert multi.usage.prompt_tokens == singles[0].usage.prompt_tokens  # counted once
    assert multi.usage.completion_tokens == 36
    again = client.completions.create(n=3, seed=11, stream=True, **kw)
    texts = ["", "", ""]
    for chunk in again:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in multi.choices]


def test_metrics_after_requests(server, client):
    for i in range(5):  # self-contained: under xdist other tests may run on another server
        client.completions.create(model="tiny", prompt=f"metrics {i}", max_tokens=4)
    for _ in range(3):
        httpx.post(
            f"{server.base_url}/generate",
            timeout=60,
            json={"text": "m", "sampling_params": {"max_new_tokens": 3}},
        )
    server.wait_idle()
    text = httpx.get(f"{server.base_url}/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }

    def value(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": "tiny", **labels}.items())))
        return samples.get(key, 0.0)

    assert value("sglang:num_requests_total", endpoint="/v1/completions", code="200") >= 5
    assert value("sglang:num_requests_total", endpoint="/generate", code="200") >= 3
    assert value("sglang:time_to_first_token_seconds_count") >= 8
    assert value("sglang:inter_token_latency_seconds_count") > 0
    assert value("sglang:generation_tokens_total") > value(
        "sglang:num_requests_total", endpoint="/generate", code="200"
    )
    assert value("sglang:kv_free_pages") == value("sglang:kv_total_pages") > 0


def test_dspark_greedy_equals_engine(tmp_path, engine):
    """Through a DSpark server (built-in tiny-dspark draft), greedy outputs equal the plain
    offline Engine's, streamed or not; the acceptance metrics are exported."""
    prompts = _random_prompts(5, 3)
    with running_server(
        tmp_path / "dspark.log",
        "--context-length",
        CTX,
        "--max-total-tokens",
        KV,
        "--speculative-algorithm",
        "DSpark",
    ) as srv:
        assert srv.info()["speculative_algorithm"] == "DSpark"
        for prompt in prompts:
            out = httpx.post(
                f"{srv.base_url}/generate",
                timeout=120,
                json={"text": prompt, "sampling_params": {"max_new_tokens": 30, **GREEDY}},
            ).json()
            ref = _ref(engine, 30, prompt=prompt)
            assert out["output_ids"] == ref["output_ids"]
            assert out["meta_info"]["completion_tokens"] == 30
        body = {
            "model": "tiny",
            "prompt": prompts[0],
            "max_tokens": 30,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=120) as r:
            chunks = [json.loads(e) for e in _sse_events(r)]
        assert (
            "".join(c["choices"][0]["text"] for c in chunks)
            == _ref(engine, 30, prompt=prompts[0])["text"]
        )
        info = srv.wait_idle()
        assert info["kv_free_pages"] == info["kv_total_pages"]
        assert info["spec_accept_length"] >= 1.0
        metrics = httpx.get(f"{srv.base_url}/metrics").text
        assert "sglang:spec_accept_length{" in metrics
        assert 'sglang:spec_accept_rate_by_position{model_name="tiny",position="1"}' in metrics


def test_skip_tokenizer_init_serves_token_ids(tmp_path, engine):
    with running_server(
        tmp_path / "ids.log",
        "--context-length",
        CTX,
        "--max-total-tokens",
        KV,
        "--skip-tokenizer-init",
    ) as srv:
        url = srv.base_url
        ids = [BOS, 70, 80, 90]
        out = httpx.post(
            f"{url}/generate",
            timeout=60,
            json={"input_ids": ids, "sampling_params": {"max_new_tokens": 9, **GREEDY}},
        ).json()
        assert out["output_ids"] == _ref(engine, 9, input_ids=ids)["output_ids"]
        assert out["text"] == ""
        for path, body, needle in (
            ("/generate", {"text": "hi"}, "need a tokenizer"),
            (
                "/generate",
                {"input_ids": ids, "sampling_params": {"stop": "x"}},
                "stop strings need a tokenizer",
            ),
            ("/v1/completions", {"model": "tiny", "prompt": ids}, "needs a tokenizer"),
        ):
            r = httpx.post(f"{url}{path}", json=body, timeout=60)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_sigterm_finishes_inflight_stream(tmp_path):
    """A SIGTERM during a stream lets it finish (within the grace period), then exits 0."""
    with running_server(
        tmp_path / "term.log", "--context-length", CTX, "--max-total-tokens", KV
    ) as srv:
        first_chunk = threading.Event()
        result: dict = {}

        def consume() -> None:
            body = {
                "model": "tiny",
                "prompt": "long",
                "max_tokens": 60,
                "stream": True,
                "ignore_eos": True,
            }
            with httpx.stream(
                "POST", f"{srv.base_url}/v1/completions", json=body, timeout=120
            ) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()
                result["events"] = events

        thread = threading.Thread(target=consume)
        thread.start()
        assert first_chunk.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        thread.join(120)
        events = result["events"]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(c["choices"][0]["text"] for c in chunks)) > 0
        assert srv.proc.wait(60) == 0
