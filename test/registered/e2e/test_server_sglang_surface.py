"""SGLang 0.5.23's request surface: its routes under both spellings, the fields its clients send
(accepted, and the inert ones change nothing), prefill-only requests, unknown fields ignored as
SGLang ignores them, habitual launch flags, and 4xx responses logged with the request id."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from server_fixture import running_server

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
# What SGLang's frontend (`sglang.lang`) sends in every request's sampling_params.
FRONTEND_SAMPLING = {
    **GREEDY,
    "min_new_tokens": 0,
    "n": 1,
    "stop": [],
    "stop_token_ids": [],
    "stop_regex": [],
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "regex": None,
    "json_schema": None,
}
# Top-level /generate fields a router or SGLang client may send that change nothing here.
INERT_FIELDS = {
    "lora_path": None,
    "custom_logit_processor": None,
    "bootstrap_host": "10.0.0.1",
    "bootstrap_room": 7,
    "data_parallel_rank": 0,
    "extra_key": "k",
    "priority": 3,
    "custom_labels": {"team": "a"},
    "return_hidden_states": False,
    "an_unknown_field": {"x": 1},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("surface") / "server.log"
    os.environ.setdefault("SGL_DSPARK_CACHE", str(tmp_path_factory.mktemp("cache")))
    flags = ("--trust-remote-code", "--enable-metrics", "--log-requests", "--disable-radix-cache")
    flags += ("--reasoning-parser", "deepseek-r1")
    with running_server(log, "--context-length", "256", *flags) as s:
        yield s


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120, **kw)


def test_routes_in_both_spellings(server):
    base = server.base_url
    info = httpx.get(f"{base}/model_info", timeout=30).json()
    assert info == httpx.get(f"{base}/get_model_info", timeout=30).json()
    assert os.path.isfile(os.path.join(info["tokenizer_path"], "tokenizer.json"))
    assert info["model_path"] == "tiny" and info["model_dir"] == info["tokenizer_path"]
    assert os.path.isfile(os.path.join(info["model_dir"], "config.json"))
    server_info = httpx.get(f"{base}/server_info", timeout=30).json()
    assert set(server_info) == set(httpx.get(f"{base}/get_server_info", timeout=30).json())
    assert server_info["internal_states"][0]["avg_spec_accept_length"] is None  # no DSpark
    assert httpx.get(f"{base}/ready", timeout=30).status_code == 200
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{base}/flush_cache", timeout=30).status_code == 200
    card = httpx.get(f"{base}/v1/models/tiny", timeout=30).json()
    assert card["id"] == "tiny" and card["object"] == "model"
    missing = httpx.get(f"{base}/v1/models/other", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_sglang_fields_are_accepted_and_change_nothing(server):
    plain = _post(server, "/generate", {"text": "same output", "sampling_params": GREEDY})
    assert plain.status_code == 200, plain.text
    body = {"text": "same output", "sampling_params": FRONTEND_SAMPLING, **INERT_FIELDS}
    sglang = _post(server, "/generate", body)
    assert sglang.status_code == 200, sglang.text
    assert sglang.json()["output_ids"] == plain.json()["output_ids"]
    seeded = {"max_new_tokens": 8, "temperature": 0.9, "ignore_eos": True}
    a = _post(server, "/generate", {"text": "s", "sampling_params": {**seeded, "seed": 5}})
    b = _post(server, "/generate", {"text": "s", "sampling_params": {**seeded, "sampling_seed": 5}})
    assert a.json()["output_ids"] == b.json()["output_ids"]
    extras = {"lora_path": None, "min_tokens": 0, "extra_key": "k", "not_a_field": 1}
    c1 = _post(server, "/v1/completions", {"model": "tiny", "prompt": "p", **GREEDY})
    c2 = _post(server, "/v1/completions", {"model": "tiny", "prompt": "p", **GREEDY, **extras})
    assert c2.status_code == 200, c2.text
    assert c1.json()["choices"][0]["text"] == c2.json()["choices"][0]["text"]


def test_prefill_only_request(server):
    out = _post(server, "/generate", {"text": "cache me", "sampling_params": {"max_new_tokens": 0}})
    assert out.status_code == 200, out.text
    data = out.json()
    assert data["output_ids"] == [] and data["text"] == ""
    assert data["meta_info"]["prompt_tokens"] == len("cache me") + 1  # bytes + <bos>
    assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_chat_roles_and_tools(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = {"model": "tiny", "messages": messages, "tools": tools, "max_tokens": 4}
    out = _post(server, "/v1/chat/completions", body)
    assert out.status_code == 200, out.text
    usage = out.json()["usage"]
    no_tools = _post(server, "/v1/chat/completions", {**body, "tool_choice": "none"}).json()
    # The tools are rendered into the prompt (the template's tools line), unless tool_choice none.
    assert usage["prompt_tokens"] > no_tools["usage"]["prompt_tokens"]


def test_client_errors_are_logged_with_the_request_id(server):
    out = _post(
        server,
        "/generate",
        {"text": "a", "lora_path": "my-adapter"},
        headers={"X-Request-Id": "trace-4711"},
    )
    assert out.status_code == 400 and out.json()["error"]["param"] == "lora_path"
    assert out.headers["X-Request-Id"] == "trace-4711"
    assert "request trace-4711: POST /generate -> 400 (param lora_path)" in server.log()
    missing = httpx.get(f"{server.base_url}/no_such_route", headers={"X-Request-Id": "r-404"})
    assert missing.status_code == 404 and missing.headers["X-Request-Id"] == "r-404"
    assert "request r-404: GET /no_such_route" in server.log()
    # --log-requests logs each generation request by its id (one here: the test must not depend
    # on which other tests ran first on this server).
    done = _post(server, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}})
    assert done.status_code == 200
    assert "prompt tokens" in server.log() and "output tokens" in server.log()


def test_reasoning_parser_whole_and_streamed(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "think"}], **GREEDY}
    plain = _post(server, "/v1/chat/completions", {**body, "separate_reasoning": False}).json()
    text = plain["choices"][0]["message"]["content"]
    assert text and "reasoning_content" not in plain["choices"][0]["message"]
    # deepseek-r1 reasons until </think>, which the tiny model never writes.
    split = _post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert split["reasoning_content"] == text and split["content"] == ""
    reasoning, content = "", ""
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    assert (reasoning, content) == (text, "")
