"""Property-based fuzzing of every field of `/generate`, `/v1/completions` and
`/v1/chat/completions` (Hypothesis, derandomized: the same examples on every run), against the
real server with and without DSpark, while a canary streams greedy requests.

Every answer must be a 2xx with a well-formed body, or a 4xx with an OpenAI-style error body:
any 5xx, a malformed answer, or no answer within REQUEST_TIMEOUT_S (a hang) fails. The canary's
greedy output must stay exactly what it was alone, whatever the fuzzed requests next to it carry.
The strategies name every field of the request models: a new field must be fuzzed too.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixture import running_server
from sgl_dspark.srt.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from sgl_dspark.srt.sampling.sampling_params import SamplingParams

CTX = 256
VOCAB = 512
REQUEST_TIMEOUT_S = 60.0
# Pooled connections expire before the server's keep-alive timeout (no reuse-close race).
LIMITS = httpx.Limits(keepalive_expiry=1.0)
EXAMPLES = 40  # per route and server: about half a minute of fuzzing per server on the CI box
SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # reproducible in CI: the examples depend only on the strategies
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# ---- hostile values ------------------------------------------------------------------------------
BIG = 2**70
huge_ints = st.sampled_from([-BIG, -(2**63), -1, 2**31, 2**63 - 1, 2**63, 2**64, BIG, 10**30])
odd_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-46, 5e-324, 1e-300, 1e300]),
)
unicode_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=24
)  # any code point a JSON string can carry
leaf = st.one_of(st.none(), st.booleans(), huge_ints, odd_floats, unicode_text)
nested = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(unicode_text, inner, max_size=3)
    ),
    max_leaves=8,
)
hostile = st.one_of(odd_floats, huge_ints, unicode_text, st.booleans(), nested)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly plausible, sometimes hostile; absent is handled by `bodies`."""
    return st.one_of(valid, valid, hostile)


small_float = st.floats(min_value=-0.5, max_value=2.5, allow_nan=False)
probability = st.one_of(st.floats(min_value=0.0, max_value=1.0), st.sampled_from([1e-46, 1e-300]))
token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 3))
token_ids = st.lists(token_id, min_size=0, max_size=12)
prompt_text = st.text(min_size=0, max_size=40)
stop = st.one_of(st.none(), unicode_text, st.lists(unicode_text, max_size=40))
max_tokens = st.one_of(st.integers(-2, 8), huge_ints)

