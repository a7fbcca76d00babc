"""The acceptance graphs under the async confidence policy, whose caps on accepted drafts are a
device tensor planned per step: the graphs take the caps as an input (`verify_logits.graph_caps`)
and commit what the eager capped acceptance commits, step for step.

The shipped demo pair (a trained draft: its confidences vary and acceptance runs past the caps,
so the caps trim drafts) decodes GSM8K test prompts, greedy and sampled requests mixed, once with
the acceptance graphs and once with the acceptance eager; both runs replay the same target and
draft graphs (`EagerGraph` stand-ins on the CPU), so they differ in the acceptance only."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sgl_dspark import Engine
from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph
from sgl_dspark.srt.speculative.dspark.accept import apply_cap
from sgl_dspark.srt.speculative.dspark.verify_logits import graph_caps
from spec_utils import policy_kwargs, write_policy_tables

PROMPTS = Path(__file__).resolve().parent / "data" / "gsm8k_test8" / "test.jsonl"
N_REQUESTS = 5
GRAPH_BS = N_REQUESTS  # buckets 1, 2, 4, 5: every step replays a graph


def _requests(tokenizer) -> tuple[list[list[int]], list[dict]]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][:N_REQUESTS]
    prompts = [tokenizer.encode(f"Question: {r['question']}\nAnswer:") for r in rows]
    params = []
    for i in range(N_REQUESTS):
        greedy = i % 2 == 0
        params.append(
            {
                "max_new_tokens": 24 + 8 * i,
                "ignore_eos": True,
                "temperature": 0.0 if greedy else 0.8,
                "seed": 70 + i,
            }
        )
    return prompts, params


def _generate(tmp_path, graphed_acceptance: bool, all_greedy: bool):
    """Output ids, logprobs and verify steps per request, drafts trimmed by the caps, and the
    acceptance graph replays."""
    gamma = 8  # the demo draft's block size
    engine = Engine(
        model_path="demo",
        device="cpu",
        context_length=512,
        max_running_requests=N_REQUESTS,
        speculative_algorithm="DSpark",
        **policy_kwargs("confidence_async", write_policy_tables(str(tmp_path), gamma)),
    )
    engine.init_graphs(GRAPH_BS, graph_factory=EagerGraph)
    spec = engine.spec
    assert spec.policy.caps_acceptance
    if not graphed_acceptance:
        spec.epilogue_graphs = {}
        assert spec.sampled_graphs is not None
        spec.sampled_graphs.accept = lambda *args: None  # no graph: the eager acceptance
    replayed: list[str] = []
    real = engine.graphs.replay

    def replay(family: str, key: object):
        replayed.append(family)
        return real(family, key)

    engine.graphs.replay = replay  # type: ignore[method-assign]
    prompts, params = _requests(engine.tokenizer)
    if all_greedy:
        params = [{**p, "temperature": 0.0} for p in params]
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    summary = spec.metrics.summary()
    trimmed = round(summary.block_accept_length * summary.request_steps) - (
        summary.committed_tokens
    )
    engine.shutdown()
    return (
        [o["output_ids"] for o in outs],
        [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs],
        [o["meta_info"]["spec_verify_ct"] for o in outs],
        trimmed,
        [f for f in replayed if "acceptance" in f],
    )


def _check(tmp_path, all_greedy: bool) -> None:
    ids, lps, steps, trimmed, accept_replays = _generate(tmp_path, True, all_greedy)
    want_ids, want_lps, want_steps, want_trimmed, eager_replays = _generate(
        tmp_path, False, all_greedy
    )
    assert ids == want_ids
    assert lps == want_lps
    assert steps == want_steps
    assert trimmed == want_trimmed
    assert trimmed > 0  # the caps bind: the graphs' cap input is live
    assert accept_replays and not eager_replays
    sampled = [f for f in accept_replays if f.startswith("DSpark sampled")]
    assert bool(sampled) == (not all_greedy), set(accept_replays)


def test_greedy_acceptance_graphs_take_the_caps(tmp_path):
    _check(tmp_path, all_greedy=True)


def test_sampled_acceptance_graphs_take_the_caps(tmp_path):
    _check(tmp_path, all_greedy=False)


def test_uncapped_step_gives_the_uncapped_bits():
    """A step the policy did not plan (the bs1 runtime) replays the capped graphs with caps of
    W - 1 drafts, which trim nothing: the acceptance of every row is the uncapped one."""
    g = torch.Generator().manual_seed(4)
    B, W = 6, 5
    verify_ids = torch.randint(0, 50, (B, W), generator=g)
    accept_len = torch.randint(0, W, (B,), generator=g)
    bonus = torch.randint(0, 50, (B,), generator=g)
    (caps,) = graph_caps(True, None, B, W, torch.device("cpu"))
    assert caps.tolist() == [W - 1] * B
    n, b, trim = apply_cap(verify_ids, accept_len, bonus, caps)
    assert torch.equal(n, accept_len) and torch.equal(b, bonus)
    assert trim.tolist() == [0] * B
    assert graph_caps(False, None, B, W, torch.device("cpu")) == ()
