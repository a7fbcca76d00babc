"""DSpark's sampled draft and acceptance graphs (`speculative/dspark/sampled_graphs.py`): a batch
with sampled rows (all sampled, or mixed with greedy ones) replays its draft proposal per batch
bucket and its acceptance per (verify width, bucket), and commits exactly the tokens and
logprobs of the eager draft and acceptance, step after step (the randomness keys are replay
inputs), through several buckets (the batch shrinks as requests finish; padding rows), with
and without top-k / top-p / min-p, under the verify policies, the bs1 runtime and simulated
acceptance.

On CPU the graphs are `EagerGraph` stand-ins with CUDA-graph buffer semantics (a replay rewrites
the capture's output tensors from its static inputs). The reference engine captures the same
target graphs and runs the draft and acceptance of sampled batches eagerly, so the two runs
differ only in those graphs. On a GPU the same comparison runs with real CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.layers.sampler import SamplingBatchInfo, processed_probs
from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from sgl_dspark.srt.speculative.dspark import sampled_graphs as sg
from spec_utils import policy_kwargs, write_policy_tables

N_REQUESTS = 7
GRAPH_BS = 6  # buckets 1, 2, 4, 6; 7 requests run eagerly until one finishes


def _requests(kind: str) -> tuple[list[list[int]], list[dict]]:
    """Seeded requests of different lengths (the batch shrinks through every bucket).
    `sampled`: all sampled, temperature only; `mixed`: two of them greedy; `filtered`: mixed,
    two sampled rows with top-k, top-p and min-p (the rest at the neutral values)."""
    g = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(7, 250, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(N_REQUESTS)
    ]
    params = []
    for i in range(N_REQUESTS):
        p: dict = {"max_new_tokens": 5 + 4 * i, "ignore_eos": True, "seed": 1000 + i}
        greedy = kind != "sampled" and i % 3 == 1
        p["temperature"] = 0.0 if greedy else 0.6 + 0.15 * i
        if kind == "filtered" and i == 2:
            p |= {"top_k": 12, "min_p": 0.02}
        if kind == "filtered" and i == 5:
            p["top_p"] = 0.7
        params.append(p)
    return prompts, params


def _generate(
    kind: str, sampled_graphs: bool, cuda: bool = False, **kw
) -> tuple[list, list, list, Engine]:
    """Output ids, logprobs and spec steps per request, and the engine; its `replayed` lists
    the (family, key) of every graph replay. `cuda`: real CUDA graphs (Triton kernels, fp32)."""
    device_kw: dict = (
        {"device": "cuda", "dtype": "float32", "kernel_backend": "triton"}
        if cuda
        else {"device": "cpu"}
    )
    engine = Engine(
        model_path="tiny",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=N_REQUESTS,
        speculative_algorithm="DSpark",
        **({"cuda_graph_max_bs": GRAPH_BS} if cuda else {}),
        **device_kw,
        **kw,
    )
    if not cuda:
        engine.init_graphs(GRAPH_BS, graph_factory=EagerGraph)
    if not sampled_graphs:
        engine.spec.sampled_graphs = None  # the eager draft and acceptance of sampled steps
    graphs = engine.graphs
    replayed: list[tuple[str, object]] = []
    real = graphs.replay

    def replay(family: str, key: object):
        replayed.append((family, key))
        return real(family, key)

    graphs.replay = replay  # type: ignore[method-assign]
    engine.replayed = replayed  # type: ignore[attr-defined]
    prompts, params = _requests(kind)
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    ids = [o["output_ids"] for o in outs]
    lps = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    steps = [o["meta_info"]["spec_verify_ct"] for o in outs]
    pages = engine.runner.allocator
    assert pages.num_free_pages == pages.num_usable_pages
    return ids, lps, steps, engine


def _families(engine: Engine, prefix: str) -> dict[str, set]:
    """Family -> the keys it replayed, for the families starting with `prefix`."""
    out: dict[str, set] = {}
    for family, key in engine.replayed:  # type: ignore[attr-defined]
        if family.startswith(prefix):
            out.setdefault(family, set()).add(key)
    return out


CASES = {
    # name: (request kind, engine kwargs, policy or None)
    "sampled": ("sampled", {"speculative_dspark_block_size": 4}, None),
    "mixed": ("mixed", {"speculative_dspark_block_size": 4}, None),
    "filtered": ("filtered", {"speculative_dspark_block_size": 4}, None),
    "static_table": ("mixed", {"speculative_dspark_block_size": 4}, "static_table"),
    "confidence_sync": ("mixed", {"speculative_dspark_block_size": 3}, "confidence_sync"),
    "confidence_async": ("sampled", {"speculative_dspark_block_size": 3}, "confidence_async"),
    "bs1_runtime": (
        "mixed",
        {"speculative_dspark_block_size": 2, "speculative_dspark_bs1_block_size": 5},
        None,
    ),
    "simulated": (
        "sampled",
        {"speculative_dspark_block_size": 4, "speculative_dspark_simulate_accept_len": 2.6},
        None,
    ),
}


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=cuda_only)], ids=["cpu", "cuda"])
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_graphs_equal_eager_draft_and_acceptance(tmp_path, case, cuda):
    kind, kw, policy = CASES[case]
    if policy is not None:
        gamma = kw["speculative_dspark_block_size"]
        kw = {**kw, **policy_kwargs(policy, write_policy_tables(str(tmp_path), gamma))}
    if cuda and policy == "confidence_async":
        # The async policy ranks every row's confidences against each other, so a last-bit
        # difference can move a cap, and a graph runs its bucket's padded batch where the eager
        # step runs the batch itself: outside the batch-invariant kernels the draft's
        # confidences can then differ in their last bits (by one fp32 ulp on the CPU here,
        # where no cap moves). With them, the padding changes no row's bits.
        kw = {**kw, "enable_deterministic_inference": True}
    ids, lps, steps, engine = _generate(kind, True, cuda, **kw)
    want_ids, want_lps, want_steps, eager = _generate(kind, False, cuda, **kw)
    assert ids == want_ids
    assert lps == want_lps  # the same floats: the same ops on the same values
    assert steps == want_steps
    # Several speculative steps per request: the output counters advanced between replays.
    assert all(s >= 2 for s in steps[1:]), steps
    assert not _families(eager, "DSpark sampled") and not _families(eager, "DSpark bs1 sampled")

    drafts = _families(engine, "DSpark sampled draft").get(sg.DRAFT_FAMILY, set())
    accepts = _families(engine, "DSpark sampled acceptance")
    filtered = {f for f in accepts if f.endswith("top-k/top-p/min-p")}
    # Padded and exact buckets (7 requests are past the largest bucket: eager at first).
    assert len(drafts) >= 3, drafts
    # Under the async confidence policy too: its on-device caps are a graph input.
    assert accepts
    assert bool(filtered) == (kind == "filtered"), accepts
    assert len(set().union(*accepts.values())) >= 2, accepts
    if case == "bs1_runtime":
        # The last sampled request decodes alone: the bs1 runtime's draft and full window.
        assert _families(engine, sg.BS1_DRAFT_FAMILY) == {sg.BS1_DRAFT_FAMILY: {1}}
        assert 1 in accepts.get(sg.ACCEPT_FAMILY.format(6), set()), accepts
    engine.shutdown()
    eager.shutdown()


def test_sampled_tokens_differ_from_greedy():
    """The graphed steps sample: the sampled requests' outputs are not the greedy ones."""
    kw = {"speculative_dspark_block_size": 4}
    ids, _, _, engine = _generate("sampled", True, **kw)
    prompts, params = _requests("sampled")
    greedy = engine.generate(
        input_ids=prompts, sampling_params=[{**p, "temperature": 0.0} for p in params]
    )
    assert sum(a != b["output_ids"] for a, b in zip(ids, greedy)) >= N_REQUESTS - 1
    engine.shutdown()


def test_filters_at_neutral_values_keep_the_bits():
    """The filtered acceptance graph runs every filter whatever the batch asks: a filter at its
    neutral value (top-k = V, top-p = 1, min-p = 0) leaves `processed_probs` bit-identical to
    the batch's own flags, for every combination of filters the batch asks for."""
    V = 97
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=g) * 3.0
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1.0  # a tie at the top
    combos = [{}, {"top_k": 7}, {"top_p": 0.8}, {"min_p": 0.1}, {"top_k": 20, "top_p": 0.9}]
    for combo in combos:
        params = [
            SamplingParams(temperature=0.5 + 0.2 * i, **(combo if i % 2 else {}))
            for i in range(logits.shape[0])
        ]
        params[0] = SamplingParams(temperature=0.0)
        info = SamplingBatchInfo.from_params(params, V, "cpu", counters=[0] * len(params))
        every = SamplingBatchInfo(
            **{
                **{f: getattr(info, f) for f in info.__dataclass_fields__},
                "need_top_k": True,
                "need_top_p": True,
                "need_min_p": True,
            }
        )
        assert torch.equal(processed_probs(logits, every), processed_probs(logits, info)), combo
