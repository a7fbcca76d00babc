"""bench_serving: metrics on hand-made results, prompt sets, and runs against the fake server."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # repo root, for `benchmark`
sys.path.insert(0, str(HERE))

from fake_openai_server import running_fake  # noqa: E402

from benchmark import bench_serving  # noqa: E402
from benchmark.bench_serving import BenchConfig, run_benchmark  # noqa: E402
from benchmark.serving.client import (  # noqa: E402
    RequestResult,
    RequestSpec,
    _ChunkParser,
    send_request,
)
from benchmark.serving.datasets import gsm8k_requests, random_requests  # noqa: E402
from benchmark.serving.metrics import distribution, gauge_mean, parse_prometheus, summarize  # noqa: E402

FIXTURE = HERE / "data" / "gsm8k_mini"
ACCEPT = 2.5


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("fake") / "server.log"
    flags = [
        "--speculative-algorithm",
        "DSpark",
        "--speculative-dspark-simulate-accept-len",
        str(ACCEPT),
        "--delay-ms",
        "1",
    ]
    with running_fake(log, *flags) as url:
        yield url


def test_distribution_hand_values() -> None:
    d = distribution([i / 1000.0 for i in range(1, 101)])  # 1..100 ms
    assert (
        d["mean"] == pytest.approx(50.5)
        and d["min"] == pytest.approx(1.0)
        and d["max"] == pytest.approx(100.0)
    )
    assert (
        d["p50"] == pytest.approx(50.5)
        and d["p90"] == pytest.approx(90.1)
        and d["p99"] == pytest.approx(99.01)
    )
    assert all(math.isnan(v) for v in distribution([]).values())


def test_summarize_hand_values() -> None:
    # r1: 11 tokens, first at 0.1 s, last at 1.1 s -> TPOT 0.1 s; r2: 5 tokens, 0.2 -> 0.6 s -> TPOT 0.1 s.
    r1 = RequestResult(
        ok=True,
        prompt_tokens=7,
        output_tokens=11,
        ttft=0.1,
        latency=1.1,
        itl=[0.3, 0.7],
        accept_length=None,
        verify_ct=4,
    )
    r2 = RequestResult(
        ok=True, prompt_tokens=3, output_tokens=5, ttft=0.2, latency=0.6, itl=[0.4], verify_ct=4
    )
    bad = RequestResult(ok=False, error="HTTP 500: boom")
    s = summarize([r1, r2, bad], duration_s=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert s["output_throughput"] == pytest.approx(16 / 2.0) and s[
        "input_throughput"
    ] == pytest.approx(5.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0) and s["tok_per_s_per_user"][
        "mean"
    ] == pytest.approx(10.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert s["itl_ms"]["max"] == pytest.approx(700.0)
    assert s["accept_length"] == pytest.approx(16 / 8)  # token-weighted over verify steps


def test_chunk_parser_text_modes_and_errors() -> None:
    res = RequestResult()
    sg = _ChunkParser("sglang", res)
    # Cumulative text (SGLang's default), then a server that streams increments instead.
    assert sg.feed({"text": "Hello", "meta_info": {"completion_tokens": 1}}) == "Hello"
    assert sg.feed({"text": "Hello wor", "meta_info": {"completion_tokens": 2}}) == " wor"
    assert (
        sg.feed({"text": "ld", "meta_info": {"completion_tokens": 3, "spec_verify_ct": 2}}) == "ld"
    )
    assert sg.cumulative == "Hello world" and res.output_tokens == 3 and res.verify_ct == 2
    chat = _ChunkParser("openai-chat", RequestResult())
    assert chat.feed({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}) == "Hi"
    with pytest.raises(ValueError, match="server error"):
        chat.feed({"error": {"message": "out of memory"}})


def test_prometheus_parsing() -> None:
    text = (
        "# HELP sglang:spec_accept_length Average acceptance length\n"
        "# TYPE sglang:spec_accept_length gauge\n"
        'sglang:spec_accept_length{model_name="m",tp_rank="0"} 3.0\n'
        'sglang:spec_accept_length{model_name="m",tp_rank="1"} 3.5 1700000000\n'
        "sglang:num_running_reqs 4\n"
        "garbage line here\n"
    )
    samples = parse_prometheus(text)
    assert samples["sglang:num_running_reqs"] == [("", 4.0)]
    assert gauge_mean(text, "sglang:spec_accept_length") == pytest.approx(3.25)
    assert gauge_mean(text, "missing") is None


def test_random_requests_are_seeded_and_in_range() -> None:
    a = random_requests(20, 64, 32, seed=3, range_ratio=0.5, token_range=(100, 200))
    b = random_requests(20, 64, 32, seed=3, range_ratio=0.5, token_range=(100, 200))
    c = random_requests(20, 64, 32, seed=4, range_ratio=0.5, token_range=(100, 200))
    assert a == b and a != c
    for spec in a:
        assert isinstance(spec.prompt, list) and 32 <= len(spec.prompt) <= 64
        assert len(spec.prompt) == spec.prompt_len and 16 <= spec.output_len <= 32
        assert all(100 <= t < 200 for t in spec.prompt)
    fixed = random_requests(5, 10, 7, seed=0)
    assert {len(s.prompt) for s in fixed} == {10} and {s.output_len for s in fixed} == {7}
    words = random_requests(2, 10, 7, as_text=True)
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 10 for s in words)
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(2, 10, 7, range_ratio=0.0)


def test_gsm8k_requests_use_the_fixture() -> None:
    rows = [json.loads(line) for line in (FIXTURE / "test.jsonl").read_text().splitlines()]
    specs = gsm8k_requests(str(FIXTURE / "test.jsonl"), len(rows) + 2, 50)
    assert len(specs) == len(rows) + 2
    assert (
        specs[0].prompt == f"Question: {rows[0]['question']}\nAnswer:"
        and specs[-1].prompt == specs[1].prompt
    )
    assert specs[0].stop == ("Question", "</s>", "<|im_end|>") and not specs[0].ignore_eos
    shifted = gsm8k_requests(str(FIXTURE / "test.jsonl"), 3, 50, offset=len(rows) - 1)
    assert [s.prompt for s in shifted] == [
        specs[len(rows) - 1].prompt,
        specs[0].prompt,
        specs[1].prompt,
    ]


@pytest.mark.parametrize("backend", ["sglang", "openai", "openai-chat"])
def test_run_against_fake_server(spec_server: str, backend: str) -> None:
    cfg = BenchConfig(
        base_url=spec_server,
        backend=backend,
        num_prompts=6,
        input_len=12,
        output_len=20,
        max_concurrency=3,
        progress=False,
    )
    s = run_benchmark(cfg)
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["total_output_tokens"] == 6 * 20 and s["total_input_tokens"] == 6 * 12
    assert not s["output_tokens_estimated"]
    assert s["accept_length_metrics"] == pytest.approx(ACCEPT)
    # Only SGLang /generate carries per-request acceptance counters.
    assert (
        (s["accept_length"] == pytest.approx(ACCEPT))
        if backend == "sglang"
        else s["accept_length"] is None
    )
    assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p50"] > 0 and s["output_throughput"] > 0
    assert s["itl_ms"]["p50"] > 0


@pytest.mark.parametrize("backend", ["sglang", "openai", "openai-chat"])
def test_one_streamed_request_is_timed_per_chunk(spec_server: str, backend: str) -> None:
    async def go() -> RequestResult:
        async with httpx.AsyncClient(timeout=30.0) as client:
            prompt = "a b c d" if backend == "openai-chat" else [5, 6, 7, 8]
            return await send_request(client, spec_server, backend, "tiny", RequestSpec(prompt, 20))

    res = asyncio.run(go())
    assert res.ok and res.output_tokens == 20 and res.prompt_tokens == 4
    # Steps of 2, 3, 2, 3, ... tokens (mean ACCEPT = 2.5): 20 tokens arrive in 8 chunks -> 7 gaps.
    assert len(res.itl) == 7
    assert 0 < res.ttft <= res.latency and res.ttft + sum(res.itl) <= res.latency + 1e-9
    assert len(res.text.split()) == 20


def test_request_rate_and_unstreamed_mode(spec_server: str) -> None:
    cfg = BenchConfig(
        base_url=spec_server,
        backend="sglang",
        num_prompts=8,
        input_len=8,
        output_len=6,
        max_concurrency=None,
        request_rate=40.0,
        stream=False,
        progress=False,
        seed=5,
    )
    s = run_benchmark(cfg)
    gaps = np.random.default_rng(cfg.seed + 1).exponential(1 / 40.0, size=8)
    assert s["completed"] == 8 and s["total_output_tokens"] == 48
    assert (
        s["duration_s"] >= gaps[:-1].sum()
    )  # Poisson pacing: the last request starts after 7 gaps


def test_failures_are_counted_not_raised(spec_server: str) -> None:
    cfg = BenchConfig(
        base_url=spec_server + "/no-such-prefix",
        backend="sglang",
        num_prompts=3,
        input_len=4,
        output_len=4,
        warmup_requests=0,
        progress=False,
        scrape_metrics=False,
    )
    s = run_benchmark(cfg)
    assert s["completed"] == 0 and s["failed"] == 3 and s["errors"][0].startswith("HTTP 404")
    with pytest.raises(RuntimeError, match="warm-up"):
        run_benchmark(
            BenchConfig(base_url=spec_server + "/no-such-prefix", progress=False, num_prompts=1)
        )


def test_cli_writes_strict_json(spec_server: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    runs = bench_serving.main(
        [
            "--base-url",
            spec_server,
            "--backend",
            "openai",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--max-concurrency",
            "1",
            "4",
            "--num-prompts",
            "4",
            "--disable-progress",
            "--output-file",
            str(out),
        ]
    )
    data = json.loads(
        out.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}")
    )
    assert (
        [r["max_concurrency"] for r in data["runs"]]
        == [1, 4]
        == [r["max_concurrency"] for r in runs]
    )
    assert all(r["completed"] == 4 for r in data["runs"])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="backend"):
        BenchConfig(base_url="x", backend="grpc").validate()
    with pytest.raises(ValueError, match="dataset_path"):
        BenchConfig(base_url="x", dataset="gsm8k").validate()
    with pytest.raises(ValueError, match="max_concurrency"):
        BenchConfig(base_url="x", max_concurrency=0).validate()


def test_main_writes_json_and_plots(spec_server: str, tmp_path: Path) -> None:
    import matplotlib  # noqa: F401  (the test extra installs it)

    out = tmp_path / "bench.json"
    argv = ["--base-url", spec_server, "--backend", "sglang", "--input-len", "8"]
    argv += ["--output-len", "6", "--max-concurrency", "1", "2", "--num-prompts", "4"]
    bench_serving.main([*argv, "--output-file", str(out), "--disable-progress"])
    runs = json.loads(out.read_text())["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 2]
    assert all(len(r["e2e_latencies_ms"]) == 4 for r in runs)
    for name in ("bench.latency_cdf.png", "bench.throughput.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
