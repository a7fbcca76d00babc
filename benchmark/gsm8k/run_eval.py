"""5-shot GSM8K, greedy, against an OpenAI-compatible (/v1/completions) or SGLang /generate server.

    python -m benchmark.gsm8k.run_eval --base-url http://127.0.0.1:30000 --num-questions 1319 \
        --train-path train.jsonl --test-path test.jsonl --output-dir runs/gsm8k_baseline_1

Without --train-path/--test-path the public files are downloaded once into --data-dir.
Writes <output-dir>/per_question.jsonl (one record per question, in order) and summary.json.
Compare two runs with `python -m benchmark.gsm8k.compare`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm.asyncio import tqdm

from benchmark.gsm8k.data import (
    DEFAULT_DATA_DIR,
    STOP_STRINGS,
    build_prompt,
    download_default,
    fewshot_prefix,
    load_jsonl,
)
from benchmark.gsm8k.extract import extract_answer, is_correct, parse_ground_truth
from benchmark.serving.client import RequestSpec, first_model_id, send_request
from benchmark.serving.metrics import acceptance_length

logger = logging.getLogger(__name__)

PER_QUESTION_FILE = "per_question.jsonl"
SUMMARY_FILE = "summary.json"


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """One evaluation. `num_questions=-1` means the whole test file."""

    base_url: str
    train_path: str
    test_path: str
    backend: str = "openai"  # "openai" (/v1/completions) or "sglang" (/generate)
    model: str | None = None
    num_shots: int = 5
    num_questions: int = 200
    max_new_tokens: int = 512
    parallel: int = 64
    output_dir: str | None = None
    progress: bool = True
    timeout_s: float = 3600.0

    def validate(self) -> None:
        if self.backend not in ("openai", "sglang"):
            raise ValueError(f"backend must be 'openai' or 'sglang', got {self.backend!r}")
        if self.parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {self.parallel}")
        if self.num_questions == 0 or self.num_questions < -1:
            raise ValueError(f"num_questions must be -1 or >= 1, got {self.num_questions}")


async def _evaluate(cfg: EvalConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    test_rows = load_jsonl(cfg.test_path)
    if cfg.num_questions != -1:
        test_rows = test_rows[: cfg.num_questions]
    prefix = fewshot_prefix(load_jsonl(cfg.train_path), cfg.num_shots)
    specs = [
        RequestSpec(
            build_prompt(prefix, row["question"]),
            cfg.max_new_tokens,
            ignore_eos=False,
            stop=STOP_STRINGS,
        )
        for row in test_rows
    ]
    limits = httpx.Limits(
        max_connections=cfg.parallel + 2, max_keepalive_connections=cfg.parallel + 2
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        model = cfg.model or await first_model_id(client, cfg.base_url)
        sem = asyncio.Semaphore(cfg.parallel)

        async def one(spec: RequestSpec) -> Any:
            async with sem:
                return await send_request(
                    client, cfg.base_url, cfg.backend, model, spec, stream=False
                )

        start = time.perf_counter()
        results = await tqdm.gather(
            *(one(s) for s in specs), disable=not cfg.progress, desc="gsm8k"
        )
        duration = time.perf_counter() - start
    records = []
    for i, (row, res) in enumerate(zip(test_rows, results)):
        truth = parse_ground_truth(row["answer"])
        pred = extract_answer(res.text) if res.ok else None
        records.append(
            {
                "index": i,
                "question": row["question"],
                "truth": truth,
                "output": res.text,
                "pred": pred,
                "correct": is_correct(pred, truth),
                "ok": res.ok,
                "error": res.error,
                "latency_s": res.latency,
                "output_tokens": res.output_tokens,
            }
        )
    n = len(records)
    out_tokens = sum(r["output_tokens"] for r in records)
    summary = {
        "num_questions": n,
        "correct": sum(r["correct"] for r in records),
        "accuracy": sum(r["correct"] for r in records) / n,
        "invalid": sum(r["pred"] is None for r in records) / n,
        "failed": sum(not r["ok"] for r in records),
        "duration_s": duration,
        "output_throughput": out_tokens / max(duration, 1e-9),
        "accept_length": acceptance_length(results),
        "config": asdict(cfg),
    }
    return records, summary


def run_eval(cfg: EvalConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Runs the evaluation; writes per-question records and the summary when `output_dir` is set.

    Returns (records, summary); records are ordered by question index.
    """
    cfg.validate()
    records, summary = asyncio.run(_evaluate(cfg))
    if cfg.output_dir:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        with (out / PER_QUESTION_FILE).open("w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return records, summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", required=True)
    p.add_argument("--backend", choices=["openai", "sglang"], default="openai")
    p.add_argument("--model", default=None)
    p.add_argument("--train-path", default=None, help="few-shot source (default: download)")
    p.add_argument("--test-path", default=None, help="questions (default: download)")
    p.add_argument(
        "--data-dir", default=str(DEFAULT_DATA_DIR), help="where the default download goes"
    )
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--num-questions", type=int, default=200, help="-1 for all 1319")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--parallel", type=int, default=64)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--disable-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    train, test = args.train_path, args.test_path
    if train is None or test is None:
        default_train, default_test = download_default(Path(args.data_dir))
        train, test = train or str(default_train), test or str(default_test)
    cfg = EvalConfig(
        base_url=args.base_url,
        train_path=train,
        test_path=test,
        backend=args.backend,
        model=args.model,
        num_shots=args.num_shots,
        num_questions=args.num_questions,
        max_new_tokens=args.max_new_tokens,
        parallel=args.parallel,
        output_dir=args.output_dir,
        progress=not args.disable_progress,
    )
    _, summary = run_eval(cfg)
    accept = summary["accept_length"]
    print(
        f"accuracy {summary['accuracy']:.4f} ({summary['correct']}/{summary['num_questions']})  "
        f"invalid {summary['invalid']:.4f}  failed {summary['failed']}  "
        f"latency {summary['duration_s']:.2f} s  output tok/s {summary['output_throughput']:.1f}  "
        f"accept len {accept if accept is None else f'{accept:.3f}'}",
        flush=True,
    )
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
