"""Serving load generator for OpenAI-compatible and SGLang `/generate` endpoints.

Examples:
    # random 4096-in / 1024-out prompts at concurrency 1, 8 and 32 against SGLang /generate
    python -m benchmark.bench_serving --base-url http://127.0.0.1:30000 --backend sglang \
        --dataset random --input-len 4096 --output-len 1024 --max-concurrency 1 8 32 \
        --output-file bench.json
    # GSM8K questions at a Poisson request rate of 4 req/s through /v1/completions
    python -m benchmark.bench_serving --base-url http://127.0.0.1:30000 --backend openai \
        --dataset gsm8k --dataset-path test.jsonl --request-rate 4 --num-prompts 200

Reports output tok/s, tok/s/user, TTFT, TPOT and ITL percentiles and the speculative acceptance
length (from the responses and from the server's /metrics gauge). Metric definitions:
`benchmark/serving/metrics.py`. With `--output-file X.json`, the latency CDF and the throughput
against concurrency are plotted beside it (`X.latency_cdf.png`, `X.throughput.png`; needs
matplotlib, the `bench` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm.asyncio import tqdm

from benchmark.serving.client import (
    BACKENDS,
    RequestResult,
    RequestSpec,
    first_model_id,
    send_request,
)
from benchmark.serving.datasets import gsm8k_requests, random_requests
from benchmark.serving.metrics import gauge_mean, json_safe, summarize
from benchmark.serving.plots import write_plots

logger = logging.getLogger(__name__)

ACCEPT_GAUGE = "sglang:spec_accept_length"


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One benchmark run. `max_concurrency=None` means unbounded; `request_rate=inf` sends all
    requests at once (then only `max_concurrency` paces them)."""

    base_url: str
    backend: str = "sglang"
    model: str | None = None
    dataset: str = "random"  # "random" or "gsm8k"
    dataset_path: str | None = None
    train_path: str | None = None
    num_shots: int = 0
    num_prompts: int = 16
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 1.0
    token_range: tuple[int, int] = (10, 1000)
    tokenizer: str | None = None
    ignore_eos: bool | None = None  # None: True for random prompts, False for GSM8K
    max_concurrency: int | None = 1
    request_rate: float = math.inf
    seed: int = 0
    prompt_offset: int = 0  # first GSM8K question used (random prompts vary with `seed`)
    warmup_requests: int = 1
    stream: bool = True
    scrape_metrics: bool = True
    accept_gauge: str = ACCEPT_GAUGE
    progress: bool = True
    timeout_s: float = 3600.0

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dataset not in ("random", "gsm8k"):
            raise ValueError(f"dataset must be 'random' or 'gsm8k', got {self.dataset!r}")
        if self.dataset == "gsm8k" and not self.dataset_path:
            raise ValueError("dataset 'gsm8k' needs dataset_path (a GSM8K test .jsonl)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")


def build_requests(cfg: BenchConfig) -> list[RequestSpec]:
    """The request list for `cfg`, deterministic in `cfg.seed`."""
    if cfg.dataset == "gsm8k":
        assert cfg.dataset_path is not None  # validate() checked
        return gsm8k_requests(
            cfg.dataset_path,
            cfg.num_prompts,
            cfg.output_len,
            train_path=cfg.train_path,
            num_shots=cfg.num_shots,
            ignore_eos=bool(cfg.ignore_eos),
            offset=cfg.prompt_offset,
        )
    tokenizer = None
    if cfg.tokenizer:
        from transformers import AutoTokenizer  # optional, heavy

        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    return random_requests(
        cfg.num_prompts,
        cfg.input_len,
        cfg.output_len,
        seed=cfg.seed,
        range_ratio=cfg.range_ratio,
        token_range=cfg.token_range,
        as_text=cfg.backend == "openai-chat",
        tokenizer=tokenizer,
        ignore_eos=cfg.ignore_eos is not False,
    )


