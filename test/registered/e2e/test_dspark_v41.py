"""DSpark with the built-in DeepSeek-V4.1 pair through the graphs (CPU, fp32, `EagerGraph`
stand-ins with CUDA-graph buffer semantics): the target's decode / verify / prefill graphs, the
draft graphs, the acceptance graphs and the fused steps chained by the overlap schedule, and the
bs-1 runtime with its own block size, give the target-only greedy output token for token.

Greedy equality without graphs and the sampling distribution with V4.1 targets are parametrised
over the target with the V4 cases: `test_dspark_greedy_lossless.py`,
`test_dspark_sampling_lossless.py`."""

from __future__ import annotations

import pytest
from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph
from spec_utils import (
    cpu_engine,
    expected_outputs,
    lossless_requests,
    policy_kwargs,
    run_greedy,
    with_stop_tokens,
    write_policy_tables,
)


@pytest.fixture(scope="module")
def tiny_case():
    prompts, params = lossless_requests(16, 0, 263)
    ref = run_greedy(prompts, params, model_path="tiny-v41")
    params = with_stop_tokens(ref, params)
    return prompts, params, expected_outputs(ref, params)


@pytest.mark.parametrize("policy", ["full", "static_table", "confidence_async"])
@pytest.mark.parametrize("overlap", [True, False])
def test_tiny_v41_pair_lossless_with_graphs(tiny_case, tmp_path, policy, overlap):
    """Every graph family, the fused steps when the overlap schedule chains them, and the bs-1
    runtime (its own block size) with its draft graph."""
    prompts, params, expected = tiny_case
    tables = write_policy_tables(str(tmp_path), 5)
    for bs, bs1_block in ((4, None), (1, 7)):
        engine = cpu_engine(
            model_path="tiny-v41",
            max_running_requests=bs,
            speculative_algorithm="DSpark",
            speculative_dspark_block_size=5,
            speculative_dspark_bs1_block_size=bs1_block,
            disable_overlap_schedule=not overlap,
            **policy_kwargs(policy, tables),
        )
        try:
            engine.init_graphs(bs, 32, graph_factory=EagerGraph)
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            assert [o["output_ids"] for o in outs] == expected, f"bs={bs}"
            replays = engine.graphs.replays
            assert replays["prefill"] > 0
            spec = engine.spec
            if spec.fused is not None:  # every policy here runs fused steps (overlap on)
                assert replays["DSpark fused step"] > 0
            else:
                assert any(f.startswith("target width") for f in replays)
        finally:
            engine.shutdown()