SAMPLING_VALUES: dict[str, st.SearchStrategy] = {
    "max_new_tokens": max_tokens,
    "temperature": st.one_of(small_float, st.sampled_from([1e-7, 2e-6, 1e300])),
    "top_p": probability,
    "top_k": st.one_of(st.integers(-2, 600), huge_ints),
    "min_p": probability,
    "stop": stop,
    "stop_token_ids": st.lists(token_id, max_size=5),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "n": st.integers(0, 3),
    "seed": st.one_of(st.integers(0, 2**63 - 1), huge_ints),
    "frequency_penalty": small_float,
    "presence_penalty": small_float,
    "repetition_penalty": small_float,
    "min_new_tokens": st.one_of(st.integers(-1, 9), huge_ints),
    "logit_bias": st.dictionaries(
        st.one_of(st.integers(-1, VOCAB + 1).map(str), unicode_text), small_float, max_size=2
    ),
    "regex": st.sampled_from(["[a-c]{1,3}", "(x", "", "a|"]),
    "json_schema": st.sampled_from(['{"type": "object"}', "{bad", '{"type": "nope"}']),
    "ebnf": st.sampled_from(['root ::= "a"+', "root ::= b"]),
}
# (max_new_tokens always present: the default, 128, would make the fuzz slow)
fuzzed_sampling = st.fixed_dictionaries(
    {"max_new_tokens": max_tokens},
    optional={k: v for k, v in SAMPLING_VALUES.items() if k != "max_new_tokens"},
)
COMMON_OPENAI: dict[str, st.SearchStrategy] = {
    "model": st.one_of(st.just("tiny"), st.just("tiny"), unicode_text),
    "temperature": SAMPLING_VALUES["temperature"],
    "top_p": probability,
    "n": st.integers(0, 3),
    "stop": stop,
    "seed": SAMPLING_VALUES["seed"],
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": unicode_text,
    "frequency_penalty": small_float,
    "presence_penalty": small_float,
    "logit_bias": st.dictionaries(st.integers(0, 600).map(str), small_float, max_size=2),
    "top_k": SAMPLING_VALUES["top_k"],
    "min_p": probability,
    "repetition_penalty": small_float,
    "stop_token_ids": SAMPLING_VALUES["stop_token_ids"],
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json", "json_object"])}),
        st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries(
                    {"name": st.just("x")},
                    optional={"schema": st.sampled_from([{"type": "object"}, {"type": 3}])},
                ),
            }
        ),
    ),
    "min_tokens": st.integers(-1, 9),
    "regex": st.sampled_from(["[a-c]{1,3}", "(x"]),
    "ebnf": SAMPLING_VALUES["ebnf"],
}
name = st.one_of(st.sampled_from(["get_weather", "f"]), unicode_text)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": name},
            optional={
                "description": unicode_text,
                "parameters": st.just({"type": "object", "properties": {}}),
            },
        ),
    }
)
message = st.fixed_dictionaries(
    {
        "role": st.one_of(
            st.sampled_from(["system", "developer", "user", "assistant", "tool"]), unicode_text
        ),
        "content": st.one_of(
            prompt_text,
            st.none(),
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": prompt_text})),
        ),
    },
    optional={"name": unicode_text},
)
FIELDS: dict[str, dict[str, st.SearchStrategy]] = {
    "/v1/completions": {
        **COMMON_OPENAI,
        "prompt": st.one_of(
            prompt_text, st.lists(prompt_text, max_size=3), token_ids, st.lists(token_ids)
        ),
        "max_tokens": max_tokens,
        "logprobs": st.integers(-1, 6),
        "echo": st.booleans(),
        "suffix": prompt_text,
        "best_of": st.integers(0, 3),
        "json_schema": SAMPLING_VALUES["json_schema"],
    },
    "/v1/chat/completions": {
        **COMMON_OPENAI,
        "messages": st.lists(message, min_size=0, max_size=3),
        "max_tokens": max_tokens,
        "max_completion_tokens": max_tokens,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 21),
        "tools": st.lists(tool, max_size=2),
        "tool_choice": st.one_of(
            st.sampled_from(["none", "auto", "required"]),
            st.fixed_dictionaries(
                {"type": st.just("function"), "function": st.fixed_dictionaries({"name": name})}
            ),
        ),
        "parallel_tool_calls": st.booleans(),
        "chat_template_kwargs": st.dictionaries(unicode_text, st.booleans(), max_size=2),
        "separate_reasoning": st.booleans(),
        "stream_reasoning": st.booleans(),
        "continue_final_message": st.booleans(),
        "reasoning_effort": st.one_of(st.sampled_from(["low", "high"]), unicode_text),
    },
    "/generate": {
        "text": st.one_of(prompt_text, st.lists(prompt_text, max_size=3)),
        "input_ids": st.one_of(token_ids, st.lists(token_ids, max_size=3)),
        "sampling_params": st.one_of(fuzzed_sampling, st.lists(fuzzed_sampling, max_size=3)),
        "stream": st.booleans(),
        "return_logprob": st.booleans(),
        "rid": st.one_of(unicode_text, st.lists(unicode_text, max_size=3)),
        "return_text_in_logprobs": st.booleans(),
        "logprob_start_len": st.integers(-2, 3),
        "top_logprobs_num": st.integers(-1, 2),
        "token_ids_logprob": st.lists(st.one_of(token_id, huge_ints), max_size=3),
    },
}
MODELS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/generate": GenerateRequest,
}
# Whole bodies no field strategy produces: broken JSON, nesting past any parser's depth.
RAW_BODIES = [
    b"",
    b"{",
    b"null",
    b"[]",
    b'"x"',
    b'{"model": "tiny", "prompt": "a", "max_tokens": 1e999999}',
    b'{"model": "tiny", "prompt": "a", "temperature": NaN}',
    b'{"text": "a", "sampling_params": {"temperature": Infinity}}',
    b'{"model": "tiny", "prompt": "\xff\xfe"}',
    b'{"model": "tiny", "model": "tiny", "prompt": "dup"}',
    b'{"text": "a", "sampling_params": ' + b"[" * 20000 + b"]" * 20000 + b"}",
    b'{"model": "tiny", "messages": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
]


