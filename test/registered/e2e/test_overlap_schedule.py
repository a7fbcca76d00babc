"""The overlap schedule (decode step N+1 launched from step N's tokens on the device before the
host reads step N) changes when the host reads, never what is computed: outputs, logprobs and
finish reasons equal the step-by-step schedule, with requests stopping at different steps,
joining mid-decode, being aborted, and sampling with seeds."""

from __future__ import annotations

import torch
from sgl_dspark import Engine
from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.entrypoints.logprob_format import LogprobOptions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(overlap: bool) -> Engine:
    return Engine(
        model_path="tiny",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=8,
        device=DEVICE,
        disable_overlap_schedule=not overlap,
    )


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(5, 200, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def _summary(out: dict) -> tuple:
    return out["output_ids"], out["meta_info"]["finish_reason"]


def _logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def test_greedy_and_seeded_outputs_equal_step_by_step():
    prompts = _prompts(5, seed=1)
    with _engine(False) as ref_engine:
        free = ref_engine.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True},
        )
        # Stop tokens taken from the free run, so requests stop at different steps.
        params = [
            {
                "max_new_tokens": n,
                "temperature": 0.0,
                "ignore_eos": True,
                "stop_token_ids": [o["output_ids"][k]],
            }
            for o, n, k in zip(free, (1, 9, 24, 17, 30), (0, 3, 20, 6, 2))
        ]
        params.append(
            {"max_new_tokens": 15, "temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": True}
        )
        prompts_all = prompts + _prompts(1, seed=2)
        want = ref_engine.generate(
            input_ids=prompts_all, sampling_params=params, return_logprob=True
        )
    with _engine(True) as engine:
        calls = []
        orig = engine.executor.launch

        def count_chained(work, prev):
            if prev is not None:
                calls.append(1)
            return orig(work, prev)

        engine.executor.launch = count_chained  # type: ignore[method-assign]
        got = engine.generate(input_ids=prompts_all, sampling_params=params, return_logprob=True)
    assert len(calls) > 10  # the overlapped path ran
    assert [_summary(o) for o in got] == [_summary(o) for o in want]
    # A request that finished at step N still rides along in step N+1 (dropped when read), so
    # some steps run a different batch size; the CPU GEMMs are not batch invariant in the last
    # bits, hence logprobs to a tolerance (tokens, above, exactly).
    for g, w in zip(got, want):
        torch.testing.assert_close(_logprobs(g), _logprobs(w), rtol=1e-5, atol=1e-5)
    lengths = {len(o["output_ids"]) for o in got}
    assert len(lengths) >= 4, lengths  # requests really stopped at different steps


def _drive(
    engine: Engine,
    prompts: list[list[int]],
    join_at: int,
    abort_at: int,
) -> dict[str, list[int]]:
    """Two requests decode; a third joins at step `join_at`; the first is aborted at step
    `abort_at`. Returns every request's tokens."""
    sched = engine.scheduler
    params = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
    reqs: list[Req] = [engine._make_req(p, params, LogprobOptions()) for p in prompts]
    sched.add(reqs[0])
    sched.add(reqs[1])
    step = 0
    while any(not r.finished for r in reqs) or step <= join_at:
        if step == join_at:
            sched.add(reqs[2])
        if step == abort_at:
            assert sched.abort(reqs[0].rid) is reqs[0]
        sched.step()
        step += 1
    return {r.rid: list(r.output_ids) for r in reqs}


def test_join_and_abort_mid_decode_match_step_by_step():
    prompts = _prompts(3, seed=3)
    with _engine(False) as a, _engine(True) as b:
        want = list(_drive(a, prompts, join_at=6, abort_at=9).values())
        got = list(_drive(b, prompts, join_at=6, abort_at=9).values())
    # The others are unaffected; the aborted one stops earlier (its token in flight at the abort
    # is dropped), so its output is a prefix of the step-by-step one.
    assert got[1:] == want[1:]
    assert got[0] == want[0][: len(got[0])] and len(got[0]) >= len(want[0]) - 1
    assert 0 < len(want[0]) < 20 and len(want[1]) == 20 and len(want[2]) == 20


# ---- DSpark: fused all-greedy steps chained on the device -------------------------------------


def _dspark_engine(overlap: bool) -> Engine:
    """DSpark with (stand-in) graphs on CPU, so all-greedy steps run as fused step graphs; with
    the overlap schedule they chain (anchors and lengths stay on the device between steps)."""
    from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph

    engine = Engine(
        model_path="tiny",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=8,
        device="cpu",
        disable_overlap_schedule=not overlap,
        speculative_algorithm="DSpark",
        speculative_dspark_block_size=4,
    )
    engine.init_graphs(8, graph_factory=EagerGraph)
    return engine


def _count_chained(engine: Engine) -> list[bool]:
    fused = engine.spec.fused
    chained: list[bool] = []
    if fused is None:  # step by step: the eager step, no fused graphs
        return chained
    launch = fused.launch
    fused.launch = lambda w, rows, ch, _f=launch, _log=chained: (  # type: ignore[method-assign]
        (_log.append(ch), _f(w, rows, ch))[1]
    )
    return chained


def test_dspark_fused_steps_with_stops_and_a_sampled_request_equal_step_by_step():
    """Greedy requests stopping at different steps plus one seeded sampled request (which keeps
    the batch on the worker's own step until it ends): tokens and finish reasons equal the
    step-by-step schedule, and chained fused steps ran."""
    prompts = _prompts(5, seed=11)
    params = [
        {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in (3, 11, 26, 17, 30)
    ]
    params[3]["stop_token_ids"] = [5, 17, 99]
    params.append(
        {"max_new_tokens": 9, "temperature": 0.8, "top_p": 0.9, "seed": 3, "ignore_eos": True}
    )
    prompts = prompts + _prompts(1, seed=12)
    outs = {}
    for overlap in (False, True):
        with _dspark_engine(overlap) as engine:
            chained = _count_chained(engine)
            outs[overlap] = (
                engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True),
                chained,
            )
    (want, chained_s), (got, chained_o) = outs[False], outs[True]
    assert [_summary(o) for o in got] == [_summary(o) for o in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(_logprobs(g), _logprobs(w), rtol=1e-5, atol=1e-5)
    assert not chained_s and chained_o.count(True) >= 5
    assert len({len(o["output_ids"]) for o in got}) >= 4


def test_dspark_fused_join_and_abort_mid_decode_match_step_by_step():
    prompts = _prompts(3, seed=13)
    with _dspark_engine(False) as a, _dspark_engine(True) as b:
        chained = _count_chained(b)
        want = list(_drive(a, prompts, join_at=4, abort_at=7).values())
        got = list(_drive(b, prompts, join_at=4, abort_at=7).values())
    # As for plain decode: the others are unaffected, the aborted one is a prefix (a DSpark step
    # commits up to a block of tokens, so it may stop up to one step's commit earlier).
    assert got[1:] == want[1:]
    assert got[0] == want[0][: len(got[0])] and len(got[0]) >= 1
    assert chained.count(True) >= 2
