"""DSpark acceptance on GSM8K (zero-shot), every verify policy and block size, with controls.

    python -m benchmark.acceptance --model-path tiny-v41 --data test.jsonl --limit 16 \\
        --policies full,static:2,confidence --block-sizes 3,5 --temperatures 0,1 \\
        --max-new-tokens 128 --batch-size 8 --out runs/acceptance

Runs the questions through the offline `Engine` without speculation, then with DSpark for every
(policy, block size) and with the random-draft control (a draft of the same architecture with
random weights; full verify) for every block size, each at every temperature. Per run: the
acceptance length (pooled over requests, see `decode.py`), tokens generated, GSM8K accuracy, the
repetition-loop rate and the acceptance without looping outputs; for greedy runs the questions whose
DSpark output token ids differ from no-spec's (must be none) and the verdict of
`benchmark.gsm8k.compare` with `--require-identical`. The n-gram lookup control
(`ngram.py`) is computed exactly from the no-spec greedy outputs, per block size.

Writes to `--out`: `acceptance.json` (every number, the command, commit, device and date),
`acceptance.md` (a table fragment for `benchmark/results/acceptance.md`), `runs/<run>.jsonl` (one
record per question; `python -m benchmark.gsm8k.compare` reads them) and `tables/` (the width
tables and SPS table used). The confidence policy needs an SPS table of this device:
`--sps-table PATH`, or the script profiles one first (`sgl_dspark.tools.dspark_sps_profile`).

tok/s/user with and without DSpark (bs 1/8/32) is a serving measurement; see SPEED_NOTE.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import logging
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmark.ab import git_state
from benchmark.acceptance.configs import SpecConfig, parse_policy, spec_engine_kwargs
from benchmark.acceptance.decode import decode, summarise, token_mismatches, zero_shot_prompt
from benchmark.acceptance.drafts import draft_block_size, write_random_draft
from benchmark.acceptance.loops import loop_definition
from benchmark.acceptance.ngram import prompt_lookup_acceptance
from benchmark.acceptance.report import markdown_fragment
from benchmark.gsm8k.compare import compare_records, pooled_verdict
from benchmark.gsm8k.data import STOP_STRINGS, load_jsonl

logger = logging.getLogger(__name__)

SPEED_NOTE = (
    "measured through the server with `python -m benchmark.ab --metric tok_per_s_per_user "
    '--baseline-cmd "python -m sgl_dspark.launch_server --model-path M --port {port}" '
    '--candidate-cmd "python -m sgl_dspark.launch_server --model-path M '
    '--speculative-algorithm DSpark --port {port}" --aa --replicates 6 --runs-per-launch 3 '
    "--warmup-runs 1 --workload gsm8k:path=test.jsonl,out=256,conc=1,n=8 "
    "--workload gsm8k:path=test.jsonl,out=256,conc=8,n=64 "
    "--workload gsm8k:path=test.jsonl,out=256,conc=32,n=128 --output-dir DIR` (zero-shot GSM8K "
    "prompts at concurrency 1/8/32; tok/s/user = 1 / TPOT per request, paired over fresh "
    "launches); on CPU only the conc=1 workload"
)
NGRAM_DEFINITION = (
    "prompt-lookup decoding replayed on the no-spec greedy outputs: each step proposes up to "
    "`block` tokens that followed the most recent earlier occurrence of the context's last n "
    "tokens (n from {max} down to {min}), the target accepts the longest prefix equal to its "
    "greedy output plus one bonus token (`benchmark/acceptance/ngram.py`)."
)
ACCEPTANCE_DEFINITION = (
    "tokens committed per DSpark verify step (accepted drafts + the bonus token), pooled: sum of "
    "committed tokens / sum of verify steps over all requests, from each request's meta_info "
    "(`spec_accept_length` x `spec_verify_ct`); the first token of each output comes from the "
    "prefill and is in neither sum. `no loops`: the same over outputs that are not loops."
)


def _csv(text: str, kind: type) -> list[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", required=True, help="target directory or built-in name")
    p.add_argument("--draft-path", default=None, help="default: the target's own draft")
    p.add_argument("--data", required=True, help="GSM8K test .jsonl (question, answer)")
    p.add_argument("--limit", type=int, default=None, help="first N questions (default: all)")
    p.add_argument("--batch-size", type=int, default=32, help="requests running at once")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument(
        "--policies", default="full", help="comma list: full, static, static:W, confidence[:async]"
    )
    p.add_argument("--block-sizes", default="", help="comma list (default: the draft's own)")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--seed", type=int, default=0, help="engine seed; sampled question i: seed + i")
    p.add_argument(
        "--random-draft",
        default="auto",
        help="random-draft control: 'auto' (written to OUT/random_draft), a directory, or 'none'",
    )
    p.add_argument(
        "--random-draft-seed", type=int, default=1234, help="not a built-in draft's seed (1)"
    )
    p.add_argument(
        "--sps-table", default=None, help="confidence policy cost table (default: profile)"
    )
    p.add_argument("--ngram-max", type=int, default=3)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--loop-window", type=int, default=64)
    p.add_argument("--loop-max-period", type=int, default=16)
    p.add_argument(
        "--engine-args", default="{}", help='more Engine (ServerArgs) fields as JSON, e.g. {"x": 1}'
    )
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)
    args.policy_specs = [parse_policy(s) for s in args.policies.split(",") if s.strip()]
    args.block_size_list = _csv(args.block_sizes, int) or [None]
    args.temperature_list = _csv(args.temperatures, float)
    args.extra_engine_args = json.loads(args.engine_args)
    if not isinstance(args.extra_engine_args, dict):
        p.error("--engine-args must be a JSON object")
    if not args.temperature_list or any(t < 0 for t in args.temperature_list):
        p.error("--temperatures needs values >= 0")
    if any(b is not None and b < 1 for b in args.block_size_list):
        p.error("--block-sizes needs values >= 1")
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        p.error("--batch-size and --limit must be >= 1")
    return args


def _release(engine: Any) -> None:
    engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({torch.get_num_threads()} threads)"


def profile_sps_table(args: argparse.Namespace, block_size: int | None, path: Path) -> str:
    """An SPS table of this device for the confidence policy, by the profiling tool."""
    sizes = sorted({min(2**i, args.batch_size) for i in range(6)})
    cmd = [
        sys.executable,
        "-m",
        "sgl_dspark.tools.dspark_sps_profile",
        "--model-path",
        args.model_path,
        "--device",
        args.device,
        "--batch-sizes",
        ",".join(map(str, sizes)),
        "--out",
        str(path),
    ]
    if args.draft_path is not None:
        cmd += ["--speculative-draft-model-path", args.draft_path]
    if block_size is not None:
        cmd += ["--speculative-dspark-block-size", str(block_size)]
    logger.info("profiling an SPS table: %s", shlex.join(cmd))
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, check=True)
    return str(path)


def ngram_control(
    prompts: list[list[int]], greedy: list[dict[str, Any]], block_size: int, args: Any
) -> dict[str, Any]:
    totals = {"all": [0, 0], "no_loops": [0, 0]}
    for prompt, rec in zip(prompts, greedy):
        got = prompt_lookup_acceptance(
            prompt, rec["output_ids"], block_size, args.ngram_max, args.ngram_min
        )
        keys = ["all"] if rec["loop_period"] is not None else ["all", "no_loops"]
        for k in keys:
            totals[k][0] += got.committed
            totals[k][1] += got.steps
    ratio = {k: (c / s if s else None) for k, (c, s) in totals.items()}
    return {
        "block_size": block_size,
        "max_ngram": args.ngram_max,
        "min_ngram": args.ngram_min,
        "committed": totals["all"][0],
        "verify_steps": totals["all"][1],
        "accept_length": ratio["all"],
        "accept_length_no_loops": ratio["no_loops"],
    }


def _run_name(draft: str, policy: str, block: int | None, temperature: float) -> str:
    block_part = "" if block is None else f"_b{block}"
    return f"{draft}_{policy}{block_part}_T{temperature:g}".replace(" ", "-").replace(":", "")


def write_results(out: Path, result: dict[str, Any]) -> None:
    """`acceptance.json` and the markdown fragment, replaced whole (a reader never sees half a
    file): written after every run, so a run stopped at a time limit keeps the runs it finished
    (`meta.complete` says whether every configuration ran)."""
    for name, text in (
        ("acceptance.json", json.dumps(result, indent=2)),
        ("acceptance.md", markdown_fragment(result)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Every run of the measurement; `acceptance.json` is rewritten after each (`write_results`)."""
    from sgl_dspark import Engine

    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    rows = load_jsonl(args.data)[: args.limit]
    base = {
        "model_path": args.model_path,
        "device": args.device,
        "dtype": args.dtype,
        "random_seed": args.seed,
        "max_running_requests": args.batch_size,
        **args.extra_engine_args,
    }
    decode_kw = {
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "loop_window": args.loop_window,
        "loop_max_period": args.loop_max_period,
    }
    own_block = draft_block_size(args.model_path, args.draft_path)
    git = git_state(str(Path(__file__).resolve().parents[2]))
    meta: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmark.acceptance", *argv]),
        "commit": None if git is None else git["rev"][:12] + ("-dirty" if git["dirty"] else ""),
        "device": None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "model_path": args.model_path,
        "draft_path": args.draft_path,
        "draft_block_size": own_block,
        "random_draft_path": None,
        "data": args.data,
        "data_sha256": hashlib.sha256(Path(args.data).read_bytes()).hexdigest(),
        "questions": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "stop": list(STOP_STRINGS),
        "engine_args": {k: v for k, v in base.items() if k != "model_path"},
        "sps_table": None,
        "acceptance_definition": ACCEPTANCE_DEFINITION,
        "loop_definition": loop_definition(args.loop_window, args.loop_max_period),
        "ngram_definition": NGRAM_DEFINITION.format(max=args.ngram_max, min=args.ngram_min),
        "speed_command_note": SPEED_NOTE,
        "complete": False,
    }
    runs: list[dict[str, Any]] = []
    ngram: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    result = {"meta": meta, "runs": runs, "ngram_control": ngram, "skipped": skipped}
    baseline: dict[float, list[dict[str, Any]]] = {}  # no-spec records by temperature

    def add_run(draft: str, policy: str, block: int | None, t: float, recs, wall, spec) -> None:
        name = _run_name(draft, policy, block, t)
        path = out / "runs" / f"{name}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        run = {
            "name": name,
            "draft": draft,
            "policy": policy,
            "block_size": block,
            "temperature": t,
            "summary": summarise(recs, spec),
            "wall_s": wall,
            "per_question_file": str(path.relative_to(out)),
        }
        if spec and t == 0 and 0.0 in baseline:
            verdict = pooled_verdict([compare_records(baseline[0.0], recs)], require_identical=True)
            run["greedy_check"] = {
                **token_mismatches(baseline[0.0], recs),
                "answers_differing": verdict["differing_answers"],
                "compare_require_identical_passed": verdict["passed"],
            }
        runs.append(run)
        write_results(out, result)

    # 1. No speculation: the baseline of every greedy check and the n-gram control's outputs.
    engine = Engine(**base)
    meta["device"] = _device_name(engine.args.device)
    assert engine.tokenizer is not None
    prompts = [engine.tokenizer.encode(zero_shot_prompt(r["question"])) for r in rows]
    for t in args.temperature_list:
        recs, wall = decode(engine, rows, temperature=t, label="no-spec", **decode_kw)
        baseline[t] = recs
        if t == 0:  # the n-gram lookup control, exact from the greedy outputs
            for b in sorted({b or own_block for b in args.block_size_list}):
                ngram.append(ngram_control(prompts, recs, b, args))
        add_run("none", "no-spec", None, t, recs, wall, False)
    _release(engine)

    # 2. DSpark: the draft under test with every policy, the random draft with full verify.
    configs = [
        SpecConfig("draft", args.draft_path, p, b)
        for b in args.block_size_list
        for p in args.policy_specs
    ]
    if args.random_draft != "none":
        random_path = args.random_draft
        if random_path == "auto":
            random_path = write_random_draft(
                args.model_path, args.draft_path, out / "random_draft", args.random_draft_seed
            )
        meta["random_draft_path"] = random_path
        configs += [
            SpecConfig("random draft", random_path, parse_policy("full"), b)
            for b in args.block_size_list
        ]
    sps_table = args.sps_table
    if sps_table is None and any(c.policy.kind == "confidence" for c in configs):
        largest = max((b for b in args.block_size_list if b is not None), default=None)
        sps_table = profile_sps_table(args, largest, out / "tables" / "sps.json")
    meta["sps_table"] = sps_table
    for cfg in configs:
        block = cfg.block_size or own_block
        try:  # a configuration this target, draft or device cannot run is reported, not fatal
            engine = Engine(**base, **spec_engine_kwargs(cfg, out / "tables", sps_table, block))
        except ValueError as exc:
            skipped.append({"config": cfg.name, "reason": str(exc)})
            logger.warning("skipping %s: %s", cfg.name, exc)
            continue
        block = engine.spec.worker.gamma  # the block size that runs, as the engine resolved it
        for t in args.temperature_list:
            recs, wall = decode(engine, rows, temperature=t, label=cfg.name, **decode_kw)
            add_run(cfg.draft_label, cfg.policy.label, block, t, recs, wall, True)
        _release(engine)
    meta["complete"] = True
    write_results(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = measure(args, argv)
    print(markdown_fragment(result), flush=True)
    failed = [
        r["name"] for r in result["runs"] if r.get("greedy_check", {}).get("outputs_differing")
    ]
    if failed:
        logger.error("greedy DSpark outputs differ from no-spec in: %s", ", ".join(failed))
    return 1 if failed else 0
