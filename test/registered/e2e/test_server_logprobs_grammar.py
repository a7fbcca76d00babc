"""Logprobs, penalties, biases and grammars over HTTP against a DSpark server, compared with the
offline Engine without speculation: /generate's SGLang logprob keys (prompt, top-N, token ids,
texts), /v1/completions `logprobs: N` and `echo`, chat `top_logprobs`, `response_format`, and
400s naming the field for grammars that do not compile."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from server_fixture import running_server
from sgl_dspark import Engine

CTX = 256
BYTE0, EOS = 7, 1
GREEDY = {"temperature": 0.0}
NO_WHITESPACE = {str(BYTE0 + ord(c)): -100.0 for c in " \t\n\r"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logprobs") / "server.log"
    with running_server(
        log, "--context-length", str(CTX), "--speculative-algorithm", "DSpark"
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = Engine(model_path="tiny", context_length=CTX)
    yield eng
    eng.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _close_rows(a: list | None, b: list | None) -> None:
    if a is None or b is None:
        assert a is b
        return
    assert [t for _, t, _ in a] == [t for _, t, _ in b]
    assert [s for _, _, s in a] == [s for _, _, s in b]
    assert [v for v, _, _ in a] == pytest.approx([v for v, _, _ in b], abs=1e-4)


def test_generate_logprob_keys(server, engine):
    sp = {**GREEDY, "max_new_tokens": 9, "frequency_penalty": 0.7}
    options = {
        "return_logprob": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 3,
        "token_ids_logprob": [BYTE0 + ord("a"), EOS],
        "return_text_in_logprobs": True,
    }
    ref = engine.generate("Logprobs over HTTP", sp, **options)
    url = f"{server.base_url}/generate"
    out = httpx.post(
        url, json={"text": "Logprobs over HTTP", "sampling_params": sp, **options}, timeout=120
    ).json()
    assert out["output_ids"] == ref["output_ids"]
    meta, ref_meta = out["meta_info"], ref["meta_info"]
    assert meta["spec_verify_ct"] >= 1
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert len(meta[key]) == len(ref_meta[key])
        _close_rows(
            [[v, t, s] for v, t, s in meta[key] if v is not None],
            [[v, t, s] for v, t, s in ref_meta[key] if v is not None],
        )
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["input_token_logprobs"][0][2] == "L"  # texts with return_text_in_logprobs
    for key in (
        "input_top_logprobs",
        "output_top_logprobs",
        "input_token_ids_logprobs",
        "output_token_ids_logprobs",
    ):
        assert len(meta[key]) == len(ref_meta[key]), key
        for a, b in zip(meta[key], ref_meta[key]):
            _close_rows(a, b)
    # Streaming carries the same (cumulative) logprobs in its last event.
    with httpx.stream(
        "POST",
        url,
        json={"text": "Logprobs over HTTP", "sampling_params": sp, "stream": True, **options},
        timeout=120,
    ) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    last = events[-1]["meta_info"]
    assert events[-1]["output_ids"] == ref["output_ids"]
    for a, b in zip(last["output_top_logprobs"], ref_meta["output_top_logprobs"]):
        _close_rows(a, b)
    # Without return_text_in_logprobs the texts are null, as in SGLang.
    plain = httpx.post(
        url,
        json={"text": "x", "sampling_params": sp, "return_logprob": True},
        timeout=120,
    ).json()
    assert all(s is None for _, _, s in plain["meta_info"]["output_token_logprobs"])
    assert plain["meta_info"]["input_token_logprobs"] == []


def test_generate_adjusted_and_constrained_match_engine(server, engine):
    cases = [
        {"repetition_penalty": 1.7, "presence_penalty": 0.5, "max_new_tokens": 10},
        {"logit_bias": {str(BYTE0 + ord("q")): 8.0}, "max_new_tokens": 6},
        {"regex": "(red|blue)-[0-9]{2}", "max_new_tokens": 12},
        {"ebnf": 'root ::= "[" [a-c]+ "]"', "max_new_tokens": 10},
        {"min_new_tokens": 3, "logit_bias": {str(EOS): 100.0}, "max_new_tokens": 8},
    ]
    params = [{**GREEDY, **c} for c in cases]
    refs = engine.generate(["Colour?"] * len(cases), params)
    outs = httpx.post(
        f"{server.base_url}/generate",
        json={"text": ["Colour?"] * len(cases), "sampling_params": params},
        timeout=120,
    ).json()
    for case, out, ref in zip(cases, outs, refs):
        assert out["output_ids"] == ref["output_ids"], case
        assert out["text"] == ref["text"]
    assert outs[4]["output_ids"][-1] == EOS and len(outs[4]["output_ids"]) == 4


def test_completions_top_logprobs_and_echo(client, engine):
    prompt = "echo me"
    ref = engine.generate(
        prompt,
        {**GREEDY, "max_new_tokens": 6},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = ref["meta_info"]
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(
        [v for v, _, _ in meta["output_token_logprobs"]], abs=1e-4
    )
    for got, want in zip(lp.top_logprobs, meta["output_top_logprobs"]):
        expect = {}
        for v, _, s in want:
            expect.setdefault(s, v)
        assert list(got) == list(expect) and list(got.values()) == pytest.approx(
            list(expect.values()), abs=1e-4
        )
    echo = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True
    )
    elp = echo.choices[0].logprobs
    n_prompt = len(meta["input_token_logprobs"])
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert elp.tokens[:n_prompt] == [s for _, _, s in meta["input_token_logprobs"]]
    assert elp.token_logprobs[1:n_prompt] == pytest.approx(
        [v for v, _, _ in meta["input_token_logprobs"][1:]], abs=1e-4
    )
    assert len(elp.tokens) == n_prompt + 6
    assert echo.choices[0].text.endswith(ref["text"])


def test_chat_top_logprobs_and_response_format(client, engine):
    messages = [{"role": "user", "content": "top?"}]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = engine.generate(
        input_ids=ids,
        sampling_params={**GREEDY, "max_new_tokens": 5},
        return_logprob=True,
        top_logprobs_num=4,
        return_text_in_logprobs=True,
    )
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for item, want in zip(content, ref["meta_info"]["output_top_logprobs"]):
        assert [t.token for t in item.top_logprobs] == [s for _, _, s in want]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(
            [v for v, _, _ in want], abs=1e-4
        )
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
        "required": ["ok", "tag"],
    }
    for fmt in (
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        {"type": "json_object"},
    ):
        out = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=60,
            temperature=0,
            response_format=fmt,  # type: ignore[arg-type]
            logit_bias=NO_WHITESPACE,  # type: ignore[arg-type]
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        doc = json.loads(choice.message.content or "")
        assert isinstance(doc, dict)
        if fmt["type"] == "json_schema":
            assert isinstance(doc["ok"], bool) and doc["tag"] in ("a", "b")


def test_bad_grammar_is_a_400_naming_the_field(server):
    for body, param in (
        ({"regex": "(un"}, "regex"),
        ({"json_schema": '{"type": '}, "json_schema"),
        ({"ebnf": "root ::= missing"}, "ebnf"),
    ):
        r = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 3, **body},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "invalid grammar" in err["message"], err
    r = httpx.post(
        f"{server.base_url}/generate",
        json={"text": "x", "sampling_params": {"regex": "[z-a]"}},
        timeout=60,
    )
    assert r.status_code == 400 and "regex invalid grammar" in r.text


def test_bad_response_format_schema_names_response_format(server):
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": 3}},
            },
        },
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "invalid grammar" in err["message"], err


def test_streamed_logprobs_equal_the_whole_response(client):
    kw = {"model": "tiny", "prompt": "stream me", "max_tokens": 6, "temperature": 0}
    whole = client.completions.create(**kw, logprobs=2, echo=True).choices[0].logprobs
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list = []
    for chunk in client.completions.create(**kw, logprobs=2, echo=True, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
    assert tokens == whole.tokens and tops == whole.top_logprobs
    assert values[0] is None and values[1:] == pytest.approx(whole.token_logprobs[1:], abs=1e-6)
    chat_kw = {"model": "tiny", "messages": [{"role": "user", "content": "s"}], "max_tokens": 5}
    full = client.chat.completions.create(**chat_kw, temperature=0, logprobs=True, top_logprobs=2)
    streamed = []
    for chunk in client.chat.completions.create(
        **chat_kw, temperature=0, logprobs=True, top_logprobs=2, stream=True
    ):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed += choice.logprobs.content
    want = full.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in want]
    assert [[t.token for t in c.top_logprobs] for c in streamed] == [
        [t.token for t in c.top_logprobs] for c in want
    ]
