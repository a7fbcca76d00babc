"""Reasoning and tool-call parsers of the DeepSeek formats, whole and streamed: a stream cut at
every position must give the same reasoning, content and calls as the whole text."""

from __future__ import annotations

import json

import pytest
from sgl_dspark.srt.entrypoints.chat_parsers import (
    ReasoningParser,
    ToolCallParser,
    thinking_requested,
)

DSML = "｜DSML｜"
V4_CALLS = (
    f'<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
    f'<{DSML}parameter name="city" string="true">San Francisco</{DSML}parameter>\n'
    f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n'
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="get_time">\n{{"zone": "PST"}}\n</{DSML}invoke>\n'
    f"</{DSML}tool_calls>"
)
V3_CALLS = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "San Francisco", "days": 3}\n```<｜tool▁call▁end｜>'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
    '{"zone": "PST"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
V31_CALLS = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "San Francisco", "days": 3}<｜tool▁call▁end｜>'
    '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "PST"}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>"
)
EXPECTED_CALLS = [
    ("get_weather", {"city": "San Francisco", "days": 3}),
    ("get_time", {"zone": "PST"}),
]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "parser, calls",
    [
        ("deepseekv4", V4_CALLS),
        ("deepseekv41", V4_CALLS),
        ("deepseekv32", V4_CALLS.replace("tool_calls>", "function_calls>")),
        ("deepseekv3", V3_CALLS),
        ("deepseekv31", V31_CALLS),
    ],
)
def test_tool_calls_whole_and_streamed(parser, calls):
    text = "Let me check. " + calls
    parsed = ToolCallParser(parser).parse(text)
    assert parsed.content == "Let me check."
    assert _calls(parsed.calls) == EXPECTED_CALLS
    for cut in range(len(text) + 1):
        p = ToolCallParser(parser)
        streamed = p.feed(text[:cut]) + p.feed(text[cut:])
        rest = p.finish()
        assert (streamed + rest.content).rstrip() == "Let me check.", cut
        assert _calls(rest.calls) == EXPECTED_CALLS, cut


def test_text_without_calls_and_broken_calls_stay_content():
    p = ToolCallParser("deepseekv4")
    assert p.parse("no calls <｜DSML｜ here").content == "no calls <｜DSML｜ here"
    broken = f'x <{DSML}tool_calls><{DSML}invoke name="f">{{not json</{DSML}invoke>'
    parsed = p.parse(broken)
    assert parsed.content == broken and parsed.calls == []
    # A held-back possible marker prefix is released at the end.
    s = ToolCallParser("deepseekv4")
    assert s.feed("abc <｜DS") == "abc "
    assert s.finish().content == "<｜DS"


@pytest.mark.parametrize(
    "name, thinking, text, reasoning, content",
    [
        ("deepseek-r1", False, "think hard</think>\n\nThe answer", "think hard", "The answer"),
        ("deepseek-r1", False, "<think>a</think>b", "a", "b"),
        ("deepseek-r1", False, "never closes", "never closes", ""),
        ("deepseek-v4", False, "plain answer", "", "plain answer"),
        ("deepseek-v4", False, "<think>why</think>so", "why", "so"),
        ("deepseek-v4", True, "why</think>so", "why", "so"),
        ("deepseek-v3", False, "<thin", "", "<thin"),
    ],
)
def test_reasoning_whole_and_streamed(name, thinking, text, reasoning, content):
    assert ReasoningParser(name, thinking).feed(text, final=True) == (reasoning, content)
    for cut in range(len(text) + 1):
        p = ReasoningParser(name, thinking)
        r1, c1 = p.feed(text[:cut])
        r2, c2 = p.feed(text[cut:], final=True)
        assert (r1 + r2, c1 + c2) == (reasoning, content), cut


def test_thinking_requested():
    assert thinking_requested({"thinking": True})
    assert thinking_requested({"enable_thinking": True})
    assert not thinking_requested(None) and not thinking_requested({"thinking": False})