# Values every field accepts: a body made of them runs generation.
valid_stop = st.one_of(
    st.none(),
    st.text(min_size=1, max_size=4),
    st.lists(st.text(min_size=1, max_size=4), max_size=3),
)
VALID_SAMPLING: dict[str, st.SearchStrategy] = {
    "max_new_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.floats(0.0, 2.0), st.sampled_from([1e-7, 2e-6, 1e300])),
    "top_p": st.one_of(st.floats(1e-9, 1.0), st.sampled_from([1e-46, 5e-324, 1.0])),
    "top_k": st.one_of(st.just(-1), st.integers(1, 600), huge_ints.filter(lambda v: v > 0)),
    "min_p": st.one_of(st.floats(0.0, 1.0), st.sampled_from([1e-46, 1.0])),
    "stop": valid_stop,
    "stop_token_ids": st.lists(st.integers(0, VOCAB + 3), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "n": st.just(1),
    "seed": st.integers(0, 2**63 - 1),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.05, 2.0),
    "logit_bias": st.dictionaries(
        st.integers(0, VOCAB - 1).map(str), st.floats(-100.0, 100.0), max_size=3
    ),
    "regex": st.just("[a-c]{1,3}"),
}
VALID_OPENAI: dict[str, st.SearchStrategy] = {
    "temperature": st.floats(0.0, 2.0),
    "top_p": VALID_SAMPLING["top_p"],
    "n": st.integers(1, 3),
    "stop": valid_stop,
    "seed": VALID_SAMPLING["seed"],
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": unicode_text,
    "frequency_penalty": VALID_SAMPLING["frequency_penalty"],
    "presence_penalty": VALID_SAMPLING["presence_penalty"],
    "logit_bias": VALID_SAMPLING["logit_bias"],
    "top_k": VALID_SAMPLING["top_k"],
    "min_p": VALID_SAMPLING["min_p"],
    "repetition_penalty": VALID_SAMPLING["repetition_penalty"],
    "stop_token_ids": VALID_SAMPLING["stop_token_ids"],
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
}
VALID: dict[str, dict[str, st.SearchStrategy]] = {
    "/v1/completions": {
        **VALID_OPENAI,
        "max_tokens": st.integers(1, 8),
        "logprobs": st.integers(0, 5),
        "echo": st.booleans(),
        "suffix": st.none(),
        "best_of": st.none(),
    },
    "/v1/chat/completions": {
        **VALID_OPENAI,
        "max_completion_tokens": st.none(),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        "tools": st.lists(tool, max_size=1),
        "tool_choice": st.sampled_from(["none", "auto"]),
        "parallel_tool_calls": st.booleans(),
        "separate_reasoning": st.booleans(),
    },
    "/generate": {
        "stream": st.booleans(),
        "return_logprob": st.booleans(),
        "return_text_in_logprobs": st.booleans(),
        "logprob_start_len": st.integers(-1, 1),
        "top_logprobs_num": st.integers(0, 3),
        "token_ids_logprob": st.lists(st.integers(0, VOCAB - 1), max_size=2),
    },
}
# Fields that make a body plausible: with these, generation actually runs.
REQUIRED: dict[str, dict[str, st.SearchStrategy]] = {
    "/v1/completions": {"model": st.just("tiny"), "prompt": st.one_of(prompt_text, token_ids)},
    "/v1/chat/completions": {
        "model": st.just("tiny"),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": prompt_text}),
            min_size=1,
            max_size=2,
        ),
        "max_tokens": st.integers(1, 8),
    },
    "/generate": {
        "text": st.one_of(prompt_text, st.lists(prompt_text, min_size=1, max_size=3)),
        "sampling_params": st.fixed_dictionaries(
            {"max_new_tokens": VALID_SAMPLING["max_new_tokens"]},
            optional={k: v for k, v in VALID_SAMPLING.items() if k != "max_new_tokens"},
        ),
    },
}


def bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """A request body, one of four shapes: plausible (the required fields and valid values of
    others), plausible with one field anywhere in its fuzzed range, plausible with one hostile
    field, or anything (each field absent, null, in range or hostile, sometimes an unknown
    one)."""
    fields = FIELDS[path]
    plausible = st.fixed_dictionaries(REQUIRED[path], optional=VALID[path])
    one_hostile = st.tuples(plausible, st.sampled_from(sorted(fields)), hostile).map(
        lambda t: {**t[0], t[1]: t[2]}
    )
    one_odd = st.one_of(
        *(
            st.tuples(plausible, st.just(name), strategy).map(lambda t: {**t[0], t[1]: t[2]})
            for name, strategy in fields.items()
        )
    )
    optional = {name: st.one_of(st.none(), field(s)) for name, s in fields.items()}
    extra = st.dictionaries(unicode_text, hostile, max_size=1)
    anything = st.tuples(st.fixed_dictionaries({}, optional=optional), extra).map(
        lambda t: {**t[0], **t[1]}
    )
    return st.one_of(plausible, plausible, one_odd, one_hostile, anything)


def test_strategies_cover_every_field():
    for path, model in MODELS.items():
        assert set(FIELDS[path]) == set(model.model_fields), path
        assert set(VALID[path]) | set(REQUIRED[path]) <= set(FIELDS[path]), path
    sampling = {f for f in SamplingParams.__dataclass_fields__}
    assert set(SAMPLING_VALUES) == sampling


# ---- the canary ----------------------------------------------------------------------------------
CANARY = {
    "model": "tiny",
    "prompt": "the canary sings a long and steady song",
    "max_tokens": 48,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


def _stream_text(client: httpx.Client, body: dict) -> str:
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-2:]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


