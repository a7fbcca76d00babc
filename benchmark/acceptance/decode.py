"""Zero-shot GSM8K through the offline `Engine`, one record per question, and what a run's records
add up to.

Prompt: "Question: {q}\\nAnswer:" (no shots); generation stops at the GSM8K stop strings, EOS or the
token limit. Greedy runs use temperature 0; sampled runs seed question i with `seed + i`, so a
rerun draws the same samples.

Acceptance length (per verify step) = tokens a DSpark step commits (accepted drafts + the bonus
token) / verify steps, from each request's `meta_info` (`spec_accept_length` x `spec_verify_ct`),
pooled over requests: sum of committed tokens / sum of verify steps. The first output token comes
from the prefill and is in neither sum.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from benchmark.acceptance.loops import repetition_period
from benchmark.gsm8k.data import STOP_STRINGS, build_prompt
from benchmark.gsm8k.extract import extract_answer, is_correct, parse_ground_truth

logger = logging.getLogger(__name__)

# Prompts handed to one `Engine.generate` call: the engine keeps `--batch-size` of them running
# and admits the next as one finishes, so only the last few of each group run below the batch
# size; groups only bound how often progress is logged.
GROUP_BATCHES = 8


def zero_shot_prompt(question: str) -> str:
    return build_prompt("", question)


def sampling_params(
    temperature: float, max_new_tokens: int, seed: int, count: int, first_index: int
) -> list[dict[str, Any]]:
    """One sampling-parameter dict per question `first_index .. first_index + count - 1`."""
    base: dict[str, Any] = {
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "stop": list(STOP_STRINGS),
    }
    if temperature == 0:
        return [dict(base) for _ in range(count)]
    return [{**base, "seed": seed + first_index + i} for i in range(count)]


def record_of(
    index: int, row: dict[str, Any], out: dict[str, Any], loop_window: int, loop_max_period: int
) -> dict[str, Any]:
    """The per-question record (the fields `benchmark.gsm8k.compare` reads, plus token ids,
    DSpark counters and the loop check)."""
    meta = out["meta_info"]
    truth = parse_ground_truth(row["answer"])
    pred = extract_answer(out["text"])
    verify = int(meta.get("spec_verify_ct", 0))
    committed = round(float(meta.get("spec_accept_length", 0.0)) * verify)
    finish = meta.get("finish_reason") or {}
    return {
        "index": index,
        "question": row["question"],
        "truth": truth,
        "output": out["text"],
        "output_ids": list(out["output_ids"]),
        "pred": pred,
        "correct": is_correct(pred, truth),
        "prompt_tokens": int(meta["prompt_tokens"]),
        "completion_tokens": int(meta["completion_tokens"]),
        "finish": finish.get("type"),
        "verify_steps": verify,
        "committed": committed,
        "loop_period": repetition_period(out["output_ids"], loop_window, loop_max_period),
    }


def decode(
    engine: Any,
    rows: Sequence[dict[str, Any]],
    *,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    loop_window: int,
    loop_max_period: int,
    label: str = "",
) -> tuple[list[dict[str, Any]], float]:
    """Every question of `rows` through `engine`; returns (records in question order, wall
    seconds)."""
    records: list[dict[str, Any]] = []
    group = batch_size * GROUP_BATCHES
    start = time.perf_counter()
    for first in range(0, len(rows), group):
        part = rows[first : first + group]
        outs = engine.generate(
            prompt=[zero_shot_prompt(r["question"]) for r in part],
            sampling_params=sampling_params(temperature, max_new_tokens, seed, len(part), first),
        )
        records += [
            record_of(first + i, row, out, loop_window, loop_max_period)
            for i, (row, out) in enumerate(zip(part, outs))
        ]
        logger.info(
            "%s T=%g: %d/%d questions, %.1f s",
            label,
            temperature,
            len(records),
            len(rows),
            time.perf_counter() - start,
        )
    return records, time.perf_counter() - start


def pooled_accept_length(records: Sequence[dict[str, Any]]) -> float | None:
    verify = sum(r["verify_steps"] for r in records)
    return sum(r["committed"] for r in records) / verify if verify else None


def summarise(records: Sequence[dict[str, Any]], speculative: bool) -> dict[str, Any]:
    """Counts and rates of one run; acceptance only for speculative runs."""
    n = len(records)
    if n == 0:
        raise ValueError("no records to summarise")
    looping = [r for r in records if r["loop_period"] is not None]
    clean = [r for r in records if r["loop_period"] is None]
    out: dict[str, Any] = {
        "questions": n,
        "tokens": sum(r["completion_tokens"] for r in records),
        "correct": sum(bool(r["correct"]) for r in records),
        "accuracy": sum(bool(r["correct"]) for r in records) / n,
        "no_answer_rate": sum(r["pred"] is None for r in records) / n,
        "loops": len(looping),
        "loop_rate": len(looping) / n,
        "hit_token_limit_rate": sum(r["finish"] == "length" for r in records) / n,
    }
    if speculative:
        out.update(
            {
                "verify_steps": sum(r["verify_steps"] for r in records),
                "committed": sum(r["committed"] for r in records),
                "accept_length": pooled_accept_length(records),
                "accept_length_no_loops": pooled_accept_length(clean),
                "accept_length_loops_only": pooled_accept_length(looping),
            }
        )
    return out


def token_mismatches(
    baseline: Sequence[dict[str, Any]], candidate: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """Questions whose output token ids differ between two greedy runs, with the first differing
    position of each (at most 20 listed)."""
    if [r["index"] for r in baseline] != [r["index"] for r in candidate]:
        raise ValueError("the two runs do not hold the same questions")
    diffs = []
    for a, b in zip(baseline, candidate):
        x, y = a["output_ids"], b["output_ids"]
        if x != y:
            pos = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            diffs.append({"index": a["index"], "first_difference_at": pos})
    return {"outputs_differing": len(diffs), "examples": diffs[:20]}
