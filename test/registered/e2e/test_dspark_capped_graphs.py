"""The graphs under the async confidence policy, whose caps on accepted drafts are a device
tensor planned per step, commit what the eager capped acceptance commits, step for step:

* the acceptance graphs take the caps as an input (`verify_logits.graph_caps`): step by step
  (no overlap schedule), greedy and sampled requests mixed, acceptance graphed vs eager; both
  runs replay the same target and draft graphs, so they differ in the acceptance only;
* the fused step graphs compute the caps themselves (`ConfidencePolicy.device_caps`) from a
  budget the host planned: all-greedy steps chained by the overlap schedule vs the step-by-step
  schedule's separate draft, verify and acceptance graphs.

The shipped demo pair (a trained draft: its confidences vary and acceptance runs past the caps,
so the caps trim drafts) decodes GSM8K test prompts; graphs are `EagerGraph` stand-ins on the
CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph
from sgl_dspark.srt.speculative.dspark.accept import apply_cap
from sgl_dspark.srt.speculative.dspark.verify_logits import graph_caps
from spec_utils import policy_kwargs, write_policy_tables

PROMPTS = Path(__file__).resolve().parent / "data" / "gsm8k_test8" / "test.jsonl"
N_REQUESTS = 5
GRAPH_BS = N_REQUESTS  # buckets 1, 2, 4, 5: every step replays a graph
LONG_TOKENS = 160


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


def _generate(
    tmp_path,
    graphed_acceptance: bool,
    all_greedy: bool,
    overlap: bool = False,
    long_single: bool = False,
    cuda: bool = False,
):
    """Output ids, logprobs and verify steps per request, drafts trimmed by the caps, and the
    graph replays of the acceptance and fused step families. `long_single`: the first request
    alone, for LONG_TOKENS tokens. `cuda`: real CUDA graphs (fp32, batch-invariant kernels)."""
    gamma = 8  # the demo draft's block size
    device_kw: dict = (
        {
            "device": "cuda",
            "dtype": "float32",
            "enable_deterministic_inference": True,
            "cuda_graph_max_bs": GRAPH_BS,
        }
        if cuda
        else {"device": "cpu"}
    )
    engine = Engine(
        model_path="demo",
        context_length=512,
        max_running_requests=N_REQUESTS,
        speculative_algorithm="DSpark",
        disable_overlap_schedule=not overlap,
        **device_kw,
        **policy_kwargs("confidence_async", write_policy_tables(str(tmp_path), gamma)),
    )
    if not cuda:
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
    if long_single:
        prompts, params = prompts[:1], [{**params[0], "max_new_tokens": LONG_TOKENS}]
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
        [f for f in replayed if "acceptance" in f or "fused" in f],
    )


def _check(tmp_path, all_greedy: bool, cuda: bool) -> None:
    ids, lps, steps, trimmed, accept_replays = _generate(tmp_path, True, all_greedy, cuda=cuda)
    want_ids, want_lps, want_steps, want_trimmed, eager_replays = _generate(
        tmp_path, False, all_greedy, cuda=cuda
    )
    assert ids == want_ids
    assert lps == want_lps
    assert steps == want_steps
    assert trimmed == want_trimmed
    assert trimmed > 0  # the caps bind: the graphs' cap input is live
    assert accept_replays and not eager_replays
    sampled = [f for f in accept_replays if f.startswith("DSpark sampled")]
    assert bool(sampled) == (not all_greedy), set(accept_replays)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = pytest.mark.parametrize(
    "cuda", [False, pytest.param(True, marks=cuda_only)], ids=["cpu", "cuda"]
)


@DEVICES
def test_greedy_acceptance_graphs_take_the_caps(tmp_path, cuda):
    _check(tmp_path, all_greedy=True, cuda=cuda)


@DEVICES
def test_sampled_acceptance_graphs_take_the_caps(tmp_path, cuda):
    _check(tmp_path, all_greedy=False, cuda=cuda)


@DEVICES
def test_fused_steps_cap_as_the_separate_graphs(tmp_path, cuda):
    """One request, so both schedules plan the same batches. (Chained steps let a request that
    the step in flight finishes ride along in the next one: with more requests the budget's
    batches, and the relay's step count after a request ends, differ between the schedules.)

    The tokens, steps and trims are equal; so are the logprobs but for the last steps, which
    the step-by-step schedule verifies at a narrower graph width (widths clipped at
    max_new_tokens), a forward of another shape: within fp32 rounding there."""
    gamma = 8
    ids, lps, steps, trimmed, fused_replays = _generate(
        tmp_path, True, True, overlap=True, long_single=True, cuda=cuda
    )
    want_ids, want_lps, want_steps, want_trimmed, step_replays = _generate(
        tmp_path, True, True, long_single=True, cuda=cuda
    )
    assert ids == want_ids and len(ids[0]) == LONG_TOKENS
    assert steps == want_steps
    assert trimmed == want_trimmed
    assert trimmed > 0  # the caps bind: the graph's own caps are live
    assert lps[0][: -gamma - 1] == want_lps[0][: -gamma - 1]
    torch.testing.assert_close(torch.tensor(lps[0]), torch.tensor(want_lps[0]), rtol=0, atol=1e-5)
    assert set(fused_replays) == {"DSpark fused step"}
    assert step_replays and "DSpark fused step" not in step_replays


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
