"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


class ApiError(Exception):
    """An error answered with `status` and an OpenAI-style body (raised by route handlers)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The error as one server-sent event (for failures after a stream started)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": code if code is not None else str(status),
        }
    }
