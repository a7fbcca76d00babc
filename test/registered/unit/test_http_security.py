"""Security helpers of the HTTP server: the API-key check (constant-time, any bytes), the
redaction of server error messages, bounded logging, and the connection limit under the
open-file limit."""

from __future__ import annotations

import hmac
import logging

import pytest
from sgl_dspark.srt.entrypoints import http_limits, http_server
from sgl_dspark.srt.entrypoints.api_errors import ApiError, error_body, redact
from sgl_dspark.srt.entrypoints.http_limits import RateLimitedLog, connection_limit
from sgl_dspark.srt.entrypoints.http_server import AUTH_EXEMPT_PATHS, bearer_matches


def test_bearer_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(http_server.hmac, "compare_digest", spy)
    assert bearer_matches(b"Bearer sk-123", "sk-123")
    assert bearer_matches(b"bearer  sk-123 ", "sk-123")
    assert not bearer_matches(b"Bearer sk-124", "sk-123")
    assert not bearer_matches(b"Bearer sk-12", "sk-123")
    assert calls == [(b"sk-123", b"sk-123")] * 2 + [(b"sk-124", b"sk-123"), (b"sk-12", b"sk-123")]


@pytest.mark.parametrize(
    "header",
    [b"", b"Bearer", b"Basic c2stMTIz", b"sk-123", b"Bearer \xff\xfe", "Bearer clé".encode()],
)
def test_malformed_or_non_ascii_authorization_never_raises(header):
    assert not bearer_matches(header, "sk-123")
    assert bearer_matches("Bearer clé".encode(), "clé")


def test_only_liveness_and_metrics_are_open():
    assert AUTH_EXEMPT_PATHS == {"/health", "/metrics"}


@pytest.mark.parametrize(
    ("message", "kept", "gone"),
    [
        (
            "internal error: OSError: [Errno 2] No such file: '/var/lib/models/w.bin'",
            "OSError: [Errno 2] No such file: '<path>'",
            "/var/lib",
        ),
        (
            "internal error: x\nTraceback (most recent call last):\n  File",
            "internal error: x",
            "File",
        ),
        ("Traceback (most recent call last):\n  File '/a/b.py'", "see the server log", "/a/b.py"),
        ("cannot open ~/.cache/tok.json", "cannot open <path>", ".cache"),
        ("C:\\Users\\me\\key.txt is missing", "<path> is missing", "Users"),
        ("ratio 1/2 at /v1 is fine", "ratio 1/2 at /v1 is fine", "<path>"),
    ],
)
def test_server_error_messages_carry_no_paths_or_tracebacks(message, kept, gone):
    out = redact(message)
    assert kept in out and gone not in out


def test_only_server_errors_are_redacted_and_bounded():
    assert error_body(400, "bad /a/b/c")["error"]["message"] == "bad /a/b/c"
    long = error_body(500, "x" * 5000)["error"]["message"]
    assert len(long) <= 500
    assert ApiError(503, "busy", retry_after=0.2).headers() == {"Retry-After": "1"}
    assert ApiError(413, "big", close=True).headers() == {"Connection": "close"}


def test_rate_limited_log_counts_every_event_and_logs_few_lines(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(http_limits.time, "monotonic", lambda: now[0])
    log = RateLimitedLog("refused", interval_s=10.0)
    with caplog.at_level(logging.WARNING, logger=http_limits.__name__):
        for _ in range(1000):
            log.note()
            now[0] += 0.01  # 1000 events in 10 s
        now[0] += 0.5
        log.note()
    assert log.total == 1001
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines == [
        "refused: 1 since the last report, 1 in all",
        "refused: 1000 since the last report, 1001 in all",
    ]


@pytest.mark.parametrize(
    ("requested", "files", "expected"),
    [(4096, 65535, 4096), (4096, 1024, 768), (100, 256, 100), (4096, 256, 192), (10, 16, 1)],
)
def test_connections_stay_below_the_open_file_limit(requested, files, expected):
    assert connection_limit(requested, files) == expected