class Canary(threading.Thread):
    """Streams CANARY over and over until stopped; records every output and failure."""

    def __init__(self, base_url: str, reference: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.reference = reference
        self.stop = threading.Event()
        self.runs = 0
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(
            base_url=self.base_url, timeout=REQUEST_TIMEOUT_S, limits=LIMITS
        ) as client:
            while not self.stop.is_set():
                try:
                    text = _stream_text(client, CANARY)
                except Exception as exc:  # recorded, asserted by the test
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                self.runs += 1
                if text != self.reference:
                    self.failures.append(f"output changed: {text!r} != {self.reference!r}")


# ---- checking one answer -------------------------------------------------------------------------
def _check_answer(path: str, body: Any, response: httpx.Response, streamed: bool) -> None:
    status = response.status_code
    assert status < 500, f"{path} {body!r:.400} -> {status} {response.text[:400]}"
    content_type = response.headers.get("content-type", "")
    if status >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error" and err["message"], err
        assert "Traceback" not in err["message"]
        return
    if streamed and content_type.startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{path} {body!r:.300}: {events[-2:]}"
        for event in events[:-1]:
            decoded = json.loads(event)
            if "error" in decoded:  # an error after the stream started: never a server error
                assert int(decoded["error"]["code"]) < 500, decoded
        return
    decoded = response.json()
    if path == "/generate":
        outs = decoded if isinstance(decoded, list) else [decoded]
        for out in outs:
            ids = out["output_ids"]
            assert all(0 <= t < VOCAB for t in ids), out
            assert len(ids) == out["meta_info"]["completion_tokens"], out
    else:
        assert decoded["choices"], decoded
        assert decoded["usage"]["completion_tokens"] >= 0


def _send(client: httpx.Client, path: str, body: Any) -> int:
    if isinstance(body, bytes):
        content = body
        streamed = False
    else:
        content = json.dumps(body, allow_nan=True).encode()  # ASCII: non-ASCII as \u escapes
        streamed = isinstance(body, dict) and body.get("stream") is True
    start = time.monotonic()
    try:
        response = client.post(path, content=content, headers={"content-type": "application/json"})
    except httpx.TimeoutException:
        pytest.fail(f"{path} hung for {REQUEST_TIMEOUT_S:g} s: {body!r:.400}")
    assert time.monotonic() - start < REQUEST_TIMEOUT_S
    _check_answer(path, body, response, streamed)
    return response.status_code


# ---- the servers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["plain", "dspark"])
def fuzz_server(request, tmp_path_factory):
    args = ["--context-length", str(CTX), "--max-total-tokens", "8192"]
    if request.param == "dspark":
        args += ["--speculative-algorithm", "DSpark"]
    log = tmp_path_factory.mktemp(f"fuzz_{request.param}") / "server.log"
    with running_server(log, *args) as srv:
        with httpx.Client(
            base_url=srv.base_url, timeout=REQUEST_TIMEOUT_S, limits=LIMITS
        ) as client:
            reference = _stream_text(client, CANARY)
            canary = Canary(srv.base_url, reference)
            canary.start()
            yield srv, client
            canary.stop.set()
            canary.join(REQUEST_TIMEOUT_S)
        assert not canary.is_alive(), "the canary hung"
        assert canary.runs >= 1
        assert not canary.failures, canary.failures[:3]
        info = srv.wait_idle(60)
        assert info["kv_free_pages"] == info["kv_total_pages"]
        log_text = srv.log()
        assert "Traceback" not in log_text, log_text[-3000:]


def test_fuzzed_requests_never_fail_the_server_or_the_canary(fuzz_server):
    """All three routes and the raw bodies in one test per server, so a parallel test run
    starts each server once."""
    _, client = fuzz_server
    for path in FIELDS:
        statuses = _fuzz_route(client, path)
        # The fuzzer reaches generation, not only the validators.
        assert sum(s == 200 for s in statuses) >= len(statuses) // 5, (path, statuses)
        for raw in RAW_BODIES:
            _send(client, path, raw)


def _fuzz_route(client: httpx.Client, path: str) -> list[int]:
    """Send EXAMPLES fuzzed bodies to `path`; their statuses."""
    statuses: list[int] = []

    @SETTINGS
    @given(body=bodies(path))
    def fuzz(body: dict) -> None:
        statuses.append(_send(client, path, body))

    fuzz()
    return statuses


def test_the_strategies_reach_hostile_values():
    """The strategies do produce what the module doc promises (checked on generated examples,
    not on the server)."""
    seen: dict[str, bool] = {"nan": False, "huge": False, "null": False, "unicode": False}

    @settings(SETTINGS, max_examples=300)
    @given(body=bodies("/generate"))
    def look(body: dict) -> None:
        text = json.dumps(body, allow_nan=True)
        seen["nan"] |= "NaN" in text or "Infinity" in text
        seen["huge"] |= str(BIG) in text
        seen["null"] |= any(v is None for v in body.values())
        seen["unicode"] |= any(ord(c) > 0xFFFF for c in text) or "\\ud" in text
        if any(isinstance(v, float) and math.isnan(v) for v in body.values()):
            seen["nan"] = True

    look()
    assert all(seen.values()), seen
