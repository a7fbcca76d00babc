"""DSpark with DeepSeek-V4.1 targets is lossless (CPU, fp32):

* greedy: the built-in tiny-v41 pair and a random on-disk V4.1 target with a draft from the init
  tool give the target-only greedy output token for token, for every verify policy, block sizes
  1/3/5/7, batch sizes 1 and 4 (the bs-1 runtime with its own block size included), with requests
  ending mid-block; and with the graphs (`EagerGraph` stand-ins with CUDA-graph buffer
  semantics): the target's decode / verify / prefill graphs, the draft graphs, the acceptance
  graphs and the fused steps chained by the overlap schedule;
* sampling: the first three tokens with DSpark follow the target's distribution (chi-square on
  a 12-token vocabulary, a draft that disagrees often).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from sgl_dspark import Engine
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.layers.sampler import SamplingBatchInfo, processed_probs
from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from spec_utils import (
    POLICIES,
    policy_kwargs,
    write_policy_tables,
    write_random_draft,
    write_random_v41_target,
)

GAMMAS = (1, 3, 5, 7)
N_PROMPTS = 16


def _requests(seed: int, vocab: int) -> tuple[list[list[int]], list[dict]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(
            7, vocab, (int(torch.randint(1, 24, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(N_PROMPTS)
    ]
    params = [
        {
            "temperature": 0.0,
            "ignore_eos": True,
            "max_new_tokens": int(torch.randint(1, 14, (1,), generator=g)),
        }
        for _ in range(N_PROMPTS)
    ]
    return prompts, params


def _engine(graphs: bool = False, **kw) -> Engine:
    engine = Engine(device="cpu", skip_tokenizer_init=True, context_length=256, **kw)
    if graphs:
        engine.init_graphs(kw.get("max_running_requests", 4), 32, graph_factory=EagerGraph)
    return engine


def _run(prompts, params, graphs: bool = False, **kw) -> list[list[int]]:
    engine = _engine(graphs, **kw)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    pages = engine.runner.allocator
    assert pages.num_free_pages == pages.num_usable_pages  # every page came back
    engine.shutdown()
    return [o["output_ids"] for o in outs]


def _with_stop_tokens(reference: list[list[int]], params: list[dict]) -> list[dict]:
    """Every third request also stops on a token of its reference output (mid-block stop)."""
    out = []
    for i, (ref, p) in enumerate(zip(reference, params)):
        p = dict(p)
        if i % 3 == 0 and len(ref) > 2:
            p["stop_token_ids"] = [ref[len(ref) // 2]]
        out.append(p)
    return out


def _expected(reference: list[list[int]], params: list[dict]) -> list[list[int]]:
    exp = []
    for ref, p in zip(reference, params):
        stops = p.get("stop_token_ids", [])
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
        exp.append(ref[:cut])
    return exp


@pytest.fixture(scope="module")
def tiny_case():
    prompts, params = _requests(0, 263)
    ref = _run(prompts, params, model_path="tiny-v41")
    params = _with_stop_tokens(ref, params)
    return prompts, params, _expected(ref, params)


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("policy", POLICIES)
def test_tiny_v41_pair_greedy_lossless(tiny_case, tmp_path, gamma, policy):
    prompts, params, expected = tiny_case
    tables = write_policy_tables(str(tmp_path), gamma)
    for bs in (1, 4):
        got = _run(
            prompts,
            params,
            model_path="tiny-v41",
            max_running_requests=bs,
            speculative_algorithm="DSpark",
            speculative_dspark_block_size=gamma,
            **policy_kwargs(policy, tables),
        )
        assert got == expected, f"bs={bs}"


@pytest.mark.parametrize("policy", ["full", "static_table", "confidence_async"])
@pytest.mark.parametrize("overlap", [True, False])
def test_tiny_v41_pair_lossless_with_graphs(tiny_case, tmp_path, policy, overlap):
    """Every graph family, the fused steps when the overlap schedule chains them, and the bs-1
    runtime (its own block size) with its draft graph."""
    prompts, params, expected = tiny_case
    tables = write_policy_tables(str(tmp_path), 5)
    for bs, bs1_block in ((4, None), (1, 7)):
        engine = _engine(
            graphs=True,
            model_path="tiny-v41",
            max_running_requests=bs,
            speculative_algorithm="DSpark",
            speculative_dspark_block_size=5,
            speculative_dspark_bs1_block_size=bs1_block,
            disable_overlap_schedule=not overlap,
            **policy_kwargs(policy, tables),
        )
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == expected, f"bs={bs}"
        replays = engine.graphs.replays
        assert replays["prefill"] > 0
        spec = engine.spec
        if spec.fused is not None and policy != "confidence_async":
            assert replays["DSpark fused step"] > 0
        else:
            assert any(f.startswith("target width") for f in replays)
        engine.shutdown()


@pytest.fixture(scope="module")
def disk_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_v41_disk")
    target = write_random_v41_target(str(root / "target"), seed=4)
    prompts, params = _requests(1, 263)
    ref = _run(prompts, params, model_path=target)
    params = _with_stop_tokens(ref, params)
    return root, target, prompts, params, _expected(ref, params)


@pytest.mark.parametrize("gamma", (2, 6))
def test_tool_draft_greedy_lossless(disk_target, gamma):
    root, target, prompts, params, expected = disk_target
    draft = write_random_draft(target, str(root / f"draft_{gamma}"), block_size=gamma)
    tables = write_policy_tables(str(root), gamma)
    for policy, bs in (
        ("full", 3),
        ("static_table", 8),
        ("confidence_sync", 1),
        ("confidence_async", 8),
        ("static_online", 3),
    ):
        got = _run(
            prompts,
            params,
            model_path=target,
            max_running_requests=bs,
            speculative_algorithm="dspark",
            speculative_draft_model_path=draft,
            **policy_kwargs(policy, tables),
        )
        assert got == expected, f"policy={policy} bs={bs}"


# ---- sampling ---------------------------------------------------------------------------------
V = 12
N_SAMPLES = 12000
PROMPT = [5, 9, 4, 7]


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling_v41")
    # A 12-token vocabulary (no Engram: its map needs the byte tokenizer's vocabulary) and three
    # layers (window-only, ratio 2, ratio 1 with candidate blocks) to keep 12k requests quick.
    target = write_random_v41_target(
        str(root / "t"),
        seed=11,
        vocab_size=V,
        engram_layer_ids=[],
        num_hidden_layers=3,
        compress_ratios=[0, 2, 1],
        kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2],
        candidate_source_layer_id=2,
    )
    draft = write_random_draft(target, str(root / "d"), block_size=3, seed=12)
    # Sharpen the Markov head so the draft's proposals are confident and often wrong.
    from safetensors.torch import load_file, save_file

    path = str(root / "d" / "model.safetensors")
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("markov_head.head.weight"))
    tensors[key] = tensors[key] * 400.0
    save_file(tensors, path)
    return target, draft


def _exact_joint(engine: Engine, sp: SamplingParams) -> np.ndarray:
    """p(t1, t2, t3) for the prompt under the target with the sampler's processing."""
    runner = engine.runner
    seqs = (
        [PROMPT]
        + [PROMPT + [a] for a in range(V)]
        + [PROMPT + [a, b] for a in range(V) for b in range(V)]
    )
    slots = []
    try:
        for s in seqs:
            slots.append(runner.req_pool.alloc_slot())
            runner.req_pool.reserve(slots[-1], len(s))
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, seqs, [0] * len(seqs), slots, runner.req_pool.req_to_token
        )
        logits = runner.forward(batch).logits
    finally:
        for s in slots:
            runner.req_pool.free_slot(s)
    info = SamplingBatchInfo.from_params(
        [sp] * len(seqs), V, logits.device, counters=[0] * len(seqs)
    )
    p = processed_probs(logits, info).double().numpy()
    p1, p2, p3 = p[0], p[1 : 1 + V], p[1 + V :].reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def test_first_three_tokens_follow_the_v41_target(sampling_pair):
    """At temperature 1 (the sampler's top-k / top-p processing is the same code for every
    target; `test_dspark_sampling_lossless.py` covers it)."""
    target, draft = sampling_pair
    engine = Engine(
        model_path=target,
        skip_tokenizer_init=True,
        context_length=64,
        max_running_requests=1024,
        max_total_tokens=1024 * 64,
        speculative_algorithm="DSpark",
        speculative_draft_model_path=draft,
        random_seed=7,
    )
    # 4 new tokens: after token 1 the step verifies anchor + 2 drafts, so tokens 2 and 3 come
    # from one verify (accepted drafts, a correction, or the bonus).
    params = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True}
    outs = engine.generate(input_ids=[PROMPT] * N_SAMPLES, sampling_params=params)
    counts = np.zeros((V, V, V))
    for o in outs:
        t = o["output_ids"]
        assert len(t) == 4
        counts[t[0], t[1], t[2]] += 1
    summary = engine.spec.metrics.summary()
    assert summary.verified_drafts >= 2 * N_SAMPLES
    assert 0 < summary.correct_drafts < 0.75 * summary.verified_drafts  # >= 25% rejected
    expected = _exact_joint(engine, SamplingParams.from_dict({**params, "max_new_tokens": 3}))
    expected = expected * N_SAMPLES
    assert counts[expected == 0].sum() == 0, "sampled a sequence the target gives probability 0"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    keep = exp > 0
    p = chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue
    assert p > 0.01, f"chi-square p={p:.2e}"
    engine.shutdown()