async def _scrape_accept(client: httpx.AsyncClient, cfg: BenchConfig) -> float | None:
    try:
        resp = await client.get(cfg.base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError as exc:
        logger.info("no /metrics (%s)", exc)
        return None
    return gauge_mean(resp.text, cfg.accept_gauge) if resp.status_code == 200 else None


async def _fit_token_range(client: httpx.AsyncClient, cfg: BenchConfig) -> BenchConfig:
    """Random token ids must exist in the served vocabulary: when the server reports
    `vocab_size` (ours does, in /get_model_info), clamp the id range to it."""
    if cfg.dataset != "random":
        return cfg
    try:
        resp = await client.get(cfg.base_url.rstrip("/") + "/get_model_info")
        vocab = resp.json().get("vocab_size") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return cfg
    low, high = cfg.token_range
    if isinstance(vocab, int) and vocab < high:
        high = vocab
        low = min(low, high - 1)
        return dataclasses.replace(cfg, token_range=(low, high))
    return cfg


async def run_benchmark_async(
    cfg: BenchConfig, specs: list[RequestSpec] | None = None
) -> dict[str, Any]:
    """Runs warm-up, then all requests under the concurrency / rate limits; returns the summary
    (`benchmark.serving.metrics.summarize`) plus `accept_length_metrics` and the config."""
    cfg.validate()
    if cfg.ignore_eos is None:
        cfg = dataclasses.replace(cfg, ignore_eos=cfg.dataset == "random")
    n_conn = max(cfg.max_concurrency or cfg.num_prompts, 1) + 4
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        if specs is None:
            cfg = await _fit_token_range(client, cfg)
            specs = build_requests(cfg)
        model = cfg.model or await first_model_id(client, cfg.base_url)
        for i in range(cfg.warmup_requests):
            warm = dataclasses.replace(
                specs[i % len(specs)], output_len=min(16, specs[0].output_len)
            )
            res = await send_request(client, cfg.base_url, cfg.backend, model, warm, cfg.stream)
            if not res.ok:
                raise RuntimeError(f"warm-up request failed: {res.error}")
        sem = asyncio.Semaphore(cfg.max_concurrency or len(specs))
        bar = tqdm(total=len(specs), disable=not cfg.progress, desc=f"c={cfg.max_concurrency}")
        rng = np.random.default_rng(cfg.seed + 1)

        async def one(spec: RequestSpec) -> RequestResult:
            async with sem:
                out = await send_request(client, cfg.base_url, cfg.backend, model, spec, cfg.stream)
            bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(one(spec)))
            if math.isfinite(cfg.request_rate):
                # Poisson arrivals: exponential gaps with mean 1 / rate.
                await asyncio.sleep(float(rng.exponential(1.0 / cfg.request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        accept_metrics = await _scrape_accept(client, cfg) if cfg.scrape_metrics else None
    summary = summarize(results, duration)
    summary["accept_length_metrics"] = accept_metrics
    summary["max_concurrency"] = cfg.max_concurrency
    summary["request_rate"] = cfg.request_rate if math.isfinite(cfg.request_rate) else "inf"
    summary["config"] = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "tokenizer"}
    summary["config"]["request_rate"] = summary["request_rate"]
    return summary


def run_benchmark(cfg: BenchConfig, specs: list[RequestSpec] | None = None) -> dict[str, Any]:
    """Synchronous wrapper around `run_benchmark_async`."""
    return asyncio.run(run_benchmark_async(cfg, specs))


def format_summary(s: dict[str, Any]) -> str:
    """A short human-readable block for one run."""

    def pct(d: dict[str, float]) -> str:
        return f"mean {d['mean']:.2f}  p50 {d['p50']:.2f}  p90 {d['p90']:.2f}  p99 {d['p99']:.2f}"

    accept = s["accept_length"]
    gauge = s["accept_length_metrics"]
    return "\n".join(
        [
            f"== concurrency {s['max_concurrency']}, rate {s['request_rate']} ==",
            f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s",
            f"output tok/s {s['output_throughput']:.2f}  (input tok/s {s['input_throughput']:.2f})",
            f"tok/s/user   {pct(s['tok_per_s_per_user'])}",
            f"TTFT ms      {pct(s['ttft_ms'])}",
            f"TPOT ms      {pct(s['tpot_ms'])}",
            f"ITL ms       {pct(s['itl_ms'])}",
            f"accept len   responses {accept if accept is None else f'{accept:.3f}'}  "
            f"/metrics {gauge if gauge is None else f'{gauge:.3f}'}",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:30000")
    p.add_argument("--backend", choices=BACKENDS, default="sglang")
    p.add_argument(
        "--model", default=None, help="model name for OpenAI routes (default: first of /v1/models)"
    )
    p.add_argument("--dataset", choices=["random", "gsm8k"], default="random")
    p.add_argument("--dataset-path", default=None, help="GSM8K test .jsonl for --dataset gsm8k")
    p.add_argument("--train-path", default=None, help="GSM8K train .jsonl for --num-shots > 0")
    p.add_argument("--num-shots", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=None, help="default: max(8, 4 x concurrency)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--range-ratio", type=float, default=1.0, help="lengths uniform in [ratio*len, len]"
    )
    p.add_argument("--token-range", type=int, nargs=2, default=[10, 1000], metavar=("LOW", "HIGH"))
    p.add_argument("--tokenizer", default=None, help="HF tokenizer for text prompts (chat backend)")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force output-len tokens (default: on for random, off for gsm8k)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        default=None,
        help="one run per level, e.g. 1 8 32 (default: 1; with --request-rate: unbounded, so "
        "the arrival rate alone paces the requests)",
    )
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson req/s (default: inf)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    p.add_argument("--accept-gauge", default=ACCEPT_GAUGE)
    p.add_argument("--disable-progress", action="store_true")
    p.add_argument("--output-file", default=None, help="write all runs as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    runs = []
    levels: list[int | None] = args.max_concurrency or (
        [None] if math.isfinite(args.request_rate) else [1]
    )
    for conc in levels:
        cfg = BenchConfig(
            base_url=args.base_url,
            backend=args.backend,
            model=args.model,
            dataset=args.dataset,
            dataset_path=args.dataset_path,
            train_path=args.train_path,
            num_shots=args.num_shots,
            num_prompts=args.num_prompts or max(8, 4 * (conc or 1)),
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            token_range=tuple(args.token_range),
            tokenizer=args.tokenizer,
            ignore_eos=args.ignore_eos,
            max_concurrency=conc,
            request_rate=args.request_rate,
            seed=args.seed,
            warmup_requests=args.warmup_requests,
            stream=not args.no_stream,
            scrape_metrics=not args.no_metrics,
            accept_gauge=args.accept_gauge,
            progress=not args.disable_progress,
        )
        summary = run_benchmark(cfg)
        print(format_summary(summary), flush=True)
        runs.append(summary)
    if args.output_file:
        out = Path(args.output_file)
        out.write_text(json.dumps(json_safe({"runs": runs}), indent=2, default=str))
        for path in write_plots(runs, out):
            print(f"wrote {path}", flush=True)
    return runs


if __name__ == "__main__":
    main()
