"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

A server error's message (status >= 500) never carries a stack trace or a filesystem path: the
message is cut at its first line and absolute paths are replaced by `<path>` (the log keeps the
full story). A 503 carries `Retry-After` when the client may try again.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi.responses import JSONResponse

MAX_SERVER_ERROR_CHARS = 500
# Absolute POSIX paths (two or more components), home-relative and Windows drive paths.
_PATH = re.compile(r"(?<![\w.:/-])(?:~|[A-Za-z]:)?(?:[/\\][\w.@+~-]+){2,}[/\\]?")


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


def redact(message: str) -> str:
    """`message` fit for a client when the server failed: first line, no paths, bounded."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    if not first or first.startswith("Traceback"):
        return "internal error (see the server log)"
    first = _PATH.sub("<path>", first)
    if len(first) > MAX_SERVER_ERROR_CHARS:
        first = first[: MAX_SERVER_ERROR_CHARS - 3] + "..."
    return first


class ApiError(Exception):
    """An error answered with `status` and an OpenAI-style body (raised by route handlers).
    `retry_after`: seconds after which a refused client may try again (a `Retry-After` header);
    `close`: ask the client to close the connection (its request was not read to the end)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.close = close

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def headers(self) -> dict[str, str]:
        out = {}
        if self.retry_after is not None:
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        if self.close:
            out["Connection"] = "close"
        return out

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    def sse(self) -> str:
        """The error as one server-sent event (for failures after a stream started)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": redact(message) if status >= 500 else message,
            "type": error_type(status),
            "param": param,
            "code": code if code is not None else str(status),
        }
    }
