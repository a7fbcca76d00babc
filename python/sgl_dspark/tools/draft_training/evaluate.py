"""Acceptance of a draft measured with the serving engine: greedy DSpark generation of held-out
prompts, the mean acceptance length over every verify step, and whether every output equals
the target's own greedy output (DSpark is lossless)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_dspark.srt.entrypoints.engine import Engine


@dataclass(frozen=True)
class AcceptanceResult:
    accept_length: float  # committed tokens per verify step, over all prompts
    verify_steps: int
    identical: bool  # every DSpark output equals the target-only greedy output
    prompts: int


def greedy_params(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def measure_acceptance(
    draft_dir: str,
    prompts: list[list[int]],
    reference: list[list[int]],
    max_new_tokens: int,
    engine_args: dict[str, Any],
) -> AcceptanceResult:
    """Greedy DSpark with the draft at `draft_dir` on `prompts`; `reference` is the target-only
    greedy output of each (`greedy_reference`)."""
    engine = Engine(
        **engine_args,
        speculative_algorithm="DSpark",
        speculative_draft_model_path=draft_dir,
    )
    outs = engine.generate(input_ids=prompts, sampling_params=greedy_params(max_new_tokens))
    assert isinstance(outs, list)
    committed = steps = 0
    for o in outs:
        meta = o["meta_info"]
        n = int(meta.get("spec_verify_ct", 0))
        steps += n
        committed += round(float(meta.get("spec_accept_length", 0.0)) * n)
    identical = [list(o["output_ids"]) for o in outs] == reference
    return AcceptanceResult(committed / max(steps, 1), steps, identical, len(prompts))


def greedy_reference(
    engine: Engine, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params=greedy_params(max_new_tokens))
    assert isinstance(outs, list)
    return [list(o["output_ids"]) for o in outs]
