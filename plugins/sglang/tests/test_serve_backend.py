"""``sglang serve --model-type dspark``: SGLang's registry finds the backend, the command line is
translated (our flags kept, SGLang's mapped or refused by name), and the real CLI serves OpenAI
completions from sglang-dspark's server on CPU."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sgl_dspark_plugin import serve_backend
from sgl_dspark_plugin.argv_map import ArgvError, translate
from sgl_dspark_plugin.hooks import HOOKS

SGLANG_CLI = str(Path(sys.executable).with_name("sglang"))


@pytest.fixture(scope="module")
def parsers():
    return serve_backend.our_parser(), serve_backend.sglang_parser()


def _translate(argv, parsers):
    ours, sglang = parsers
    return translate(argv, ours, sglang, plugin_flags=[s.flag for s in HOOKS])


def test_registry_dispatches_dspark_to_this_backend():
    from sglang.cli.serve import _create_backend_registry
    from sglang.cli.serve_backends import ServeBackend

    registry = _create_backend_registry()
    assert "dspark" in registry.available_names
    registered = registry.get("dspark")
    assert isinstance(registered.backend, ServeBackend)
    assert registered.backend.run is serve_backend.run
    assert registered.distribution == "sglang-dspark-plugin"
    assert registered.backend.detect is None  # never chosen for --model-type auto


def test_our_flags_pass_through(parsers):
    argv = ["--model-path", "tiny", "--speculative-algorithm", "DSpark", "--device", "cpu"]
    argv += ["--port", "1234", "--speculative-dspark-verify-policy=static", "--disable-cuda-graph"]
    out = _translate(argv, parsers)
    assert out.argv == [*argv[:-2], "--speculative-dspark-verify-policy", "static", argv[-1]]
    assert out.notes == []


def test_sglang_flags_mapped_accepted_or_dropped(parsers):
    argv = ["--model-path", "tiny", "--dp-size", "1", "--trust-remote-code"]
    argv += ["--speculative-num-draft-tokens", "6", "--enable-dspark-greedy-argmax"]
    t = _translate(argv, parsers)
    assert t.argv == ["--model-path", "tiny", "--speculative-dspark-block-size", "5"]
    assert len(t.notes) == 4


def test_tensor_and_expert_parallel_flags_pass_through(parsers):
    argv = ["--model-path", "tiny", "--tp-size", "4", "--ep", "4", "--nnodes", "1"]
    assert _translate(argv, parsers).argv == argv
    t = _translate(["--model-path", "tiny", "--tensor-parallel-size", "2"], parsers)
    assert t.argv == ["--model-path", "tiny", "--tp-size", "2"]


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--pp-size", "2"], "--pp-size 2"),
        (["--dp-size=4"], "--dp-size 4"),
        (["--quantization", "fp8"], "--quantization"),
        (
            ["--speculative-num-draft-tokens", "6", "--speculative-dspark-block-size", "3"],
            "--speculative-num-draft-tokens 6",
        ),
    ],
)
def test_sglang_only_flags_refused_by_name(parsers, argv, named):
    with pytest.raises(ArgvError, match=named):
        _translate(["--model-path", "tiny", *argv], parsers)


def test_unknown_flag_left_for_our_parser(parsers):
    assert (
        _translate(["--model-path", "tiny", "--no-such-flag"], parsers).argv[-1] == "--no-such-flag"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_sglang_serve_answers_openai_completions(tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    argv = [SGLANG_CLI, "serve", "--model-type", "dspark", "--model-path", "tiny"]
    argv += ["--speculative-algorithm", "DSpark", "--device", "cpu", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            if "The server is ready." in (tmp_path / "server.log").read_text():
                break
            time.sleep(1)
        else:
            pytest.fail("no ready line:\n" + (tmp_path / "server.log").read_text())
        url = f"http://127.0.0.1:{port}/v1/completions"
        out = _post(url, {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        assert out["object"] == "text_completion"
        assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"]
        # Same greedy tokens as sglang-dspark's own CLI would give: the process IS that server.
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())
        assert models["data"][0]["id"] == "tiny"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (tmp_path / "server.log").read_text()


def test_sglang_serve_refuses_an_sglang_only_flag_by_name():
    proc = subprocess.run(
        [SGLANG_CLI, "serve", "--model-type", "dspark", "--model-path", "tiny", "--dp-size", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "--dp-size 8" in proc.stderr and "no data or pipeline parallelism" in proc.stderr
