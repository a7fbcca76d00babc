"""Chat output parsers of the DeepSeek formats: reasoning (`--reasoning-parser`) and tool calls
(`--tool-call-parser`), SGLang's parser names, for whole texts and for streams.

Reasoning: a thinking model writes `<think>reasoning</think>answer`. `deepseek-r1` always starts
in reasoning (the model may omit `<think>`); `deepseek-v3`, `deepseek-v4` and `deepseek-v41`
reason only when asked (`chat_template_kwargs` `thinking` / `enable_thinking` true: the template
opened the think block in the prompt) or when the output opens with `<think>`.

Tool calls (the text after the reasoning):

- `deepseekv4`, `deepseekv41` (and `deepseekv32` with `function_calls` for `tool_calls`), DSML:
  `<｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="p" string="true">v
  </｜DSML｜parameter>...</｜DSML｜invoke></｜DSML｜tool_calls>`, parameters given with
  `string="false"` are JSON values, and an invoke body may instead be one JSON object;
- `deepseekv3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}
  \\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>`; `deepseekv31`: the same without the type and the
  code fence (`<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`).

Text before the first tool-call marker is content; in a stream it is sent as it comes (a suffix
that may be the start of a marker is held back), and the calls are sent whole once the output
ends. A call that does not parse is returned as content, never dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
V3_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
V3_CALLS_END = "<｜tool▁calls▁end｜>"
V3_CALL_BEGIN = "<｜tool▁call▁begin｜>"
V3_CALL_END = "<｜tool▁call▁end｜>"
V3_SEP = "<｜tool▁sep｜>"

# The tool-call format of each served model type when --tool-call-parser is not given.
DEFAULT_TOOL_PARSER = {"deepseek_v4": "deepseekv4", "deepseek_v41": "deepseekv41"}


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def thinking_requested(chat_template_kwargs: dict[str, Any] | None) -> bool:
    kwargs = chat_template_kwargs or {}
    return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))


class ReasoningParser:
    """Splits reasoning from content, incrementally: `feed(delta)` -> (reasoning, content)."""

    def __init__(self, name: str, thinking: bool) -> None:
        self.in_reasoning = name == "deepseek-r1" or thinking
        self._undecided = not self.in_reasoning  # waiting to see whether output opens <think>
        self._strip_open = True  # an opening <think> is dropped in reasoning mode
        self._after_think = False
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        if self._undecided:
            stripped = self._buf.lstrip()
            if stripped.startswith(THINK_START):
                self._undecided = False
                self.in_reasoning = True
            elif THINK_START.startswith(stripped) and not final:
                return "", ""  # still a possible opening tag
            else:
                self._undecided = False
        if self.in_reasoning:
            if self._strip_open:
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._buf = stripped[len(THINK_START) :]
                    self._strip_open = False
                elif not (THINK_START.startswith(stripped) and not final):
                    self._strip_open = False
                else:
                    return "", ""
            end = self._buf.find(THINK_END)
            if end >= 0:
                reasoning = self._buf[:end]
                self._buf = self._buf[end + len(THINK_END) :]
                self.in_reasoning = False
                self._after_think = True
            else:
                keep = 0 if final else _held_back(self._buf, THINK_END)
                reasoning = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return reasoning, ""
        if self._after_think:  # the newlines that follow </think> belong to neither part
            self._buf = self._buf.lstrip("\n")
            self._after_think = not self._buf
        content, self._buf = self._buf, ""
        return reasoning, content


@dataclass
class ParsedCalls:
    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)


def _call(name: str, arguments: Any, index: int) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "index": index,
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


_DSML_INVOKE = re.compile(
    r"<" + DSML + r'invoke\s+name="([^"]+)"\s*>(.*?)</' + DSML + r"invoke>", re.DOTALL
)
_DSML_PARAM = re.compile(
    r"<"
    + DSML
    + r'parameter\s+name="([^"]+)"(?:\s+string="(true|false)")?\s*>(.*?)</'
    + DSML
    + r"parameter>",
    re.DOTALL,
)


def _parse_dsml(block: str) -> list[tuple[str, Any]]:
    calls = []
    for match in _DSML_INVOKE.finditer(block):
        name, body = match.group(1), match.group(2)
        params = list(_DSML_PARAM.finditer(body))
        if params:
            args: dict[str, Any] = {}
            for p in params:
                value = p.group(3)
                args[p.group(1)] = value if p.group(2) != "false" else json.loads(value.strip())
        else:
            args = json.loads(body.strip()) if body.strip() else {}
            if not isinstance(args, dict):
                raise ValueError("an invoke body must be a JSON object")
        calls.append((name, args))
    if not calls:
        raise ValueError("no invoke in the tool-call block")
    return calls


_V3_CALL = re.compile(
    re.escape(V3_CALL_BEGIN) + r"(.*?)" + re.escape(V3_SEP) + r"(.*?)" + re.escape(V3_CALL_END),
    re.DOTALL,
)


def _parse_v3(block: str, with_type: bool) -> list[tuple[str, Any]]:
    calls = []
    for match in _V3_CALL.finditer(block):
        head, body = match.group(1), match.group(2)
        if with_type:
            name, _, rest = body.partition("\n")
            fenced = re.fullmatch(r"\s*```(?:json)?\s*(.*?)\s*```\s*", rest, re.DOTALL)
            body = fenced.group(1) if fenced else rest
        else:
            name = head
        args = json.loads(body.strip())
        if not isinstance(args, dict):
            raise ValueError("tool-call arguments must be a JSON object")
        calls.append((name.strip(), args))
    if not calls:
        raise ValueError("no tool call in the block")
    return calls


class ToolCallParser:
    """Finds the tool calls of one chat output (`parse`), or of a stream (`feed` content as it
    comes, `finish` for the calls)."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name in ("deepseekv3", "deepseekv31"):
            self.start = V3_CALLS_BEGIN
        else:
            block = "function_calls" if name == "deepseekv32" else "tool_calls"
            self.start = f"<{DSML}{block}>"
        self._buf = ""
        self._in_calls = False
        self._count = 0

    def _parse_block(self, block: str) -> list[tuple[str, Any]]:
        if self.name == "deepseekv3":
            return _parse_v3(block, with_type=True)
        if self.name == "deepseekv31":
            return _parse_v3(block, with_type=False)
        return _parse_dsml(block)

    def parse(self, text: str) -> ParsedCalls:
        at = text.find(self.start)
        if at < 0:
            return ParsedCalls(text)
        try:
            calls = self._parse_block(text[at:])
        except (ValueError, json.JSONDecodeError):
            return ParsedCalls(text)
        return ParsedCalls(
            text[:at].rstrip(), [_call(name, args, i) for i, (name, args) in enumerate(calls)]
        )

    def feed(self, text: str) -> str:
        """Content to send now (text before the first tool-call marker)."""
        if self._in_calls:
            self._buf += text
            return ""
        self._buf += text
        at = self._buf.find(self.start)
        if at >= 0:
            content, self._buf = self._buf[:at], self._buf[at:]
            self._in_calls = True
            return content
        keep = _held_back(self._buf, self.start)
        content = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep :]
        return content

    def finish(self) -> ParsedCalls:
        """The calls of the stream, and content not sent yet (a held-back suffix, or a block
        that did not parse)."""
        rest, self._buf = self._buf, ""
        if not self._in_calls:
            return ParsedCalls(rest)
        return self.parse(rest)
