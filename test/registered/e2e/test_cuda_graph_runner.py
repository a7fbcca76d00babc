"""CUDA-graph runner: graphed decode/verify/draft steps produce the same greedy tokens as
eager steps. On CPU the graphs are `EagerGraph` stand-ins with CUDA-graph buffer semantics (the
capture's output tensors are rewritten by every replay), which checks the static buffers, the
padding to batch buckets with dummy requests, the uniform verify widths and the draft-graph
slicing. On a GPU the same comparisons run with real CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.model_executor.cuda_graph_runner import (
    BatchGraphs,
    CudaGraphRunner,
    EagerGraph,
    graph_batch_sizes,
)
from sgl_dspark.srt.model_executor.target_graphs import TargetGraphs
from sgl_dspark.srt.speculative.dspark.executor import DSparkExecutor
from sgl_dspark.srt.speculative.dspark.width_policy import VerifyWidthPolicy
from spec_utils import POLICIES, greedy_requests, policy_kwargs, write_policy_tables

N_PROMPTS = 7


class CountingGraph(EagerGraph):
    replays = 0

    def replay(self) -> None:
        CountingGraph.replays += 1
        super().replay()


def _requests(vocab: int = 263):
    # different lengths: the running batch shrinks through several buckets (padding rows)
    return greedy_requests(N_PROMPTS, 3, 30, 6, 5, vocab)


def _generate(graph_bs: int | None, **kw) -> tuple[list[list[int]], Engine]:
    engine = Engine(
        model_path="tiny",
        device="cpu",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=N_PROMPTS,
        **kw,
    )
    if graph_bs is not None:
        engine.init_graphs(graph_bs, graph_factory=CountingGraph)
    prompts, params = _requests()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    pages = engine.runner.allocator
    assert pages.num_free_pages == pages.num_usable_pages
    return [o["output_ids"] for o in outs], engine


@pytest.fixture(scope="module")
def reference():
    return _generate(None)[0]


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(32)[-3:] == [16, 24, 32]
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        graph_batch_sizes(0)


def test_batch_graphs_share_static_buffers(monkeypatch):
    """Two families given one static buffer both read it (each replay copies its input first,
    padding rows take the pad value); an input that already is the buffer's rows (one graph's
    output read by the next) is not copied again; a buffer of the wrong shape is refused."""
    graphs = CudaGraphRunner(torch.device("cpu"), graph_factory=EagerGraph)
    shared = torch.full((4, 3), 7.0)
    example = [torch.zeros(1, 3)]
    double = BatchGraphs(graphs, "double", lambda x: (x * 2,), example, [-1.0], [2, 4], [shared])
    plus = BatchGraphs(graphs, "plus", lambda x: (x + 1,), example, [-1.0], [2, 4], [shared])
    assert double.static[0] is shared and plus.static[0] is shared
    graphs.capture()
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    (a,) = double.replay(x)
    assert torch.equal(a, torch.tensor([[2.0, 4.0, 6.0], [8.0, 10.0, 12.0], [14.0, 16.0, 18.0]]))
    assert torch.equal(shared[3], torch.tensor([-1.0, -1.0, -1.0]))  # the padding row
    (b,) = plus.replay(x[:2])
    assert torch.equal(b, torch.tensor([[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]]))

    copies_into_shared = []
    real_copy = torch.Tensor.copy_

    def copy_(dst, src, *args, **kwargs):
        if dst.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr():
            copies_into_shared.append(tuple(dst.shape))
        return real_copy(dst, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    shared[:2] = torch.tensor([[3.0, 1.0, 4.0], [1.0, 5.0, 9.0]])
    (c,) = plus.replay(shared[:2])
    assert torch.equal(c, torch.tensor([[4.0, 2.0, 5.0], [2.0, 6.0, 10.0]]))
    assert copies_into_shared == []
    plus.replay(shared[:2].clone())  # the same values elsewhere: copied
    assert copies_into_shared == [(2, 3)]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="narrow: static buffer 0"):
        BatchGraphs(graphs, "narrow", lambda x: (x,), example, [0.0], [2], [torch.zeros(2, 2)])


@pytest.mark.parametrize("on", [True, False])
def test_poisoning_stand_ins_clobber_the_outputs_of_later_captures(on):
    """With poisoning on, replaying a region overwrites the outputs that regions captured after
    it allocated (float NaN, integers a large negative value, booleans flipped), also those of a
    later capture round, and leaves alone its own outputs, those of earlier captures and outputs
    that are views of buffers a region was given. Off, nothing is overwritten."""
    graphs = CudaGraphRunner(torch.device("cpu"), graph_factory=lambda: EagerGraph(on))
    given = torch.arange(4.0)
    x = torch.tensor([1.0, 2.0])
    graphs.register("big", 0, lambda: (x * 3, given[:2]), launch_batch=1, size=2)
    graphs.register(
        "small",
        0,
        lambda: {"f": x + 1, "i": x.long(), "b": x > 1.5, "view": given[2:]},
        launch_batch=1,
        size=1,
    )
    graphs.capture()
    graphs.register("late", 0, lambda: (x * 5,), launch_batch=1)
    graphs.capture()
    (late,) = graphs.replay("late", 0)
    small = graphs.replay("small", 0)
    big, view = graphs.replay("big", 0)
    assert torch.equal(big, torch.tensor([3.0, 6.0]))  # its own: fresh
    assert torch.equal(view, torch.tensor([0.0, 1.0])) and torch.equal(small["view"], given[2:])
    if on:
        assert small["f"].isnan().all() and late.isnan().all()
        assert (small["i"] < -(2**29)).all()
        assert small["b"].tolist() == [True, False]  # [False, True] flipped
    else:
        assert torch.equal(small["f"], torch.tensor([2.0, 3.0]))
        assert small["b"].tolist() == [False, True] and torch.equal(late, x * 5)
    graphs.replay("small", 0)  # replaying the later region rewrites its outputs
    assert torch.equal(small["f"], torch.tensor([2.0, 3.0]))
    assert torch.equal(big, torch.tensor([3.0, 6.0]))  # an earlier capture's: kept


def test_decode_graphs_equal_eager(reference):
    CountingGraph.replays = 0
    got, engine = _generate(4)  # batches of 5..7 run eagerly, 1..4 replay padded buckets
    assert got == reference
    assert CountingGraph.replays > 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("gamma", [1, 4])
def test_dspark_graphs_equal_target_greedy(reference, tmp_path, monkeypatch, policy, gamma):
    recorded, eager_steps = [], []
    record, eager = VerifyWidthPolicy.record_step, DSparkExecutor.eager_step
    monkeypatch.setattr(
        VerifyWidthPolicy, "record_step", lambda p, *a: recorded.append(1) or record(p, *a)
    )
    monkeypatch.setattr(
        DSparkExecutor, "eager_step", lambda e, reqs: eager_steps.append(1) or eager(e, reqs)
    )
    kw = {
        "speculative_algorithm": "DSpark",
        "speculative_dspark_block_size": gamma,
        **policy_kwargs(policy, write_policy_tables(str(tmp_path), gamma)),
    }
    CountingGraph.replays = 0
    got, engine = _generate(6, **kw)  # 7 requests: eager until one finishes
    assert got == reference
    spec = engine.spec
    assert spec.draft_graphs is not None and CountingGraph.replays > 0
    if policy.startswith("confidence"):
        assert spec.worker.graph_verify_widths() == tuple(range(1, gamma + 2))
    # Host-known widths (full, static table or online) and the async confidence policy (full
    # width, its caps computed in the graph): all-greedy steps are fused step graphs, chained
    # by the overlap schedule. The sync policy plans on the host from the step's confidences:
    # the draft graph, then the folded greedy epilogue (acceptance + context-KV commit) replay.
    fused = policy != "confidence_sync"
    assert (spec.fused is not None and spec.fused.replays > 0) == fused
    epilogue_replays = sum(g.replays for g in spec.epilogue_graphs.values())
    assert (epilogue_replays > 0) == (not fused)
    assert (spec.draft_graphs.replays > 0) == (not fused)
    if getattr(spec.policy, "online", None) is not None:
        # Every speculative step feeds the online policy the step it verified (device counts),
        # a fused step as an eager one.
        assert recorded and len(recorded) == len(eager_steps) + spec.fused.replays


@pytest.mark.parametrize("accept_len", [None, 2.6])
def test_fused_steps_chained_equal_step_by_step(tmp_path, accept_len):
    """The overlap schedule chains fused DSpark steps on the device (anchors and lengths never
    visit the host between them); tokens and logprobs equal the step-by-step schedule, also
    with simulated acceptance (whose forced counts are host inputs of each launch)."""
    kw = {
        "speculative_algorithm": "DSpark",
        "speculative_dspark_block_size": 4,
        "speculative_dspark_simulate_accept_len": accept_len,
    }
    prompts, params = _requests()
    outs = {}
    for overlap in (True, False):
        engine = Engine(
            model_path="tiny",
            device="cpu",
            skip_tokenizer_init=True,
            context_length=256,
            max_running_requests=N_PROMPTS,
            disable_overlap_schedule=not overlap,
            **kw,
        )
        spec = engine.spec
        engine.init_graphs(N_PROMPTS, graph_factory=EagerGraph)
        chained: list[bool] = []
        # Step by step (no overlap schedule) runs the eager step: no fused graphs at all.
        assert (spec.fused is not None) == overlap
        if spec.fused is not None:
            launch = spec.fused.launch
            spec.fused.launch = lambda w, rows, ch, _f=launch, _log=chained: (  # type: ignore[method-assign]
                (_log.append(ch), _f(w, rows, ch))[1]
            )
        res = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        outs[overlap] = ([o["output_ids"] for o in res], [o["meta_info"] for o in res], chained)
        engine.shutdown()
    (ids_o, meta_o, chained_o), (ids_s, meta_s, chained_s) = outs[True], outs[False]
    assert ids_o == ids_s
    assert chained_o.count(True) > len(prompts) and not chained_s
    for a, b in zip(meta_o, meta_s):
        assert a["spec_verify_ct"] == b["spec_verify_ct"]
        torch.testing.assert_close(
            torch.tensor([lp for lp, _, _ in a["output_token_logprobs"]]),
            torch.tensor([lp for lp, _, _ in b["output_token_logprobs"]]),
        )


def _tiny_runner_batch(engine: Engine, mode: ForwardMode, lens: list[int]) -> ForwardBatch:
    pool = engine.runner.req_pool
    slots = [pool.alloc_slot() for _ in lens]
    for s, n in zip(slots, lens):
        pool.reserve(s, 8 + n)
    return ForwardBatch.build(
        mode, [[5] * n for n in lens], [8] * len(lens), slots, pool.req_to_token, logits_rows="all"
    )


def test_can_run_only_uniform_captured_shapes():
    engine = Engine(
        model_path="tiny",
        device="cpu",
        skip_tokenizer_init=True,
        context_length=64,
        max_running_requests=16,
    )
    runner = engine.runner

    def target_graphs(batch_sizes, widths) -> TargetGraphs:
        runner_graphs = CudaGraphRunner(runner.device, graph_factory=EagerGraph)
        return TargetGraphs(runner_graphs, runner, batch_sizes, widths, None)

    graphs = target_graphs([1, 2], [1, 3])
    assert graphs.can_run(_tiny_runner_batch(engine, ForwardMode.DECODE, [1, 1]), ())
    assert graphs.can_run(_tiny_runner_batch(engine, ForwardMode.VERIFY, [3]), ())
    assert not graphs.can_run(_tiny_runner_batch(engine, ForwardMode.EXTEND, [1]), ())
    assert not graphs.can_run(_tiny_runner_batch(engine, ForwardMode.VERIFY, [3, 2]), ())
    assert not graphs.can_run(_tiny_runner_batch(engine, ForwardMode.VERIFY, [2]), ())
    # Tap streams are not graph outputs: a forward that asks for them runs eagerly.
    assert not graphs.can_run(_tiny_runner_batch(engine, ForwardMode.DECODE, [1]), (0,))
    assert not graphs.can_run(_tiny_runner_batch(engine, ForwardMode.DECODE, [1, 1, 1]), ())
    assert graphs.width_for(2) == 3 and graphs.width_for(4) is None
    with pytest.raises(ValueError, match="max_verify_tokens"):
        target_graphs([1], [runner.rc.max_verify_tokens + 1])
    with pytest.raises(ValueError, match="max-running-requests"):
        target_graphs([17], [1])


def test_one_graph_runner_captures_every_family_once():
    """Every family registers with the one runner and is captured by one `capture()`; a key
    registered twice is an error, and replays are counted per family."""
    engine = Engine(
        model_path="tiny",
        device="cpu",
        skip_tokenizer_init=True,
        context_length=64,
        max_running_requests=4,
        speculative_algorithm="DSpark",
    )
    engine.init_graphs(2, prefill_max_tokens=32, graph_factory=CountingGraph)
    graphs = engine.graphs
    families = {family for family, _ in graphs._graphs}
    assert {"prefill", "target width 1", "DSpark draft", "DSpark fused step"} <= families
    assert any(f.startswith("DSpark acceptance width") for f in families)
    with pytest.raises(AssertionError, match="captured once"):
        engine.init_graphs(2, graph_factory=CountingGraph)
    with pytest.raises(ValueError, match="registered twice"):
        graphs.register("prefill", 16, lambda: None, launch_batch=16)
        graphs.register("prefill", 16, lambda: None, launch_batch=16)
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    engine.generate(input_ids=[[5, 6, 7], [8, 9, 10, 11]], sampling_params=params)
    assert graphs.replays["prefill"] > 0 and graphs.replays["DSpark fused step"] > 0


# ---- real CUDA graphs ------------------------------------------------------------------------
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_generate(**kw) -> list[list[int]]:
    engine = Engine(
        model_path="tiny",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=N_PROMPTS,
        device="cuda",
        dtype="float32",
        kernel_backend="triton",
        **kw,
    )
    prompts, params = _requests()
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


@cuda_only
@pytest.mark.parametrize(
    "spec",
    [
        None,
        ("full", 7),
        ("full", 3),
        ("static_table", 5),
        ("static_online", 4),
        ("confidence_sync", 3),
        ("confidence_async", 7),
        ("bs1_runtime", 3),
    ],
)
def test_cuda_graphs_equal_eager_and_cpu(reference, tmp_path, spec):
    kw: dict = {}
    if spec is not None:
        policy = "full" if spec[0] == "bs1_runtime" else spec[0]
        kw = {
            "speculative_algorithm": "DSpark",
            "speculative_dspark_block_size": spec[1],
            **policy_kwargs(policy, write_policy_tables(str(tmp_path), spec[1])),
        }
        if spec[0] == "bs1_runtime":
            kw["speculative_dspark_bs1_block_size"] = 7
    graphed = _cuda_generate(cuda_graph_max_bs=6, **kw)
    eager = _cuda_generate(disable_cuda_graph=True, **kw)
    assert graphed == eager
    assert graphed == reference


@cuda_only
@pytest.mark.parametrize("spec_width", [None, 3])
def test_split_compressor_pooling_in_graphs(reference, monkeypatch, spec_width):
    """Every compressor row split over 16-channel programs (the path of wide HCA rows; the tiny
    model's rows fit one program): the arrival counters live in the KV pool across graph
    replays, and graphs, eager and CPU still give the same tokens."""
    import importlib

    pool_module = importlib.import_module("sgl_dspark.kernels.compressor.pool")
    default = pool_module._pool_meta
    monkeypatch.setattr(
        pool_module, "_pool_meta", lambda d, s: {**default(d, s), "BLOCK_C": 16, "SPAN_BLOCK": 16}
    )
    kw: dict = {}
    if spec_width is not None:
        kw = {"speculative_algorithm": "DSpark", "speculative_dspark_block_size": spec_width}
    graphed = _cuda_generate(cuda_graph_max_bs=6, **kw)
    assert graphed == _cuda_generate(disable_cuda_graph=True, **kw)
    assert graphed == reference


@cuda_only
@pytest.mark.parametrize("spec_width", [None, 3])
def test_plain_launches_above_the_programmatic_batch_limit(reference, spec_width):
    """--programmatic-launch-max-bs 2: buckets 1 and 2 are captured with programmatic launches,
    4 and 6 with plain ones (the batch shrinks through all of them as requests finish); the
    tokens stay those of eager and CPU runs."""
    kw: dict = {}
    if spec_width is not None:
        kw = {"speculative_algorithm": "DSpark", "speculative_dspark_block_size": spec_width}
    try:
        graphed = _cuda_generate(cuda_graph_max_bs=6, programmatic_launch_max_bs=2, **kw)
    finally:
        from sgl_dspark.kernels._triton_utils import set_programmatic_launch

        set_programmatic_launch(True)  # process-wide: leave the default for later tests
    assert graphed == reference


@pytest.mark.parametrize("graphs", [False, True])
def test_bs1_runtime_block_size_is_lossless(reference, graphs, monkeypatch):
    """Single-request steps draft their own block size (the bs1 runtime) and verify its full
    window; the last request decodes alone, so both runtimes run. With graphs the all-greedy
    steps are fused step graphs, the single-request ones at the bs1 runtime's width."""
    from sgl_dspark.srt.speculative.dspark.executor import DSparkExecutor
    from sgl_dspark.srt.speculative.dspark.fused_step import FusedGreedySteps

    used: list[tuple[int, int]] = []  # the eager steps' proposals: (requests, block size)
    fused: list[tuple[int, int]] = []  # fused step graphs: (requests, verify width)
    real, real_launch = DSparkExecutor._propose, FusedGreedySteps.launch

    def spy(self, batch_size, *args):
        used.append((batch_size, args[-1]))
        return real(self, batch_size, *args)

    def spy_launch(self, width, host_rows, chained):
        fused.append((len(host_rows[0]), width))
        return real_launch(self, width, host_rows, chained)

    monkeypatch.setattr(DSparkExecutor, "_propose", spy)
    monkeypatch.setattr(FusedGreedySteps, "launch", spy_launch)
    kw = {
        "speculative_algorithm": "DSpark",
        "speculative_dspark_block_size": 2,
        "speculative_dspark_bs1_block_size": 5,
    }
    got, engine = _generate(6 if graphs else None, **kw)
    assert got == reference
    assert all(g == (5 if b == 1 else 2) for b, g in used)
    assert all(w == (6 if b == 1 else 3) for b, w in fused)
    steps = used + fused
    assert any(b == 1 for b, _ in steps) and any(b > 1 for b, _ in steps)
    if graphs:
        spec = engine.spec
        assert spec.draft_graphs_bs1 is not None
        assert 6 in spec.worker.graph_verify_widths()
        assert (1, 6) in fused  # the bs1 runtime ran as a fused step graph
        assert spec.fused is not None and spec.fused.has(6, 1) and not spec.fused.has(3, 1)
    else:
        assert not fused and (1, 5) in used


@pytest.mark.parametrize("overlap", [False, True])
def test_verify_near_the_context_end_falls_back_to_ragged_rows(monkeypatch, overlap):
    """A graph width that would run past the context table is not used: the step verifies its
    own (ragged) lengths eagerly, and the output still equals target-only greedy decoding. With
    the overlap schedule the fused step graphs run until the context end is near, then the
    worker's own step takes over."""
    from sgl_dspark.srt.speculative.dspark.executor import DSparkExecutor

    prompt = list(range(7, 57))  # 50 tokens; context table of 64
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 13}

    def run(**kw) -> tuple[list[int], Engine]:
        engine = Engine(
            model_path="tiny",
            device="cpu",
            skip_tokenizer_init=True,
            context_length=64,
            max_running_requests=2,
            disable_overlap_schedule=not overlap,
            **kw,
        )
        if engine.spec is not None:
            engine.init_graphs(1, graph_factory=EagerGraph)
        return engine.generate(input_ids=prompt, sampling_params=params)["output_ids"], engine

    rows_seen: list[tuple[list[int], list[int]]] = []
    real = DSparkExecutor._verify_rows

    def spy(self, reqs, lens):
        rows = real(self, reqs, lens)
        graphs = self.decode.target_graphs
        rounded = graphs.width_for(max(lens))
        fits = rounded is not None and reqs[0].kv_len + rounded <= limit
        rows_seen.append((list(lens), list(rows), fits))
        return rows

    limit = 64  # context_length 64 is a whole number of pages of the tiny model
    monkeypatch.setattr(DSparkExecutor, "_verify_rows", spy)
    want, _ = run()
    got, engine = run(speculative_algorithm="DSpark", speculative_dspark_block_size=7)
    assert engine.runner.req_pool.max_context_len == limit
    assert got == want
    # graph widths while they fit, the request's own lengths once the rounded width would not
    # (with the overlap schedule, the steps that fit are fused step graphs instead)
    if overlap:
        assert engine.spec.fused.replays > 0
    else:
        assert any(fits and rows == [8] for _, rows, fits in rows_seen)
    assert any(not fits and rows == lens for lens, rows, fits in rows_seen)
    assert all(rows == lens for lens, rows, fits in rows_seen if not fits)


