"""Static width 1 = no speculation at that batch size: while the batch is that large the
scheduler runs plain decode steps (overlapped) that only commit the draft's context KV, and DSpark
resumes when the batch shrinks. Greedy output stays equal to decoding without DSpark."""

from __future__ import annotations

import json

import torch
from sgl_dspark import Engine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_width_one_runs_plain_decode_and_stays_lossless(tmp_path):
    table = tmp_path / "widths.json"
    table.write_text(json.dumps({"widths_by_batch_size": {"1": 3, "3": 1}}))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (7, 12, 5, 9)]
    # Different lengths: the batch shrinks from 4 (plain) to 2 and 1 (DSpark) as requests end.
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in (6, 9, 30, 40)]
    common = dict(
        model_path="tiny",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=8,
        device=DEVICE,
    )
    with Engine(**common) as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    with Engine(
        **common,
        speculative_algorithm="DSpark",
        speculative_dspark_verify_policy="static",
        speculative_dspark_width_table_path=str(table),
    ) as spec_engine:
        spec = spec_engine.spec
        calls = {"plain": 0, "spec": 0}
        decode_launch, spec_step = spec.decode.launch, spec.eager_step
        fused_launch = spec._launch_fused

        def count_plain(work, prev):
            calls["plain"] += not work.prefill
            return decode_launch(work, prev)

        def count_spec(reqs):
            calls["spec"] += 1
            return spec_step(reqs)

        def count_fused(reqs, width, prev):  # with CUDA graphs: fused step graphs
            calls["spec"] += 1
            return fused_launch(reqs, width, prev)

        spec.decode.launch = count_plain  # type: ignore[method-assign]
        spec.eager_step = count_spec  # type: ignore[method-assign]
        spec._launch_fused = count_fused  # type: ignore[method-assign]
        got = [
            o["output_ids"] for o in spec_engine.generate(input_ids=prompts, sampling_params=params)
        ]
    assert got == want
    assert calls["plain"] >= 4 and calls["spec"] >= 4, calls


def test_plain_decode_graphs_commit_draft_kv_like_eager(tmp_path):
    """With (stand-in) CUDA graphs the plain step is one decode-graph replay that also writes the
    draft's context KV (the decode executor's tap consumer, captured) and samples greedily inside the graph:
    tokens and the draft's context KV of every committed position equal the eager engine's, and
    greedy steps never run the sampler (eager steps pick through the logits reader, graphs
    inside the decode graph). Only committed positions are compared, when their
    request ends: a verify writes the context KV of every row it verifies, and the graphs verify
    a request's rows past its own (clipped) verify length where eager steps do not, so freed
    pages that a later request reuses differ; nothing reads such a position before a step
    commits and rewrites it. (Step by step: the overlap schedule lets a finished request ride
    along one step, so it is off here.)"""
    from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph

    table = tmp_path / "widths.json"
    table.write_text(json.dumps({"widths_by_batch_size": {"1": 3, "3": 1}}))
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (6, 11, 4, 8)]
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in (5, 8, 20, 26)]
    kw = dict(
        model_path="tiny",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=4,
        device="cpu",
        disable_overlap_schedule=True,
        speculative_algorithm="DSpark",
        speculative_dspark_verify_policy="static",
        speculative_dspark_width_table_path=str(table),
    )
    results = {}
    for graphs in (False, True):
        with Engine(**kw) as engine:
            spec = engine.spec
            if graphs:
                engine.init_graphs(4, graph_factory=EagerGraph)
            for pool in spec.worker.ctx_kv:
                pool.fill_(float("nan"))  # poison: every slot a request uses must be written
            calls = {"sampler": 0, "plain": 0, "picks": 0}
            # Each request's draft context KV at its committed positions, read when it ends
            # (later requests reuse its pages).
            committed: list[list[torch.Tensor]] = []
            done = spec.on_release

            def record_committed(
                req, _f=done, _c=committed, _pool=engine.runner.req_pool, _kv=spec.worker.ctx_kv
            ):
                slots = _pool.req_to_token[req.slot, : req.kv_len]
                assert bool((slots > 0).all())
                _c.append([p[slots].clone() for p in _kv])
                return _f(req)

            spec.on_release = record_committed  # type: ignore[method-assign]
            decode = spec.decode
            sampler_forward, launch = decode.sampler.forward, decode.launch
            reader = engine.runner.model.logits_reader
            pick = reader.greedy

            def count_picks(*a, _f=pick, _c=calls, **k):
                _c["picks"] += 1
                return _f(*a, **k)

            def count_sampler(*a, _f=sampler_forward, _c=calls):
                _c["sampler"] += 1
                return _f(*a)

            def count_plain(work, prev, _f=launch, _c=calls):
                _c["plain"] += not work.prefill
                return _f(work, prev)

            decode.sampler.forward = count_sampler  # type: ignore[method-assign]
            decode.launch = count_plain  # type: ignore[method-assign]
            reader.greedy = count_picks  # type: ignore[method-assign]
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            calls["decode replays"] = (
                engine.graphs.replays["target width 1"] if engine.graphs is not None else 0
            )
            assert len(committed) == len(prompts)
            results[graphs] = (
                [o["output_ids"] for o in outs],
                [torch.cat(per_layer) for per_layer in zip(*committed)],
                calls,
            )
    (eager_ids, eager_kv, eager_calls), (graph_ids, graph_kv, graph_calls) = (
        results[False],
        results[True],
    )
    assert graph_ids == eager_ids
    assert graph_calls["plain"] >= 4 and eager_calls["plain"] == graph_calls["plain"]
    # eager: every plain step picks through the reader; graphs: every plain step is one decode
    # graph replay (which picks inside; a verify clipped to one row replays it too); greedy
    # requests never run the sampler
    assert eager_calls["picks"] >= eager_calls["plain"]
    assert graph_calls["decode replays"] >= graph_calls["plain"]
    assert eager_calls["sampler"] == graph_calls["sampler"] == 0
    for e, gkv in zip(eager_kv, graph_kv):  # the pools were poisoned: all written, and equal
        assert not torch.isnan(e).any() and not torch.isnan(gkv).any()
        torch.testing.assert_close(gkv, e, rtol=1e-5, atol=1e-5)
