"""On a GPU, a DSpark decode step (draft, Markov sampling, verify forward, acceptance, commit) runs
without a stream synchronisation until its results are read once at the end (no blocking host
sync inside the step), for DeepSeek-V4 (`tiny`) and DeepSeek-V4.1 (`tiny-v41`: Engram, the
quantised caches, the shared top-k and candidate blocks) targets, for a batch mixing greedy and
sampled requests and one whose requests all sample (one with top-p): both replay the sampled
draft and acceptance graphs. Uses CUDA's sync debug mode, which raises on synchronising calls.
The MoE family runs on Triton: the torch MoE backend reads expert counts on the host."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.speculative.dspark import executor as executor_mod
from sgl_dspark.srt.speculative.dspark import sampled_graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _params(batch: str, i: int):
    from sgl_dspark.srt.sampling.sampling_params import SamplingParams

    if batch == "mixed":
        return SamplingParams(max_new_tokens=40, temperature=0.0 if i % 2 else 0.8, ignore_eos=True)
    return SamplingParams(
        max_new_tokens=40,
        temperature=0.7 + 0.1 * i,
        top_p=0.9 if i == 2 else 1.0,
        seed=10 + i,
        ignore_eos=True,
    )


@pytest.mark.parametrize("batch", ["mixed", "sampled"])
@pytest.mark.parametrize("model", ["tiny", "tiny-v41"])
@pytest.mark.parametrize("policy", ["full", "static_table"])
def test_dspark_step_has_no_sync_before_the_result_read(
    tmp_path, policy, model, batch, monkeypatch
):
    import json

    widths = tmp_path / "w.json"
    widths.write_text(json.dumps({"widths_by_batch_size": {"1": "full", "4": 3}}))
    extra = (
        {}
        if policy == "full"
        else {
            "speculative_dspark_verify_policy": "static",
            "speculative_dspark_width_table_path": str(widths),
        }
    )
    engine = Engine(
        model_path=model,
        device="cuda",
        dtype="bfloat16",
        context_length=256,
        speculative_algorithm="DSpark",
        kernel_backend="torch",
        kernel_backend_overrides="moe=triton",
        **extra,
    )
    sched = engine.scheduler
    from sgl_dspark.srt.core.req import Req

    reqs = [
        Req(rid=str(i), prompt_ids=[5 + i, 6, 7, 8], params=_params(batch, i)) for i in range(4)
    ]
    for r in reqs:
        sched.add(r)
    while not all(r.prefill_done and r.output_ids for r in reqs):
        sched.step()
    sched.step()  # warm-up: Triton compilation, pinned-memory pools
    torch.cuda.synchronize()

    real_to_host = executor_mod._to_host
    reads = []

    def guarded_to_host(*tensors):
        # the designated read at the end of the step: leave the debug mode for it
        torch.cuda.set_sync_debug_mode(0)
        reads.append(len(tensors))
        return real_to_host(*tensors)

    monkeypatch.setattr(executor_mod, "_to_host", guarded_to_host)
    before = dict(engine.graphs.replays)
    for _ in range(3):
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.spec.eager_step(list(sched.running.values()))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert reads == [5, 5, 5]
    # The steps replayed the sampled draft and acceptance graphs (those are what ran sync-free).
    replays = {f: n - before.get(f, 0) for f, n in engine.graphs.replays.items()}
    assert replays.get(sampled_graphs.DRAFT_FAMILY) == 3, replays
    # (the all-sampled batch has a top-p row: the filtered acceptance graphs)
    kind = (
        sampled_graphs.FILTERED_ACCEPT_FAMILY
        if batch == "sampled"
        else sampled_graphs.ACCEPT_FAMILY
    )
    widths = engine.spec.worker.graph_verify_widths()
    assert sum(replays.get(kind.format(w), 0) for w in widths) == 3, replays