# ---- DeepSeek-V4.1 (tiny-v41 and its built-in DSpark draft) with real CUDA graphs ------------
@pytest.fixture(scope="module")
def v41_reference():
    """tiny-v41's target-only greedy output on the CPU (torch kernels, fp32)."""
    engine = Engine(
        model_path="tiny-v41",
        device="cpu",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=N_PROMPTS,
    )
    prompts, params = _requests()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    engine.shutdown()
    return [o["output_ids"] for o in outs]


def _cuda_generate_v41(**kw) -> tuple[list[list[int]], Engine]:
    engine = Engine(
        model_path="tiny-v41",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=N_PROMPTS,
        device="cuda",
        dtype="float32",
        kernel_backend="triton",
        **kw,
    )
    prompts, params = _requests()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [o["output_ids"] for o in outs], engine


@cuda_only
@pytest.mark.parametrize(
    ("spec", "overlap"),
    [
        (None, True),
        (None, False),
        (("full", 5), True),
        (("full", 5), False),
        (("full", 2), True),
        (("static_table", 4), True),
        (("static_online", 3), False),
        (("confidence_sync", 3), True),
        (("confidence_async", 5), True),
        (("bs1_runtime", 3), True),
    ],
)
def test_tiny_v41_cuda_graphs_equal_eager_and_cpu(v41_reference, tmp_path, spec, overlap):
    """Every V4.1 path in real graphs (decode, verify widths, the bs-1 runtime, prefill, the
    fused DSpark steps when the overlap schedule chains them): the same tokens as eager CUDA
    and as target-only greedy on the CPU."""
    kw: dict = {"disable_overlap_schedule": not overlap}
    if spec is not None:
        policy = "full" if spec[0] == "bs1_runtime" else spec[0]
        kw |= {
            "speculative_algorithm": "DSpark",
            "speculative_dspark_block_size": spec[1],
            **policy_kwargs(policy, write_policy_tables(str(tmp_path), spec[1])),
        }
        if spec[0] == "bs1_runtime":
            kw["speculative_dspark_bs1_block_size"] = 6
    # graph buckets up to every request at once: the first prefill (all prompts) fits a graph
    graphed, engine = _cuda_generate_v41(cuda_graph_max_bs=N_PROMPTS, **kw)
    graphs = engine.graphs
    assert graphs is not None and graphs.replays["prefill"] > 0
    # the target's decode / verify graphs, or (overlap on, DSpark) the fused steps holding them
    graphed_steps = [k for k in graphs.replays if k.startswith("target width")]
    graphed_steps += [k for k in graphs.replays if k == "DSpark fused step"]
    assert graphed_steps, graphs.replays
    engine.shutdown()
    eager, engine = _cuda_generate_v41(disable_cuda_graph=True, **kw)
    engine.shutdown()
    assert graphed == eager
    assert graphed == v41_reference
